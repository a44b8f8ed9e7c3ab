"""One bench run: every method on every prompt, interleaved, compared token by token with plain greedy decoding
(sampled methods: in speed only, against plain sampling at the same temperature).

The result is a [`BenchResult`] (`dflash_hf.bench.results`): per-prompt records and per-method summaries. Each
finished run (a method on a prompt) and each phase (warm-up, cost profile) prints one line on stderr with its time, so
a slow row shows while the bench runs, with or without progress bars.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import platform
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .. import mkl_choice
from ..modeling import DFlashDraftModel
from ..runtime import available_cpus, clock, cpu_model, mkl_mode, native_bf16_feature
from ..target.support import text_config
from .methods import BenchMethod, default_methods
from .profile import measure_costs
from .prompts import BenchPrompt
from .results import BenchResult, Mismatch, benchmark_summaries, compare_runs
from .runners import MethodRun


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
        **_gpu_info(device),
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


def _gpu_info(device: torch.device) -> dict[str, Any]:
    """The GPU of a CUDA device: its name, compute capability and memory, and the CUDA and cuDNN versions torch was
    built with (`gpu`: `None` on other devices)."""
    if device.type != "cuda":
        return {"gpu": None}
    properties = torch.cuda.get_device_properties(device)
    return {
        "gpu": properties.name,
        "gpu_capability": f"{properties.major}.{properties.minor}",
        "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


def exactness_required(target: PreTrainedModel) -> bool:
    """Whether every output must equal plain greedy decoding token for token (a difference is an error): in float32
    anywhere, and on CPU in any precision (reduced precision verifies row-exact there). In bfloat16 / float16 on a GPU
    the engine commits the target's argmax of its own verify forward, which may differ from a one-token step's in the
    last bits; there differences are reported, not fatal."""
    return target.dtype == torch.float32 or target.device.type == "cpu"


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
        A [`BenchResult`]; `result.mismatches` lists every output that differs from greedy (printed to stderr where
        [`exactness_required`]).
    """
    methods = _checked(
        prompts, max_new_tokens, warmup_tokens, default_methods(target, drafter) if methods is None else methods
    )
    inputs = [torch.tensor([p.input_ids], dtype=torch.long, device=target.device) for p in prompts]
    if warmup_tokens:
        with _phase("warm-up", target.device):
            _warm_up(methods, inputs[0], min(warmup_tokens, max_new_tokens), progress)
    costs = None
    if profile_costs:
        with _phase("cost profile", target.device):
            costs = measure_costs(target, drafter)
    runs = _decode_all(methods, inputs, max_new_tokens, progress)
    results, summaries, mismatches = compare_runs(methods, runs, prompts, costs)
    required = exactness_required(target)
    if required:
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
        exact_required=required,
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
        "target_model_type": text_config(target).model_type,
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
    for index, method in enumerate(methods):
        if method.replays is not None and method.replays not in names[:index]:
            raise ValueError(
                f"Method {method.name!r} replays {method.replays!r}, which must come before it among the methods {names}."
            )
    return methods


@contextlib.contextmanager
def _phase(name: str, device: torch.device) -> Iterator[None]:
    """One stderr line with the wall time of a phase of the run, once it is done."""
    start = clock(device)
    yield
    print(f"bench: {name} done in {clock(device) - start:.1f} s", file=sys.stderr, flush=True)


def _run(method: BenchMethod, prompt_ids: torch.LongTensor, tokens: int, done: dict[str, MethodRun]) -> MethodRun:
    """`method` on one prompt; `done` holds the runs of the methods before it on that prompt (what it replays)."""
    if method.replays is None:
        return method.run(prompt_ids, tokens)
    return method.run(prompt_ids, tokens, done[method.replays].new_tokens)


@torch.no_grad()
def _warm_up(methods: list[BenchMethod], prompt_ids: torch.LongTensor, tokens: int, progress: bool) -> None:
    """Every method decodes `tokens` tokens of `prompt_ids`, untimed (first-call set-up out of the timings)."""
    done: dict[str, MethodRun] = {}
    for method in tqdm(methods, desc="warm-up", unit="method", disable=not progress):
        done[method.name] = _run(method, prompt_ids, tokens, done)


@torch.no_grad()
def _decode_all(
    methods: list[BenchMethod], inputs: list[torch.LongTensor], max_new_tokens: int, progress: bool
) -> dict[str, list[MethodRun]]:
    """Run the methods prompt by prompt (interleaved); the runs of each method, by name."""
    runs: dict[str, list[MethodRun]] = {m.name: [] for m in methods}
    with tqdm(total=len(inputs) * len(methods), desc="bench", unit="run", disable=not progress) as bar:
        for index, prompt_ids in enumerate(inputs):
            done: dict[str, MethodRun] = {}
            for method in methods:
                bar.set_postfix_str(f"prompt {index} {method.name}")
                done[method.name] = run = _run(method, prompt_ids, max_new_tokens, done)
                runs[method.name].append(run)
                baseline = done[method.baseline or methods[0].name]
                tqdm.write(_run_line(index, len(inputs), method.name, run, baseline), file=sys.stderr)
                bar.update()
    return runs


def _run_line(index: int, prompts: int, name: str, run: MethodRun, baseline: MethodRun) -> str:
    """The stderr line of one finished run: prompt, method, wall time, tokens/s and speedup over its baseline."""
    rate = len(run.new_tokens) / run.seconds if run.seconds > 0 else float("nan")
    base = len(baseline.new_tokens) / baseline.seconds if baseline.seconds > 0 else float("nan")
    return (
        f"bench: prompt {index + 1}/{prompts} {name}: {run.seconds:.2f} s, {len(run.new_tokens)} tokens, "
        f"{rate:.1f} tokens/s, {rate / base:.2f}x"
    )
