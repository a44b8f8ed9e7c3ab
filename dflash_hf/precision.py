"""`--dtype auto` on a CPU that computes bfloat16 natively: measure which precision runs a DFlash cycle faster here.

Whether bf16 pays on a CPU is not a property of its instruction set alone. An exact bf16 verify must give every block
row the bits of a 1-token step (`target.row_exact`), which costs per-row attention calls; whether the cheaper bf16
matmuls make up for that depends on the CPU, the target and the block size. So the first `auto` run on a machine
measures one cycle as the engine runs it (a verify of the widest tree the call will verify, e.g. a block of B plus
its prompt-lookup branch, and a draft of B tokens) in float32 and in row-exact bfloat16 and keeps the faster; the
verdict, with the measured times, is stored in `<dflash-hf cache>/precision.json` under the CPU model, torch version,
thread count, target, block size and verify width, so later runs only read it.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from . import runtime
from .costs import cycle_ms
from .fileio import atomic_write_text
from .modeling import DFlashDraftModel
from .target import row_exact

VERDICTS_FILE = "precision.json"


def verdict_key(target: str, max_block: int, verify_tokens: int) -> str:
    """What a stored verdict depends on: CPU model, torch version, threads and MKL mode, target, block size and
    verify width."""
    host = f"{runtime.cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    host += f" | {runtime.mkl_mode()}"
    return f"{host} | {target} | B={max_block} | W={verify_tokens}"


def _load(target: str, drafter_dir: Path, device: torch.device, dtype: torch.dtype):
    from .drafters import load_drafter
    from .targets import load_target

    model, tokenizer = load_target(target, dtype=dtype, device=device)
    return model, tokenizer, load_drafter(drafter_dir, model)


def _cycle_ms(model: PreTrainedModel, drafter: DFlashDraftModel, max_block: int, verify_tokens: int) -> float:
    """Verify of `verify_tokens` tokens + a draft of a `max_block` block, in ms, as the engine runs them: the cycle a
    verdict compares (on a 128-token context, 3 timed rounds)."""
    return cycle_ms(model, drafter, max_block, verify_tokens, context_tokens=128, repeats=3)


def measured_choice(
    target: str, drafter_dir: Path, device: torch.device, max_block: int, verify_tokens: int, cache: Path
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, DFlashDraftModel, str]:
    """Load `(target, tokenizer, drafter, precision)` in the precision that runs a cycle (a `verify_tokens`-token verify
    and a `max_block` draft) faster on this CPU, measuring it on the first run (see the module docstring) and reading
    the stored verdict afterwards."""
    path = cache / VERDICTS_FILE
    try:
        verdicts = json.loads(path.read_text())
    except (OSError, ValueError):
        verdicts = {}
    key = verdict_key(target, max_block, verify_tokens)
    feature = runtime.native_bf16_feature()  # through the module: tests stand in for the host's CPU
    verdict = verdicts.get(key)
    if verdict is None:
        fp32 = _load(target, drafter_dir, device, torch.float32)
        fp32_ms = _cycle_ms(fp32[0], fp32[2], max_block, verify_tokens)
        bf16 = _load(target, drafter_dir, device, torch.bfloat16)
        exact = bool(row_exact.install_if_needed(bf16[0], verify_tokens))
        bf16_ms = _cycle_ms(bf16[0], bf16[2], max_block, verify_tokens) if exact else None
        faster_bf16 = bf16_ms is not None and bf16_ms < fp32_ms
        verdict = {
            "dtype": "bfloat16" if faster_bf16 else "float32",
            "float32_cycle_ms": round(fp32_ms, 1),
            "bfloat16_cycle_ms": None if bf16_ms is None else round(bf16_ms, 1),
            "bfloat16_exact": exact,
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        verdicts[key] = verdict
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(verdicts, indent=1) + "\n")
        model, tokenizer, drafter = bf16 if faster_bf16 else fp32
    else:
        model, tokenizer, drafter = _load(target, drafter_dir, device, getattr(torch, verdict["dtype"]))
        if row_exact.install_if_needed(model, verify_tokens) is False:
            model, tokenizer, drafter = _load(target, drafter_dir, device, torch.float32)
    if not verdict["bfloat16_exact"]:
        why = "its block verification is not bit-exact here"
    else:
        cycle = f"B={max_block}" if verify_tokens == max_block else f"B={max_block} (verify of {verify_tokens} tokens)"
        why = (
            f"a {cycle} cycle measured {verdict['bfloat16_cycle_ms']} ms in row-exact bfloat16 vs "
            f"{verdict['float32_cycle_ms']} ms in float32"
        )
    reason = (
        f"auto: this CPU computes bfloat16 natively ({feature}), but {why}"
        if model.dtype == torch.float32
        else (f"auto: this CPU computes bfloat16 natively ({feature}) and {why}")
    )
    return (
        model,
        tokenizer,
        drafter,
        f"{str(model.dtype).replace('torch.', '')} ({reason}; verdict kept in {path.name} in the dflash-hf cache)",
    )
