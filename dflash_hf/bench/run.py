"""One bench run: every method on every prompt, interleaved, compared token by token with plain greedy decoding
(sampled methods: in speed only, against plain sampling at the same temperature).

The result ([`BenchResult`]) holds per-prompt records and per-method summaries; `to_json()` is `bench.json`.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .. import mkl_choice
from ..engine.acceptance import acceptance_rate_by_slot
from ..modeling import DFlashDraftModel
from ..runtime import available_cpus, cpu_model, mkl_mode, native_bf16_feature
from .methods import BenchMethod, MethodRun, default_methods
from .profile import measure_costs
from .prompts import BenchPrompt

BENCH_FORMAT = "dflash-hf-bench/1"


@dataclass
class PromptResult:
    """What one method did on one prompt (times in seconds; `matches_greedy` is `None` for sampled outputs)."""

    prompt: int
    new_tokens: int
    seconds: float
    tokens_per_s: float | None
    speedup: float | None
    tau: float | None
    cycles: int
    accepted_lengths: list[int]
    block_sizes: list[int] | None
    draft_s: float | None
    verify_s: float | None
    prefill_s: float | None
    matches_greedy: bool | None
    first_mismatch: int | None
    output_ids: list[int]
    lookup_wins: int | None = None
    verify_widths: list[int] | None = None


@dataclass
class MethodSummary:
    """One method over all prompts (`exact` is `None` for sampled methods, which are compared in speed only)."""

    prompts: int
    new_tokens: int
    seconds: float
    tokens_per_s: float | None
    speedup: float | None
    tau: float | None
    cycles: int
    draft_ms_per_cycle: float | None
    verify_ms_per_cycle: float | None
    prefill_ms_per_prompt: float | None
    accepted_length_histogram: dict[str, int]
    mean_block_size: float | None
    acceptance_rate_by_slot: list[float]
    exact: bool | None
    mismatched_prompts: list[int]
    lookup_win_rate: float | None = None
    mean_verify_width: float | None = None


@dataclass
class MethodResult:
    """A method's identity in the results and its summary."""

    name: str
    label: str
    description: str
    block_size: int | None
    baseline: str
    sampled: bool
    summary: MethodSummary


@dataclass
class Mismatch:
    """Where a method's output first differs from its baseline's on one prompt."""

    method: str
    prompt: int
    prompt_id: str
    position: int
    expected: int | None
    got: int | None
    expected_length: int
    got_length: int


@dataclass
class BenchResult:
    """Everything a bench run measured; `to_json()` is the content of `bench.json`."""

    settings: dict[str, Any]
    hardware: dict[str, Any]
    date: str
    prompts: list[dict[str, Any]]
    methods: list[MethodResult]
    results: dict[str, list[PromptResult]]
    mismatches: list[Mismatch] = field(default_factory=list)
    command: str | None = None
    cost_profile: dict[str, Any] | None = None
    by_benchmark: dict[str, dict[str, dict[str, Any]]] | None = None
    llama_cpp: dict[str, Any] | None = None

    def method(self, name: str) -> MethodResult:
        """The result of the method called `name`."""
        for method in self.methods:
            if method.name == name:
                return method
        raise KeyError(f"No method {name!r} in this result (methods: {[m.name for m in self.methods]}).")

    @property
    def exact(self) -> bool:
        """Whether every method reproduced plain greedy decoding token for token on every prompt."""
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        """The JSON document written to `bench.json`."""
        return {
            "format": BENCH_FORMAT,
            "date": self.date,
            "command": self.command,
            "settings": self.settings,
            "hardware": self.hardware,
            "exact": self.exact,
            "mismatches": [dataclasses.asdict(m) for m in self.mismatches],
            "methods": [dataclasses.asdict(m) for m in self.methods],
            "prompts": self.prompts,
            "results": {name: [dataclasses.asdict(r) for r in records] for name, records in self.results.items()},
            "cost_profile": self.cost_profile,
            "by_benchmark": self.by_benchmark,
            "llama_cpp": self.llama_cpp,
        }


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


