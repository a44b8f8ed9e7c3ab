"""`dflash-hf cache-features`: store the target's tapped features once for offline training."""

from __future__ import annotations

import argparse
import json
import sys

from . import add_tap_arguments, device_of, target_layer_ids_of


def register(subparsers) -> None:
    """Add the `cache-features` sub-command to `subparsers`."""
    parser = subparsers.add_parser(
        "cache-features",
        help="Store the target's tapped hidden states of a make-data set (bf16 safetensors shards, resumable).",
    )
    parser.add_argument("--target", required=True, help="Named target, folder or Hub id (the one that made the data).")
    parser.add_argument("--data", required=True, help="A `dflash-hf make-data` folder.")
    parser.add_argument("--out", required=True, help="Features folder (resumed if it exists).")
    add_tap_arguments(parser)
    parser.add_argument("--max-length", type=int, default=3072, help="Truncate rows to this many tokens.")
    parser.add_argument(
        "--first-row",
        type=int,
        default=0,
        help="Leave out the rows before this one (for training that skips them with skip_train_samples).",
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=512, help="Approximate shard size in MiB.")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="The target's precision (features are stored in bf16 either way); auto: bfloat16 on CUDA and on CPUs "
        "that compute it natively (AMX / AVX512-BF16), float32 elsewhere (emulated bf16 is several times slower)",
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bars.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `cache-features`; returns the exit code."""
    from ..data.features import cache_features
    from ..data.make import load_training_data
    from ..runtime import inference_dtype
    from ..targets import load_target

    if args.shard_mb < 1:
        raise ValueError(f"--shard-mb must be >= 1 (MiB of features per shard file), got {args.shard_mb}.")
    data = load_training_data(args.data)
    device = device_of(args.device)
    dtype, why = inference_dtype(args.dtype, device)
    print(f"cache-features: target in {str(dtype).removeprefix('torch.')} ({why})", file=sys.stderr)
    target, _ = load_target(args.target, dtype=dtype, device=device, progress=not args.quiet)
    layer_ids = target_layer_ids_of(args, target)
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
        first_row=args.first_row,
        progress=not args.quiet,
    )
    print(json.dumps({"out": args.out, "rows": index["num_rows"], "target_layer_ids": index["target_layer_ids"]}))
    return 0
