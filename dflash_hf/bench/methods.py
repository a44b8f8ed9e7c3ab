"""The decoding methods a bench compares: one row each, named and labelled, with the arguments of the `generate` call it
times (from which its description is written) and its runner (`runners`).

Where the engine computes some of the target's own layers with faster kernels than `target.generate` (a prepacked LM
head in float32 on CPU), `greedy_engine_kernels` is plain greedy decoding with those kernels, so that the gain from
kernels and the gain from speculation can be told apart. On a GPU, `greedy_static` is plain greedy with a static
cache, whose decoding step Transformers compiles (CUDA graphs): the fast baseline a GPU user has without a drafter.
docs/design.md ("Benchmark") says how every number is derived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedModel

from ..engine.acceptance import SAMPLING_PROPOSALS
from ..engine.candidates import CandidatePlan
from ..engine.lookup import lookup_branch_length
from ..modeling import DFlashDraftModel
from ..target.adapter import uses_engine_kernels
from ..target.linear_attention import is_stateful
from .runners import MethodRunner, engine_runner, static_cache_runner, transformers_runner

DEFAULT_BLOCK_SIZES = (4, 8, 16)


@dataclass
class BenchMethod:
    """A decoding method under test: a name for the JSON, a label for tables and plots, and its runner.

    `baseline` names the method it is compared with (speedup, and token equality unless `sampled`); `None` is the
    bench's first method, plain greedy. A `sampled` method's output is random: it is compared in speed only (that
    sampling keeps the target's distribution is a property the distribution tests check, not one prompt can show).
    `replays` names the method whose output on the same prompt this method's oracle drafts replay (the oracle rows:
    plain greedy), which must run before it.
    """

    name: str
    label: str
    run: MethodRunner
    description: str = ""
    block_size: int | None = None
    baseline: str | None = None
    sampled: bool = False
    replays: str | None = None


def default_methods(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    prompt_lookup_num_tokens: int = 10,
    adaptive: bool = True,
    lookup_branch: bool = True,
    lookup_tokens: Sequence[int] = (),
    draft_tree: bool = True,
    static_baseline: bool | None = None,
    compile: bool = False,
) -> list[BenchMethod]:
    """The methods of the module docstring, in order; engine block sizes above the drafter's trained one are left out.

    Args:
        target: The target model.
        drafter: A DFlash drafter built for `target`.
        block_sizes: Fixed block sizes for our engine (each >= 2; those above the drafter's block size are dropped).
        prompt_lookup_num_tokens: Candidate tokens per prompt-lookup cycle.
        adaptive: Include `dflash_adaptive`.
        lookup_branch: Include our engine at the smallest block size with a prompt-lookup branch in every verify
            (`candidates="dflash+lookup"`).
        lookup_tokens: With `lookup_branch`, also a row per value with lookup branches of at most that many tokens
            (`lookup_tokens=N`; the default row's branch has the engine's default length, `lookup_branch_length`).
        draft_tree: Include our engine with a draft tree (`candidates="tree"`) at the smallest and the largest block
            size.
        static_baseline: Include `greedy_static`, plain greedy with a static cache, which Transformers compiles on a
            GPU (the fast baseline there); `None`: on a CUDA target, or with `compile`.
        compile: Run every engine row with `compile=True` (static caches, compiled verify forwards).
    """
    if prompt_lookup_num_tokens < 1:
        raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {prompt_lookup_num_tokens}.")
    sizes = _checked_sizes(drafter, block_sizes, lookup_tokens)
    trained = int(drafter.config.block_size)
    static = (compile or target.device.type == "cuda") if static_baseline is None else static_baseline
    rows = _transformers_rows(uses_engine_kernels(target), static, trained, prompt_lookup_num_tokens)
    if is_stateful(target):  # Transformers refuses assisted generation on a recurrent state
        rows = [row for row in rows if row.name not in _ASSISTED_ROWS]
    draft_tree = draft_tree and not drafter.config.is_dflash2  # a DFlash 2 drafter's selector grows no trees
    rows += _engine_rows(sizes, trained, adaptive, lookup_branch, [int(n) for n in lookup_tokens], draft_tree)
    return [_method(target, drafter, row, compile) for row in rows]


# Transformers' assisted-generation rows, which it refuses on a target with a recurrent state
_ASSISTED_ROWS = ("prompt_lookup", "native_dflash")


def drafter_methods(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    tag: str,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    adaptive: bool = True,
    lookup_branch: bool = True,
    lookup_tokens: Sequence[int] = (),
    draft_tree: bool = True,
    compile: bool = False,
) -> list[BenchMethod]:
    """The engine rows of [`default_methods`] for a further drafter, named `<row>@<tag>` and labelled `<label>
    [<tag>]`, each compared with the run's plain greedy: several drafters side by side in one run (`compile`: as
    there)."""
    sizes = _checked_sizes(drafter, block_sizes, lookup_tokens)
    draft_tree = draft_tree and not drafter.config.is_dflash2  # a DFlash 2 drafter's selector grows no trees
    rows = _engine_rows(
        sizes, int(drafter.config.block_size), adaptive, lookup_branch, [int(n) for n in lookup_tokens], draft_tree
    )
    return [
        _method(target, drafter, replace(row, name=f"{row.name}@{tag}", label=f"{row.label} [{tag}]"), compile)
        for row in rows
    ]


def _checked_sizes(drafter: DFlashDraftModel, block_sizes: Sequence[int], lookup_tokens: Sequence[int]) -> list[int]:
    """The block sizes `drafter` runs of `block_sizes`, ascending; a `ValueError` for invalid sizes or lengths."""
    trained = int(drafter.config.block_size)
    bad = [b for b in block_sizes if int(b) < 2]
    if bad:
        raise ValueError(f"Block sizes must be >= 2 (anchor + at least one draft), got {bad}.")
    if any(int(n) < 1 for n in lookup_tokens):
        raise ValueError(f"Lookup branch lengths must be >= 1, got {list(lookup_tokens)}.")
    sizes = _fitting_sizes(block_sizes, trained)
    if not sizes and block_sizes:
        raise ValueError(
            f"None of the block sizes {list(block_sizes)} fits the drafter's trained block size {trained}: pass block "
            f"sizes <= {trained}."
        )
    return sizes


def _fitting_sizes(block_sizes: Sequence[int], trained: int) -> list[int]:
    """The block sizes a drafter trained with blocks of `trained` can run, ascending (the lookup rows take the first)."""
    return sorted({int(b) for b in block_sizes if int(b) <= trained})


def widest_verify(
    block_sizes: Sequence[int],
    trained: int,
    lookup_branch: bool,
    lookup_tokens: Sequence[int],
    draft_tree: bool = True,
) -> int:
    """Tokens of the widest verify among [`default_methods`]' rows: the drafter's block, the lookup rows' block (the
    smallest size that fits) plus their longest branch, or the draft-tree rows' largest tree."""
    sizes = _fitting_sizes(block_sizes, trained)
    if not sizes:
        return trained
    widths = [trained]
    if lookup_branch:
        widths += [CandidatePlan("dflash+lookup", sizes[0], n).verify_width for n in [None, *lookup_tokens]]
    if draft_tree:
        widths.append(CandidatePlan("tree", sizes[-1]).verify_width)
    return max(widths)


