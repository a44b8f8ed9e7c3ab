"""Sub-commands of the `dflash-hf` CLI (see `dflash_hf.cli`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def load_models(target: str, drafter_dir: Path, device: torch.device):
    """Load `(target, tokenizer, drafter)` on `device`, the drafter in the target's dtype, without loading bars."""
    from transformers.utils import logging as hf_logging

    from ..modeling import DFlashDraftModel
    from ..targets import load_target

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading bars would interleave with the output; cache builds show their own
    try:
        model, tokenizer = load_target(target, device=device)
        drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=model.dtype).to(device).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model, tokenizer, drafter


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
