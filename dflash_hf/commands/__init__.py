"""Sub-commands of the `dflash-hf` CLI (see `dflash_hf.cli`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--target` and `--drafter`, shared by the commands that run a target with a drafter."""
    from ..targets import DEFAULT_TARGET, TARGETS

    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"Named target ({', '.join(TARGETS)}), model folder or Hub id (default: {DEFAULT_TARGET}).",
    )
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="DFlash drafter folder (default: the drafter bundled for a named target).",
    )