def sampling_methods(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    temperatures: Sequence[float],
    block_size: int,
    compile: bool = False,
) -> list[BenchMethod]:
    """Sampling rows: per temperature, plain sampling and our engine with each draft proposal (`argmax`, `sample`),
    each engine row compared with plain sampling at the same temperature (no top-k / top-p); `compile`: the engine
    rows run with `compile=True`."""
    trained, size = int(drafter.config.block_size), int(block_size)
    if not 2 <= size <= trained:
        raise ValueError(f"The sampling block size must be in [2, {trained}] (the drafter's), got {block_size}.")
    rows = []
    for temperature in temperatures:
        if not temperature > 0:
            raise ValueError(f"Sampling temperatures must be > 0, got {temperature}.")
        t, sample, unfiltered = f"{temperature:g}", {"do_sample": True, "temperature": float(temperature)}, _UNFILTERED
        rows.append(
            _Row(f"sample_t{t}", f"plain sampling T={t}", sample, engine=False, sampled=True, hidden=unfiltered)
        )
        rows += [
            _Row(
                f"dflash_b{size}_t{t}_{proposal}",
                f"dflash-hf B={size} T={t}, {proposal} proposal",
                {"block_size": size, **sample, "sampling_proposal": proposal},
                baseline=f"sample_t{t}",
                sampled=True,
                hidden={"candidates": "dflash", **unfiltered},
            )
            for proposal in SAMPLING_PROPOSALS
        ]
    return [_method(target, drafter, row, compile) for row in rows]


