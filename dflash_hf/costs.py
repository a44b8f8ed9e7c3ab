"""Timed forwards as the engine runs them, on this machine, in the precision the models are loaded in.

[`TimedForwards`] prefills a random context into a target cache and builds calls on it: a target forward of k new
tokens (through [`TargetAdapter`], with LM-head logits for every new token, inside row-exact verification where the
engine would use it) and a drafter forward of a B-token block (with its context features and draft-vocabulary
logits), each rolled back after it runs. [`interleaved_medians`] times such calls. They are what `--dtype auto`'s
precision verdict measures ([`cycle_ms`], used by `dflash_hf.precision`) and what the cost profile
(`dflash_hf.bench.profile`) builds on.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from .engine.cache_ops import truncate_cache
from .modeling import DFlashDraftModel
from .runtime import Stopwatch
from .target import row_exact
from .target.adapter import TargetAdapter
from .target.grouped_attention import grouped_attention, stock_attention
from .target.linear_attention import LinearAttentionStates, is_stateful, new_target_cache

Call = Callable[[], None]


class PreparedCall(NamedTuple):
    """A timed call that needs state made by an untimed one first: `prepare` runs, then `run` is timed."""

    prepare: Call
    run: Call


def interleaved_medians(
    calls: dict[tuple[str, int], Call | PreparedCall], repeats: int, device: torch.device
) -> dict[str, dict[int, float]]:
    """Median wall time in ms of each call, keyed `(kind, count)`, over `repeats` rounds that run every call once, in
    turn, after one untimed round: a shared machine's drift between rounds then touches every call alike, so their
    ratios hold. Returns `{kind: {count: ms}}`. (The target's calls and the drafter's get separate rounds: mixed into
    the target's rounds, the first drafter call of each round cost several times a decode loop's draft on an AVX2
    EPYC.)"""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for round_index in range(repeats + 1):
        for key, call in calls.items():
            if isinstance(call, PreparedCall):
                call.prepare()
                call = call.run
            with Stopwatch(device) as watch:
                call()
            if round_index:
                times[key].append(1000.0 * watch.total)
    medians: dict[str, dict[int, float]] = {}
    for (kind, count), values in times.items():
        medians.setdefault(kind, {})[count] = statistics.median(values)
    return medians


class TimedForwards:
    """A random `context_tokens`-token context prefilled into the cache of `adapter`'s target, and timed forwards of
    the target and of `drafter` on it (see the module docstring).

    Multi-token target forwards run row-exact (`target.row_exact`) when the target is in reduced precision on CPU,
    `row_exact_verify` is set and that is bit-exact for up to `max_tokens` rows (`row_exact` says whether they do).
    """

    def __init__(
        self,
        adapter: TargetAdapter,
        drafter: DFlashDraftModel,
        context_tokens: int,
        max_tokens: int,
        generator: torch.Generator,
        row_exact_verify: bool = True,
    ) -> None:
        target = adapter.target
        self.adapter = adapter
        self.drafter = drafter
        self.device = target.device
        self.context_tokens = context_tokens
        self.generator = generator
        self.row_exact = bool(row_exact_verify and row_exact.install_if_needed(target, max_tokens))
        self.context = torch.randint(0, adapter.vocab_size, (1, context_tokens), generator=generator).to(self.device)
        self.cache = new_target_cache(target)
        self.linear_states = (
            LinearAttentionStates(target, adapter.base_model, self.cache) if is_stateful(target) else None
        )
        positions = torch.arange(context_tokens, device=self.device)[None]
        self.context_hidden_states = adapter.forward(self.context, None, positions, self.cache).context_hidden_states

    def block_sizes(self, token_counts: tuple[int, ...]) -> list[int]:
        """The counts of `token_counts` the drafter drafts as a block: 2 up to its block size."""
        return [b for b in token_counts if 2 <= b <= int(self.drafter.config.block_size)]

    def target_calls(
        self, token_counts: tuple[int, ...], stock: bool = False, rollback: bool = False
    ) -> dict[int, Call]:
        """A target forward of each token count (with logits for every new token) on the cached context, rolled back;
        `stock`: in Transformers' own `sdpa` attention (`target.grouped_attention.stock_attention`); `rollback`: a
        hybrid target's recorded states are left for a rollback ([`rollback_calls`])."""
        adapter, cache, context_tokens, device = self.adapter, self.cache, self.context_tokens, self.device

        def target_forward(count: int, keep: bool = True) -> None:
            ids = torch.randint(0, adapter.vocab_size, (1, count), generator=self.generator).to(device)
            positions = torch.arange(context_tokens, context_tokens + count, device=device)[None]
            exact = row_exact.attention(adapter.target) if self.row_exact else contextlib.nullcontext()
            with (
                exact,
                row_exact.verification(self.row_exact),
                stock_attention() if stock else contextlib.nullcontext(),
                self._recording(count),
            ):
                step = adapter.forward(ids, None, positions, cache)
                adapter.logits(step.last_hidden_state)
            truncate_cache(cache, context_tokens)
            if keep and self.linear_states is not None and count > 1:
                self.linear_states.keep([count])  # what the verify recorded, let go

        if rollback:
            return {count: functools.partial(target_forward, count, False) for count in token_counts}
        return {count: functools.partial(target_forward, count) for count in token_counts}

    def _recording(self, count: int) -> contextlib.AbstractContextManager:
        """A hybrid target's multi-token forward records what its rollback needs, as the engine's verify does (a
        one-token forward is the plain decoding step)."""
        if self.linear_states is None or count == 1:
            return contextlib.nullcontext()
        return self.linear_states.verifying()

    def rollback_calls(self, token_counts: tuple[int, ...]) -> dict[int, PreparedCall]:
        """A hybrid target's rollback after a verify of each token count (> 1) that kept all but its last token (the
        longest re-run a verify needs: a row that keeps every token keeps the verify's own state); the verify runs
        untimed first. Empty for a target without linear-attention layers."""
        if self.linear_states is None:
            return {}
        counts = tuple(count for count in token_counts if count > 1)
        verify = self.target_calls(counts, rollback=True)
        states = self.linear_states

        def rollback(count: int) -> None:
            states.keep([count - 1])

        return {count: PreparedCall(verify[count], functools.partial(rollback, count)) for count in counts}

    def drafter_calls(self, block_sizes: list[int]) -> dict[int, Call]:
        """A drafter forward (with draft-vocabulary logits) for each block size: the drafter first ingests the whole
        context here, then each call adds 2 committed tokens' features and rolls back (a typical cycle)."""
        adapter, drafter, context, device = self.adapter, self.drafter, self.context, self.device
        tapped = self.context_hidden_states
        draft_cache = DynamicCache()
        draft_ids = getattr(drafter, "draft_token_ids", None)
        draft_ids = None if draft_ids is None else draft_ids.to(device)

        def drafter_forward(block: int, context_hidden_states: torch.Tensor, start: int) -> None:
            ids = torch.full((1, block), int(drafter.config.mask_token_id), device=device)
            ids[0, 0] = int(context[0, -1])
            known = context_hidden_states.shape[1]
            out = drafter(
                noise_embeds=adapter.embed(ids),
                context_hidden_states=context_hidden_states,
                position_ids=torch.arange(start, start + known + block, device=device)[None],
                cache=draft_cache,
            )
            truncate_cache(draft_cache, start + known)
            adapter.draft_logits(out.last_hidden_state[:, 1:], draft_ids)

        drafter_forward(2, tapped[:, :-2], 0)

        def cycle(block: int) -> None:
            drafter_forward(block, tapped[:, -2:], self.context_tokens - 2)
            truncate_cache(draft_cache, self.context_tokens - 2)

        return {block: functools.partial(cycle, block) for block in block_sizes}

    def medians(self, rounds: list[dict[tuple[str, int], Call]], repeats: int) -> dict[str, dict[int, float]]:
        """[`interleaved_medians`] of each round's calls, in the attention the engine runs its multi-token forwards in
        (`target.grouped_attention`); `{kind: {count: ms}}` over all rounds."""
        measured: dict[str, dict[int, float]] = {}
        with grouped_attention(self.adapter.target):
            for calls in rounds:
                measured |= interleaved_medians(calls, repeats, self.device)
        return measured


@torch.no_grad()
def cycle_ms(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    max_block: int,
    verify_tokens: int,
    *,
    context_tokens: int,
    repeats: int,
    seed: int = 0,
) -> float:
    """One DFlash cycle in ms, as the engine runs it: a verify of `verify_tokens` tokens and a draft of a `max_block`
    block, each the median of `repeats` timed rounds on a `context_tokens`-token context."""
    counts = tuple(sorted({max_block, verify_tokens}))
    generator = torch.Generator().manual_seed(seed)
    adapter = TargetAdapter.for_drafter(target, drafter)
    forwards = TimedForwards(adapter, drafter, context_tokens, max(counts), generator)
    target_round = {("target", k): call for k, call in forwards.target_calls(counts).items()}
    drafter_round = {("drafter", b): call for b, call in forwards.drafter_calls(forwards.block_sizes(counts)).items()}
    measured = forwards.medians([target_round, drafter_round], repeats)
    return measured["target"][verify_tokens] + measured.get("drafter", {}).get(max_block, 0.0)
