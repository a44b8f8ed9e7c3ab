"""The records of a bench run: per prompt and method, per method, per benchmark, and where an output differs.

[`BenchResult`] holds them all; its `to_json()` is `bench.json`, which [`as_document`] reads back.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.acceptance import acceptance_rate_by_slot
from ..fileio import read_json
from .methods import BenchMethod
from .profile import predicted_speedup
from .prompts import BenchPrompt
from .runners import MethodRun

BENCH_FORMAT = "dflash-hf-bench/1"


@dataclass
class PromptResult:
    """What one method did on one prompt (times in seconds). Against its baseline's output on the prompt:
    `matches_greedy`, `first_mismatch` (the first new-token position where they differ, `None` where they do not) and
    `identical_tokens` (the new tokens before it); all three `None` for sampled outputs."""

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
    identical_tokens: int | None = None


@dataclass
class MethodSummary:
    """One method over all prompts (`exact` is `None` for sampled methods, which are compared in speed only).

    `identical_tokens` of `reference_tokens`: the new tokens before each prompt's first difference from the baseline,
    summed, and the baseline's new tokens; `first_mismatch`: the earliest position where any prompt's output differs
    (`None` when none does). `predicted_speedup`: the cost model's speedup of this method's cycles (see
    [`dflash_hf.bench.profile.predicted_speedup`]), where the run measured a cost profile and the method drafts.
    """

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
    identical_tokens: int | None = None
    reference_tokens: int | None = None
    first_mismatch: int | None = None
    predicted_speedup: float | None = None


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
    exact_required: bool = True

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

    @property
    def failed(self) -> bool:
        """Whether an output differs from plain greedy where it must not ([`exactness_required`])."""
        return self.exact_required and not self.exact

    def to_json(self) -> dict[str, Any]:
        """The JSON document written to `bench.json`."""
        return {
            "format": BENCH_FORMAT,
            "date": self.date,
            "command": self.command,
            "settings": self.settings,
            "hardware": self.hardware,
            "exact": self.exact,
            "exact_required": self.exact_required,
            "mismatches": [dataclasses.asdict(m) for m in self.mismatches],
            "methods": [dataclasses.asdict(m) for m in self.methods],
            "prompts": self.prompts,
            "results": {name: [dataclasses.asdict(r) for r in records] for name, records in self.results.items()},
            "cost_profile": self.cost_profile,
            "by_benchmark": self.by_benchmark,
            "llama_cpp": self.llama_cpp,
        }


def as_document(result: BenchResult | dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The `bench.json` document of a result, given as a [`BenchResult`], the document itself or the file's path."""
    if isinstance(result, BenchResult):
        return result.to_json()
    if isinstance(result, dict):
        return result
    path = Path(result)
    try:
        document = read_json(path, "rerun `dflash-hf bench`.")
    except FileNotFoundError as err:
        raise ValueError(f"No bench results at {path}: run `dflash-hf bench --out DIR` first.") from err
    if not isinstance(document, dict) or document.get("format") != BENCH_FORMAT:
        raise ValueError(f"{path} is not a `dflash-hf bench` result ({BENCH_FORMAT}).")
    return document


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
    identical = len(run.new_tokens) if compare_tokens else None
    if reference is not None:
        if run.seconds > 0 and reference.seconds > 0 and reference.new_tokens:
            speedup = (len(run.new_tokens) / run.seconds) / (len(reference.new_tokens) / reference.seconds)
        if compare_tokens:
            position = _first_mismatch(reference.new_tokens, run.new_tokens)
            matches = position is None
            identical = len(reference.new_tokens) if position is None else position
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
        identical_tokens=identical,
    )


def _summary(
    records: list[PromptResult],
    block_size: int | None,
    reference_rate: float | None,
    reference: list[MethodRun] | None = None,
    cost_profile: dict[str, Any] | None = None,
) -> MethodSummary:
    """One method's records summed up; speedup against `reference_rate` (tokens/s of its baseline), identical tokens
    against its baseline's runs `reference`, the cost model's speedup from `cost_profile`."""
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
    positions = [r.first_mismatch for r in records if r.first_mismatch is not None]
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
        identical_tokens=sum(r.identical_tokens for r in records) if compared else None,
        reference_tokens=(
            sum(len(reference[r.prompt].new_tokens) for r in records) if compared and reference is not None else None
        ),
        first_mismatch=min(positions, default=None),
        predicted_speedup=_predicted(cost_profile, records, block_size),
    )


def _predicted(
    cost_profile: dict[str, Any] | None, records: list[PromptResult], block_size: int | None
) -> float | None:
    """The cost model's speedup of a drafting method's cycles (each cycle's verify width and block as recorded, else
    its `block_size`); `None` without a profile, or for a method that drafts nothing."""
    if cost_profile is None or block_size is None:
        return None
    lengths, widths, blocks = [], [], []
    for r in records:
        lengths += r.accepted_lengths
        widths += r.verify_widths if r.verify_widths is not None else [block_size] * len(r.accepted_lengths)
        blocks += r.block_sizes if r.block_sizes is not None else [block_size] * len(r.accepted_lengths)
    return predicted_speedup(cost_profile, lengths, widths, blocks)


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


def compare_runs(
    methods: list[BenchMethod],
    runs: dict[str, list[MethodRun]],
    prompts: Sequence[BenchPrompt],
    cost_profile: dict[str, Any] | None = None,
) -> tuple[dict[str, list[PromptResult]], list[MethodResult], list[Mismatch]]:
    """Per-prompt records, per-method results and mismatches, each method against its baseline (default: the
    first method, plain greedy; sampled methods in speed only); with the run's `cost_profile`, the cost model's
    speedup of every drafting method."""
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
        summary = _summary(records, method.block_size, rates[baseline], runs[baseline], cost_profile)
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