def oracle_methods(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    probabilities: Sequence[float],
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    compile: bool = False,
) -> list[BenchMethod]:
    """Oracle rows: per probability P and block size the drafter runs, our engine whose drafts replay plain greedy's
    output on the same prompt, each slot kept with probability P (`dflash_hf.engine.oracle`): the drafter's forward
    and the engine's cycle at their real cost, tau set by P. Named `oracle_b<B>_p<P>`; `compile`: run with
    `compile=True`."""
    bad = [p for p in probabilities if not 0.0 <= float(p) <= 1.0]
    if bad:
        raise ValueError(f"Oracle probabilities must lie in [0, 1], got {bad}.")
    sizes = _checked_sizes(drafter, block_sizes, ())
    rows = [
        _Row(
            f"oracle_b{b}_p{p:g}",
            f"dflash-hf B={b}, oracle P={p:g}",
            {"block_size": b, "candidates": "dflash", "oracle": _Oracle(float(p))},
            replays="greedy",
        )
        for p in probabilities
        for b in sizes
    ]
    return [_method(target, drafter, row, compile) for row in rows]


@dataclass(frozen=True)
class _Row:
    """One row of a bench: its name, its label, and the arguments of the `generate` call it times, which its
    description shows (`hidden`: further arguments the description leaves out).

    An engine row calls `dflash_hf.generate` (its `block_size` among the arguments), any other `target.generate`
    (`kernels`: with the engine's kernels). `block_size` is the row's block where the arguments do not give it.
    `replays`: the row whose output its oracle drafts replay (an [`_Oracle`] among the arguments).
    """

    name: str
    label: str
    generate: dict[str, Any]
    engine: bool = True
    block_size: int | None = None
    baseline: str | None = None
    sampled: bool = False
    kernels: bool = False
    hidden: dict[str, Any] = field(default_factory=dict)
    replays: str | None = None


class _Drafter:
    """Stands for the row's drafter among its `generate` arguments."""

    def __repr__(self) -> str:
        return "drafter"


_DRAFTER = _Drafter()


class _StaticCache:
    """Stands for the static baseline's cache among its `generate` arguments."""

    def __repr__(self) -> str:
        return "StaticCache(...)"


_STATIC_CACHE = _StaticCache()


@dataclass(frozen=True)
class _Oracle:
    """Stands for an oracle row's [`OracleDrafts`] among its `generate` arguments (the reference is each prompt's)."""

    keep: float

    def __repr__(self) -> str:
        return f"OracleDrafts(plain greedy's output, keep={self.keep:g})"


_UNFILTERED = {"top_k": None, "top_p": None}  # sampling from the whole distribution, whatever the generation config


