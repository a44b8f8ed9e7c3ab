"""`dflash-hf cache-features`: store the target's tapped features once for offline training."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    """Add the `cache-features` sub-command to `subparsers`."""
    parser = subparsers.add_parser(
        "cache-features",
        help="Store the target's tapped hidden states of a make-data set (bf16 safetensors shards, resumable).",
    )
    parser.add_argument("--target", required=True, help="Named target, folder or Hub id (the one that made the data).")
    parser.add_argument("--data", required=True, help="A `dflash-hf make-data` folder.")
    parser.add_argument("--out", required=True, help="Features folder (resumed if it exists).")
    parser.add_argument(
        "--target-layer-ids", type=int, nargs="+", default=None, help="Tapped layers (default: spread)."
    )
    parser.add_argument("--num-target-features", type=int, default=5, help="Number of taps if no ids are given.")
    parser.add_argument("--drafter", default=None, help="Take the tapped layers from this drafter's config.")
    parser.add_argument("--max-length", type=int, default=3072, help="Truncate rows to this many tokens.")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=512, help="Approximate shard size in MiB.")
    parser.add_argument(
        "--no-final-hidden",
        dest="final_hidden",
        action="store_false",
        help="Do not store the target's final hidden states (the distillation teacher; H values per token).",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quiet", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `cache-features`; returns the exit code."""
    from ..data.features import cache_features
    from ..data.make import load_training_data
    from ..modeling import DFlashConfig, default_target_layer_ids
    from ..runtime import default_device
    from ..targets import load_target

    data = load_training_data(args.data)
    target, _ = load_target(args.target, dtype=args.dtype, device=args.device or default_device())
    layer_ids = args.target_layer_ids
    if args.drafter:
        layer_ids = list(DFlashConfig.from_pretrained(args.drafter).target_layer_ids)
    if layer_ids is None:
        text = target.config.get_text_config(decoder=True)
        layer_ids = default_target_layer_ids(int(text.num_hidden_layers), args.num_target_features)
    index = cache_features(
        target,
        data,
        args.out,
        layer_ids,
        target_name=args.target,
        max_length=args.max_length,
        batch_size=args.batch_size,
        shard_bytes=args.shard_mb * 2**20,
        final_hidden=args.final_hidden,
        progress=not args.quiet,
    )
    print(json.dumps({"out": args.out, "rows": index["num_rows"], "target_layer_ids": index["target_layer_ids"]}))
    return 0
