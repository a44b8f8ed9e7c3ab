"""How each decoding method of a bench runs one prompt, and what it reports ([`MethodRun`]).

Transformers' own methods (`target.generate`, with or without an assistant) are measured from outside with module
hooks ([`TargetWatch`]); the static-cache baseline by its wall time alone (hooks would break its compiled step); this
package's engine reports its own statistics.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import StaticCache

from ..engine.compilation import static_cache_length
from ..engine.generation import generate
from ..engine.oracle import OracleDrafts
from ..modeling import DFlashDraftModel
from ..runtime import Stopwatch
from ..target.adapter import engine_kernels
from ..transformers_compat import cache_keyword
from .target_watch import TargetWatch


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
        lookup_wins: Cycles whose accepted path was the prompt-lookup branch (`candidates="dflash+lookup"`), else
            `None`.
        verify_widths: Tokens the target verified in each cycle (the block, plus a lookup branch or a draft tree's
            other nodes) where the method reports it (our engine), else `None`.
    """

    new_tokens: list[int]
    seconds: float
    accepted_lengths: list[int]
    block_sizes: list[int] | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    prefill_time: float | None = None
    lookup_wins: int | None = None
    verify_widths: list[int] | None = None


MethodRunner = Callable[..., MethodRun]
"""Decodes one prompt `(1, length)` with at most `max_new_tokens` new tokens; a method that `replays` another's output
takes that output's new tokens on the same prompt as a third argument."""

SAMPLING_SEED = 0  # every sampled run starts from this torch seed, so a bench run is reproducible


def prompt_seed(input_ids: torch.LongTensor) -> int:
    """A seed of the prompt's own (the same prompt, the same seed in every run and method): each prompt's oracle
    keeps and drops slots by its own draws, not one draw repeated for every prompt."""
    return zlib.crc32(input_ids.detach().cpu().numpy().astype("int64").tobytes())


def transformers_runner(
    target: PreTrainedModel,
    drafter: DFlashDraftModel | None = None,
    with_engine_kernels: bool = False,
    **generate_kwargs: Any,
) -> MethodRunner:
    """Runner for `target.generate(...)` (greedy unless `do_sample=True` is given) with extra keyword arguments,
    measured with [`TargetWatch`]; with `with_engine_kernels`, the target computes its layers with the engine's
    kernels ([`engine_kernels`])."""
    generate_kwargs = {"do_sample": False, **generate_kwargs}

    def run(input_ids: torch.LongTensor, max_new_tokens: int) -> MethodRun:
        kernels = engine_kernels(target) if with_engine_kernels else contextlib.nullcontext()
        watch, stopwatch = TargetWatch(target, drafter), Stopwatch(input_ids.device)
        if generate_kwargs["do_sample"]:
            torch.manual_seed(SAMPLING_SEED)
        try:
            with kernels, stopwatch:
                sequences = target.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    **generate_kwargs,
                )
        finally:
            watch.close()
        prompt_length, forwards = input_ids.shape[1], watch.target_seconds
        return MethodRun(
            new_tokens=sequences[0, prompt_length:].tolist(),
            seconds=stopwatch.total,
            accepted_lengths=watch.accepted_lengths(prompt_length, sequences.shape[1]),
            draft_time=watch.draft_seconds if drafter is not None else None,
            verify_time=sum(forwards[1:]),
            prefill_time=forwards[0] if forwards else None,
        )

    return run


def static_cache_runner(target: PreTrainedModel) -> MethodRunner:
    """Runner for plain greedy `target.generate` with a static cache, which Transformers compiles on a GPU (its own
    criteria: a CUDA target and a compileable cache): the fast baseline. One `StaticCache` serves every call, reset
    in between and replaced only by a longer one, so the compiled decoding step keeps its shapes from the warm-up on.
    Timed from outside only: hooks inside the compiled step would break its graph."""
    held: list[StaticCache] = []

    def run(input_ids: torch.LongTensor, max_new_tokens: int) -> MethodRun:
        needed = input_ids.shape[1] + max_new_tokens
        if not held or held[0].get_max_length() < needed:
            held[:] = [StaticCache(config=target.config, max_cache_len=static_cache_length(needed))]
        cache = held[0]
        cache.reset()
        with Stopwatch(input_ids.device) as stopwatch:
            sequences = target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **{cache_keyword(target.forward): cache},
            )
        new_tokens = sequences[0, input_ids.shape[1] :].tolist()
        return MethodRun(new_tokens=new_tokens, seconds=stopwatch.total, accepted_lengths=[1] * (len(new_tokens) - 1))

    return run


def engine_runner(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    block_size: int | str,
    oracle_keep: float | None = None,
    **generate_kwargs: Any,
) -> MethodRunner:
    """Runner for this package's engine, [`dflash_hf.generate`], at one block size (or `"adaptive"`); greedy unless
    `do_sample=True` is given. With `oracle_keep`, the drafts replay the reference given as the runner's third argument
    ([`OracleDrafts`], each slot kept with that probability)."""
    generate_kwargs = {"do_sample": False, **generate_kwargs}

    def run(input_ids: torch.LongTensor, max_new_tokens: int, reference: list[int] | None = None) -> MethodRun:
        if generate_kwargs["do_sample"]:
            torch.manual_seed(SAMPLING_SEED)
        oracle = {}
        if oracle_keep is not None:
            replayed = torch.tensor([reference], dtype=torch.long, device=input_ids.device)
            oracle["oracle"] = OracleDrafts(replayed, oracle_keep, seed=prompt_seed(input_ids))
        with Stopwatch(input_ids.device) as stopwatch:
            out = generate(
                target,
                drafter,
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                block_size=block_size,
                max_new_tokens=max_new_tokens,
                return_dict_in_generate=True,
                **generate_kwargs,
                **oracle,
            )
        return MethodRun(
            new_tokens=out.sequences[0, input_ids.shape[1] :].tolist(),
            seconds=stopwatch.total,
            accepted_lengths=list(out.accepted_lengths[0]) if out.accepted_lengths else [],
            block_sizes=list(out.block_sizes[0]) if out.block_sizes else [],
            lookup_wins=out.lookup_wins[0] if out.lookup_wins else None,
            verify_widths=list(out.verify_widths[0]) if out.verify_widths else None,
            draft_time=out.draft_time,
            verify_time=out.verify_time,
            prefill_time=out.prefill_time,
        )

    return run