def _transformers_rows(kernels: bool, static: bool, trained: int, prompt_lookup_num_tokens: int) -> list[_Row]:
    """Plain greedy (also with the engine's kernels where the target uses any, and with a static cache where
    `static`), prompt lookup and Transformers' DFlash with a drafter trained on blocks of `trained`."""
    k = prompt_lookup_num_tokens
    greedy = {"do_sample": False}
    rows = [
        _Row("greedy", "plain greedy", greedy, engine=False),
        _Row("greedy_engine_kernels", "plain greedy, engine kernels", greedy, engine=False, kernels=True),
        _Row("greedy_static", "plain greedy, static cache", {**greedy, "cache": _STATIC_CACHE}, engine=False),
        _Row("prompt_lookup", f"prompt lookup (k={k})", {"prompt_lookup_num_tokens": k}, engine=False),
        _Row(
            "native_dflash",
            f"Transformers DFlash (B={trained})",
            {"assistant_model": _DRAFTER, "speculation_type": "dflash"},
            engine=False,
            block_size=trained,
        ),
    ]
    return [row for row in rows if (kernels or not row.kernels) and (static or row.name != "greedy_static")]


def _engine_rows(
    sizes: list[int], trained: int, adaptive: bool, lookup_branch: bool, lookup_tokens: list[int], draft_tree: bool
) -> list[_Row]:
    """Our engine at each fixed block size, with the adaptive policy, then at the smallest size with a lookup branch
    (of the default length, then of each of `lookup_tokens`), then with a draft tree at the smallest and the largest
    size."""
    rows = [_Row(f"dflash_b{b}", f"dflash-hf B={b}", {"block_size": b, "candidates": "dflash"}) for b in sizes]
    if adaptive:
        adaptive_call = {"block_size": "adaptive", "candidates": "dflash"}
        rows.append(_Row("dflash_adaptive", f"dflash-hf adaptive (B<={trained})", adaptive_call, block_size=trained))
    if lookup_branch and sizes:
        b, lookup = sizes[0], {"block_size": sizes[0], "candidates": "dflash+lookup"}
        rows.append(_Row(f"dflash_b{b}_lookup", f"dflash-hf B={b} + lookup branch", lookup))
        rows += [
            _Row(
                f"dflash_b{b}_lookup{n}",
                f"dflash-hf B={b} + lookup branch (<= {n} tokens)",
                {**lookup, "lookup_tokens": n},
            )
            for n in lookup_tokens
            if n != lookup_branch_length(b)
        ]
    if draft_tree and sizes:
        tree_sizes = dict.fromkeys([sizes[0], sizes[-1]])
        rows += [
            _Row(f"dflash_b{b}_tree", f"dflash-hf B={b} draft tree", {"block_size": b, "candidates": "tree"})
            for b in tree_sizes
        ]
    return rows


def _method(target: PreTrainedModel, drafter: DFlashDraftModel, row: _Row, compile: bool = False) -> BenchMethod:
    """The bench method of `row`: its runner, and its description from its `generate` arguments (an engine row's with
    `compile=True` when `compile`)."""
    if compile and row.engine:
        row = replace(row, generate={**row.generate, "compile": True})
    arguments = {key: drafter if value is _DRAFTER else value for key, value in {**row.generate, **row.hidden}.items()}
    shown = ", ".join(f"{key}={_shown(value)}" for key, value in row.generate.items())
    oracle = arguments.pop("oracle", None)
    if row.engine:
        keep = None if oracle is None else oracle.keep
        runner = engine_runner(target, drafter, arguments.pop("block_size"), oracle_keep=keep, **arguments)
        description = f"dflash_hf.generate({shown})"
    elif _STATIC_CACHE in row.generate.values():
        runner = static_cache_runner(target)
        description = f"target.generate({shown}), compiled by Transformers where it compiles (CUDA)"
    else:
        watched = drafter if _DRAFTER in row.generate.values() else None
        runner = transformers_runner(target, watched, row.kernels, **arguments)
        description = f"target.generate({shown})" + (
            " with the engine's kernels (prepacked LM head)" if row.kernels else ""
        )
    block_size = row.generate["block_size"] if row.block_size is None and row.engine else row.block_size
    return BenchMethod(row.name, row.label, runner, description, block_size, row.baseline, row.sampled, row.replays)


def _shown(value: Any) -> str:
    """A `generate` argument as a row's description writes it."""
    if isinstance(value, str):
        return f'"{value}"'
    return f"{value:g}" if isinstance(value, float) else repr(value)
