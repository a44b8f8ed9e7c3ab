"""One bench run: every method on every prompt, interleaved, compared token by token with plain greedy decoding
(sampled methods: in speed only, against plain sampling at the same temperature).

The result is a [`BenchResult`] (`dflash_hf.bench.results`): per-prompt records and per-method summaries.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .. import mkl_choice
from ..modeling import DFlashDraftModel
from ..runtime import available_cpus, cpu_model, mkl_mode, native_bf16_feature
from .methods import BenchMethod, MethodRun, default_methods
from .profile import measure_costs
from .prompts import BenchPrompt
from .results import BenchResult, Mismatch, benchmark_summaries, compare_runs


def hardware_info(device: torch.device) -> dict[str, Any]:
    """CPU model, CPU and torch thread counts, accelerator and library versions of this machine."""
    info = {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16_feature(),
        "cpus_available": available_cpus(),
        "torch_threads": torch.get_num_threads(),
        "mkl": mkl_mode(),
        "mkl_choice": mkl_choice.reason(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        info["dflash_hf"] = importlib.metadata.version("dflash-hf")
    except importlib.metadata.PackageNotFoundError:
        info["dflash_hf"] = None
    return info


def run_bench(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    prompts: Sequence[BenchPrompt],
    max_new_tokens: int = 128,
    methods: Sequence[BenchMethod] | None = None,
    warmup_tokens: int = 16,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
    profile_costs: bool = True,
) -> BenchResult:
    """Run every method on every prompt and compare each output with plain greedy decoding.

    Args:
        target: The target model (eval mode, on its device).
        drafter: A DFlash drafter built for `target`, on the same device.
        prompts: The prompts (see [`dflash_hf.bench.prompts.load_bench_prompts`]; any `BenchPrompt` with token ids works).
        max_new_tokens: Most new tokens per prompt.
        methods: The methods to compare (default: [`default_methods`]); the first one is the reference for
            speedup and exactness and should be plain greedy decoding; a method with a `baseline` is compared with
            that method instead (see [`BenchMethod`]).
        warmup_tokens: Each method first decodes this many tokens of the first prompt, untimed (0: no warm-up).
        settings: Extra settings to record in the result (prompt source, threads, command-line options, ...).
        progress: Show tqdm progress bars.
        profile_costs: Also measure the forward costs of both models on this machine (see
            [`dflash_hf.bench.profile.measure_costs`]), after the methods' warm-up and before the timed runs.

    Returns:
        A [`BenchResult`]; `result.mismatches` lists every output that differs from greedy (also printed to stderr).
    """
    methods = _checked(
        prompts, max_new_tokens, warmup_tokens, default_methods(target, drafter) if methods is None else methods
    )
    inputs = [torch.tensor([p.input_ids], dtype=torch.long, device=target.device) for p in prompts]
    if warmup_tokens:
        _warm_up(methods, inputs[0], min(warmup_tokens, max_new_tokens), progress)
    costs = measure_costs(target, drafter) if profile_costs else None
    runs = _decode_all(methods, inputs, max_new_tokens, progress)
    results, summaries, mismatches = compare_runs(methods, runs, prompts)
    _print_mismatches(mismatches)
    recorded = _recorded_settings(target, drafter, len(prompts), methods, max_new_tokens, warmup_tokens)
    recorded.update(settings or {})
    return BenchResult(
        settings=recorded,
        hardware=hardware_info(target.device),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        prompts=[
            {"index": i, "id": p.id, "prompt_tokens": len(p.input_ids), "benchmark": p.benchmark}
            for i, p in enumerate(prompts)
        ],
        methods=summaries,
        results=results,
        mismatches=mismatches,
        cost_profile=costs,
        by_benchmark=benchmark_summaries(summaries, results, [p.benchmark for p in prompts]),
    )


def _recorded_settings(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    num_prompts: int,
    methods: list[BenchMethod],
    max_new_tokens: int,
    warmup_tokens: int,
) -> dict[str, Any]:
    """The settings a bench result records about its run, models and methods."""
    return {
        "max_new_tokens": max_new_tokens,
        "warmup_tokens": warmup_tokens,
        "decoding": "greedy",
        "batch_size": 1,
        "dtype": str(target.dtype).replace("torch.", ""),
        "target_model_type": getattr(target.config, "model_type", None),
        "drafter_block_size": int(drafter.config.block_size),
        "drafter_layers": int(drafter.config.num_hidden_layers),
        "target_layer_ids": list(drafter.config.target_layer_ids),
        "num_prompts": num_prompts,
        "methods": [m.name for m in methods],
    }


def _print_mismatches(mismatches: list[Mismatch]) -> None:
    """One `MISMATCH:` line on stderr per output that differs from greedy."""
    for mismatch in mismatches:
        print(
            f"MISMATCH: {mismatch.method} differs from greedy on prompt {mismatch.prompt} "
            f"({mismatch.prompt_id!r}) at new token {mismatch.position}: expected {mismatch.expected}, "
            f"got {mismatch.got} (lengths {mismatch.expected_length} vs {mismatch.got_length})",
            file=sys.stderr,
            flush=True,
        )


def _checked(
    prompts: Sequence[BenchPrompt], max_new_tokens: int, warmup_tokens: int, methods: Sequence[BenchMethod]
) -> list[BenchMethod]:
    """The methods as a list, once the arguments of [`run_bench`] are known to be valid (else a `ValueError`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if warmup_tokens < 0:
        raise ValueError(f"warmup_tokens must be >= 0, got {warmup_tokens}.")
    if not prompts:
        raise ValueError("No prompts to benchmark: pass at least one BenchPrompt.")
    for index, prompt in enumerate(prompts):
        if not prompt.input_ids:
            raise ValueError(f"Prompt {index} ({prompt.id!r}) has no tokens.")
    methods = list(methods)
    if not methods:
        raise ValueError("No methods to benchmark.")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"Method names must be unique, got {names}.")
    missing = sorted({m.baseline for m in methods if m.baseline is not None} - set(names))
    if missing:
        raise ValueError(f"Methods compare with {missing}, which are not among the methods {names}.")
    return methods


@torch.no_grad()
def _warm_up(methods: list[BenchMethod], prompt_ids: torch.LongTensor, tokens: int, progress: bool) -> None:
    """Every method decodes `tokens` tokens of `prompt_ids`, untimed (first-call set-up out of the timings)."""
    for method in tqdm(methods, desc="warm-up", unit="method", disable=not progress):
        method.run(prompt_ids, tokens)


@torch.no_grad()
def _decode_all(
    methods: list[BenchMethod], inputs: list[torch.LongTensor], max_new_tokens: int, progress: bool
) -> dict[str, list[MethodRun]]:
    """Run the methods prompt by prompt (interleaved); the runs of each method, by name."""
    runs: dict[str, list[MethodRun]] = {m.name: [] for m in methods}
    with tqdm(total=len(inputs) * len(methods), desc="bench", unit="run", disable=not progress) as bar:
        for index, prompt_ids in enumerate(inputs):
            for method in methods:
                bar.set_postfix_str(f"prompt {index} {method.name}")
                runs[method.name].append(method.run(prompt_ids, max_new_tokens))
                bar.update()
    return runs
