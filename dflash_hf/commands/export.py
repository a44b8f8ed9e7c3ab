"""`dflash-hf export`: write a trained drafter as a Hub-ready folder (see `dflash_hf.export`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..bench.report import card_metrics
from ..bench.results import BENCH_FORMAT
from ..drafters import drafter_source
from ..fileio import read_json
from ..hub.export import EXPORT_FORMATS, export
from ..hub.gguf import GGUF_TYPES
from ..hub_cards import normalize_metrics
from ..modeling import DFlashDraftModel


def _read_json(path: Path | None) -> Any:
    return None if path is None else read_json(path, "pass a JSON file (see `dflash-hf export --help`).")


def _metrics(paths: list[Path] | None, drafter: str) -> list[dict[str, Any]] | None:
    """The card's results rows from `--metrics` files: a `dflash-hf bench` run's `bench.json` gives the rows of the
    exported drafter (the run's `--drafter` or one of its `--compare-drafter`s: `bench.card_metrics`), any other
    file holds rows as `render_model_card` takes them."""
    if not paths:
        return None
    rows: list[dict[str, Any]] = []
    for path in paths:
        document = _read_json(path)
        if isinstance(document, dict) and document.get("format") == BENCH_FORMAT:
            rows += card_metrics(document, _bench_tag(document, drafter, path))
        else:
            rows += normalize_metrics(document)
    return rows


def _bench_tag(document: dict[str, Any], drafter: str, path: Path) -> str | None:
    """Which drafter of a bench run is `drafter`: `None` for the run's own, a `--compare-drafter` name; a
    `ValueError` when the run did not measure it."""
    settings = document["settings"]
    measured = {None: settings.get("drafter"), **(settings.get("compared_drafters") or {})}
    same = [tag for tag, folder in measured.items() if folder and _same_folder(folder, drafter)]
    if not same:
        raise ValueError(
            f"--metrics {path} measured {', '.join(str(f) for f in measured.values() if f)}, not {drafter}: pass the "
            "bench run of the drafter being exported (`dflash-hf bench --drafter DRAFTER`)."
        )
    return same[0]


def _same_folder(a: str, b: str) -> bool:
    """Whether two drafter names are the same folder (or the same Hub id)."""
    if Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def run(args: argparse.Namespace) -> int:
    """Run `export`; returns the exit code."""
    metrics = _metrics(args.metrics, args.drafter)
    training = _read_json(args.training)
    drafter = DFlashDraftModel.from_pretrained(drafter_source(args.drafter))
    out_dir = export(
        drafter,
        args.out_dir,
        target=args.target,
        metrics=metrics,
        format=args.format,
        base_model=args.base_model,
        repo_id=args.repo_id,
        license=args.license,
        training=training,
        overwrite=args.overwrite,
        gguf_type=args.gguf_type,
        max_shard_size=args.max_shard_size,
    )
    print(f"exported {args.format} drafter to {out_dir}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export` sub-command to `subparsers`."""
    parser = subparsers.add_parser(
        "export",
        help="write a drafter as a Hub-ready folder (safetensors, remote code, model card) or a GGUF for llama.cpp",
        description="Write a DFlash drafter as a Hub-ready folder: config.json with auto_map, model.safetensors, "
        "remote code that needs only torch and transformers, and a README.md model card; or, with --format gguf, as "
        "one .gguf file for llama.cpp. The folder or file appears only once complete.",
    )
    parser.add_argument("drafter", help="drafter checkpoint: local folder or Hub id (dflash-hf or official layout)")
    parser.add_argument("out_dir", type=Path, help="folder to create (--format gguf: the .gguf file to write)")
    parser.add_argument(
        "--target",
        required=True,
        help="the target: named (see `dflash-hf generate --help`; its Hub id goes into the card), Hub id or local folder "
        "(only its config is read, except for --format speculators); for --format gguf: named, or the target's "
        ".gguf file (its tokenizer and LM head rows go into the drafter's file)",
    )
    parser.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="dflash-hf",
        help="dflash-hf (model_type dflash), official (z-lab layout read by SGLang and vLLM) or speculators (vLLM's "
        "speculators layout, reduced draft vocabulary included; loads the target's weights) or gguf (one file for "
        "llama.cpp: llama-server -md FILE --spec-type draft-dflash; no card)",
    )
    parser.add_argument(
        "--gguf-type",
        choices=GGUF_TYPES,
        default=None,
        help="--format gguf only: type of the drafter's weight matrices (norms stay f32; default: f32)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="dflash-hf and official formats: largest weight file (e.g. 15MB); larger weights become shards with an "
        "index (default: Transformers' save_pretrained default)",
    )
    parser.add_argument(
        "--metrics",
        type=Path,
        action="append",
        help="the card's results table (repeatable): a `dflash-hf bench` run of this drafter (its bench.json: a row "
        "per speculative method) or a JSON file of measured rows (tau, speedup, hardware, date; optional benchmark, "
        "block_size, temperature)",
    )
    parser.add_argument("--training", type=Path, help="JSON object of recorded training facts for the card")
    parser.add_argument("--base-model", help="the target's Hub id for the card, when --target is a local folder")
    parser.add_argument("--repo-id", help="Hub id the drafter will be published under (for the card's snippets)")
    parser.add_argument("--license", help="license of the card (default: the target card's, when available locally)")
    parser.add_argument("--overwrite", action="store_true", help="replace out_dir once the new export is complete")
    parser.set_defaults(func=run)
