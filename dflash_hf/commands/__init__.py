"""Sub-commands of the `dflash-hf` CLI (see `dflash_hf.cli`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def load_models(target: str, drafter_dir: Path, device: torch.device, dtype: str = "float32", max_block: int = 16):
    """Load `(target, tokenizer, drafter, precision)` on `device`, the drafter in the target's dtype, without loading
    bars. `precision` says which dtype was used and why (see `runtime.inference_dtype`).

    A reduced-precision target on CPU is made row-exact for blocks of up to `max_block` tokens
    (`engine.row_exact.install`); with `dtype="auto"` a machine where that is not bit-exact falls back to float32.
    """
    from transformers.utils import logging as hf_logging

    from ..engine import row_exact
    from ..modeling import DFlashDraftModel
    from ..runtime import inference_dtype
    from ..targets import load_target

    chosen, reason = inference_dtype(dtype, device)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading bars would interleave with the output; cache builds show their own
    try:
        model, tokenizer = load_target(target, dtype=chosen, device=device)
        if device.type == "cpu" and chosen != torch.float32 and not row_exact.install(model, max_block):
            if dtype == "auto":
                reason += "; but its block verification is not bit-exact here, so float32"
                model, tokenizer = load_target(target, dtype=torch.float32, device=device)
            else:
                reason += "; block verification NOT bit-exact on this CPU"
        elif device.type == "cpu" and chosen != torch.float32:
            reason += "; block verification checked bit-exact"
        drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=model.dtype).to(device).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    precision = f"{str(model.dtype).replace('torch.', '')} ({reason})"
    return model, tokenizer, drafter, precision


def add_model_arguments(parser: argparse.ArgumentParser, dtype: bool = True) -> None:
    """`--target`, `--drafter` and (with `dtype`) `--dtype`, shared by the commands that run a target with a
    drafter."""
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
    if not dtype:
        return
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="Precision of both models (default: auto = bfloat16 on CUDA and on CPUs with native bf16 (AMX-BF16 / "
        "AVX512-BF16) where block verification is checked bit-exact, else float32). Plain greedy decoding, the "
        "reference for exactness and speed, runs in the same precision.",
    )