def _first_mismatch(expected: list[int], got: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return position
    return None if len(expected) == len(got) else min(len(expected), len(got))


def _per_prompt(index: int, run: MethodRun, reference: MethodRun | None, compare_tokens: bool = True) -> PromptResult:
    """One method's record on one prompt; speedup against `reference`'s run and, with `compare_tokens`, where its
    output first differs from it (`matches_greedy` is `None` for sampled runs, which are not compared)."""
    cycles = len(run.accepted_lengths)
    speedup, matches, position = None, (True if compare_tokens else None), None
    if reference is not None:
        if run.seconds > 0 and reference.seconds > 0 and reference.new_tokens:
            speedup = (len(run.new_tokens) / run.seconds) / (len(reference.new_tokens) / reference.seconds)
        if compare_tokens:
            position = _first_mismatch(reference.new_tokens, run.new_tokens)
            matches = position is None
    return PromptResult(
        prompt=index,
        new_tokens=len(run.new_tokens),
        seconds=run.seconds,
        tokens_per_s=len(run.new_tokens) / run.seconds if run.seconds > 0 else None,
        speedup=speedup,
        tau=sum(run.accepted_lengths) / cycles if cycles else None,
        cycles=cycles,
        accepted_lengths=run.accepted_lengths,
        block_sizes=run.block_sizes,
        draft_s=run.draft_time,
        verify_s=run.verify_time,
        prefill_s=run.prefill_time,
        matches_greedy=matches,
        first_mismatch=position,
        output_ids=run.new_tokens,
        lookup_wins=run.lookup_wins,
        verify_widths=run.verify_widths,
    )


def _summary(records: list[PromptResult], block_size: int | None, reference_rate: float | None) -> MethodSummary:
    """One method's records summed up; speedup against `reference_rate` (tokens/s of its baseline)."""
    tokens = sum(r.new_tokens for r in records)
    seconds = sum(r.seconds for r in records)
    lengths = [n for r in records for n in r.accepted_lengths]
    cycles = len(lengths)
    rate = tokens / seconds if seconds > 0 else None

    def per_cycle_ms(values: list[float | None]) -> float | None:
        if not cycles or any(v is None for v in values):
            return None
        return 1000.0 * sum(values) / cycles

    known = all(r.block_sizes is not None for r in records)
    sizes = [k for r in records for k in r.block_sizes] if known else None
    widths = [w for r in records for w in r.verify_widths] if all(r.verify_widths is not None for r in records) else []
    slots = block_size if block_size is not None else max(lengths, default=0)
    mismatched = [r.prompt for r in records if r.matches_greedy is False]
    compared = all(r.matches_greedy is not None for r in records)
    prefills = [r.prefill_s for r in records]
    return MethodSummary(
        prompts=len(records),
        new_tokens=tokens,
        seconds=seconds,
        tokens_per_s=rate,
        speedup=rate / reference_rate if rate is not None and reference_rate else None,
        tau=sum(lengths) / cycles if cycles else None,
        cycles=cycles,
        draft_ms_per_cycle=per_cycle_ms([r.draft_s for r in records]),
        verify_ms_per_cycle=per_cycle_ms([r.verify_s for r in records]),
        prefill_ms_per_prompt=(
            1000.0 * sum(prefills) / len(records) if records and all(p is not None for p in prefills) else None
        ),
        accepted_length_histogram={str(n): lengths.count(n) for n in range(1, max(lengths, default=0) + 1)},
        mean_block_size=sum(sizes) / len(sizes) if sizes else block_size,
        acceptance_rate_by_slot=acceptance_rate_by_slot(lengths, sizes, slots) if cycles else [],
        exact=not mismatched if compared else None,
        mismatched_prompts=mismatched,
        lookup_win_rate=(
            sum(r.lookup_wins for r in records) / cycles
            if cycles and all(r.lookup_wins is not None for r in records)
            else None
        ),
        mean_verify_width=sum(widths) / len(widths) if widths else None,
    )


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
    results, summaries, mismatches = _compare(methods, runs, prompts)
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


def benchmark_summaries(
    methods: Sequence[MethodResult], results: dict[str, list[PromptResult]], benchmarks: Sequence[str | None]
) -> dict[str, dict[str, dict[str, Any]]] | None:
    """Per method and benchmark (the prompts' `benchmark` names, in order of first appearance): tau, tokens/s and
    speedup over the method's baseline on that benchmark's prompts alone; `None` for a run of one prompt set."""
    names = list(dict.fromkeys(b for b in benchmarks if b is not None))
    if len(names) < 2:
        return None
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for method in methods:
        table[method.name] = {}
        for name in names:
            indices = [i for i, b in enumerate(benchmarks) if b == name]
            base = _summary([results[method.baseline][i] for i in indices], None, None).tokens_per_s
            summary = _summary([results[method.name][i] for i in indices], method.block_size, base)
            table[method.name][name] = {
                "prompts": summary.prompts,
                "tau": summary.tau,
                "tokens_per_s": summary.tokens_per_s,
                "speedup": summary.speedup,
                "acceptance_rate_by_slot": summary.acceptance_rate_by_slot,
            }
    return table


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


def _compare(
    methods: list[BenchMethod], runs: dict[str, list[MethodRun]], prompts: Sequence[BenchPrompt]
) -> tuple[dict[str, list[PromptResult]], list[MethodResult], list[Mismatch]]:
    """Per-prompt records, per-method results and mismatches, each method against its baseline (default: the
    first method, plain greedy; sampled methods in speed only)."""
    first = methods[0].name
    rates = {
        m.name: _summary([_per_prompt(i, run, None) for i, run in enumerate(runs[m.name])], None, None).tokens_per_s
        for m in methods
    }
    results: dict[str, list[PromptResult]] = {}
    summaries: list[MethodResult] = []
    mismatches: list[Mismatch] = []
    for method in methods:
        baseline = method.baseline or first
        base = None if method.name == first else runs[baseline]
        records = [
            _per_prompt(i, run, base[i] if base else None, not method.sampled)
            for i, run in enumerate(runs[method.name])
        ]
        if method.name == first:
            for record in records:
                record.speedup = 1.0
        results[method.name] = records
        summary = _summary(records, method.block_size, rates[baseline])
        summaries.append(
            MethodResult(
                method.name, method.label, method.description, method.block_size, baseline, method.sampled, summary
            )
        )
        mismatches += [_mismatch(method.name, r, runs[baseline], prompts) for r in records if r.matches_greedy is False]
    return results, summaries, mismatches


def _mismatch(
    method: str, record: PromptResult, reference: list[MethodRun], prompts: Sequence[BenchPrompt]
) -> Mismatch:
    """Where a method's output first differs from the reference's on one prompt."""
    position = record.first_mismatch
    expected = reference[record.prompt].new_tokens
    got = record.output_ids
    return Mismatch(
        method=method,
        prompt=record.prompt,
        prompt_id=prompts[record.prompt].id,
        position=position,
        expected=expected[position] if position < len(expected) else None,
        got=got[position] if position < len(got) else None,
        expected_length=len(expected),
        got_length=len(got),
    )
