"""Cost profile: what one target forward costs for k new tokens, and one drafter forward per block size, on this
machine, in the precision the models are loaded in.

This is what decides whether speculation can pay: a cycle costs one drafter forward plus a B-token verify, a plain
step costs a 1-token forward, so the speedup is at most tau x step / (verify(B) + draft(B)). Each forward is timed
the way the engine runs it (the target through [`TargetAdapter`] with LM-head logits for every new token, inside
row-exact verification where the engine would use it; the drafter with its context features and draft-vocabulary
logits), on a cache of `context_tokens` positions that is rolled back after every timed call.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..engine import row_exact
from ..engine.adapters import TargetAdapter
from ..engine.cache_ops import truncate_cache
from ..modeling import DFlashDraftModel
from ..runtime import Stopwatch

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16)


def _median_ms(call, repeats: int, device: torch.device) -> float:
    """Median wall time of `call()` in milliseconds over `repeats` timed runs, after one untimed run."""
    call()
    times = []
    for _ in range(repeats):
        with Stopwatch(device) as watch:
            call()
        times.append(1000.0 * watch.total)
    return statistics.median(times)


def _target_ms(
    adapter: TargetAdapter,
    cache: DynamicCache,
    context_tokens: int,
    token_counts: tuple[int, ...],
    exact: bool,
    repeats: int,
    generator: torch.Generator,
) -> dict[int, float]:
    """Median ms of a target forward of each token count (with logits for every new token) on the cached context."""
    device = adapter.target.device

    def target_forward(count: int) -> None:
        ids = torch.randint(0, adapter.vocab_size, (1, count), generator=generator).to(device)
        positions = torch.arange(context_tokens, context_tokens + count, device=device)[None]
        with row_exact.verification(exact):
            step = adapter.forward(ids, None, positions, cache)
            adapter.logits(step.last_hidden_state)
        truncate_cache(cache, context_tokens)

    return {count: _median_ms(functools.partial(target_forward, count), repeats, device) for count in token_counts}


def _drafter_ms(
    adapter: TargetAdapter,
    drafter: DFlashDraftModel,
    context: torch.LongTensor,
    tapped: torch.Tensor,
    block_sizes: list[int],
    repeats: int,
) -> dict[int, float]:
    """Median ms of a drafter forward (with draft-vocabulary logits) for each block size: the drafter first ingests
    the whole context, then each timed call adds 2 committed tokens' features and rolls back (a typical cycle)."""
    device = context.device
    context_tokens = context.shape[1]
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
            past_key_values=draft_cache,
        )
        truncate_cache(draft_cache, start + known)
        adapter.logits(out.last_hidden_state[:, 1:], draft_ids)

    drafter_forward(2, tapped[:, :-2], 0)

    def cycle(block: int) -> None:
        drafter_forward(block, tapped[:, -2:], context_tokens - 2)
        truncate_cache(draft_cache, context_tokens - 2)

    return {block: _median_ms(functools.partial(cycle, block), repeats, device) for block in block_sizes}


@torch.no_grad()
def measure_costs(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    token_counts: tuple[int, ...] = DEFAULT_TOKEN_COUNTS,
    context_tokens: int = 256,
    repeats: int = 5,
    seed: int = 0,
    row_exact_verify: bool = True,
) -> dict[str, Any]:
    """Time the target's forward for each of `token_counts` new tokens and the drafter's for each block size.

    Returns a JSON-ready dict: `dtype`, `context_tokens`, `row_exact` (whether multi-token target forwards ran
    row-exact, as the engine runs them in this precision), `target_ms` / `target_relative` (per token count, relative
    to a 1-token step) and `drafter_ms` / `drafter_relative` (per block size from `token_counts` >= 2 up to the
    drafter's, relative to the same 1-token step). `row_exact_verify=False` times stock multi-token forwards instead
    (what a reduced-precision verify would cost without exactness; the engine never runs that).
    """
    if context_tokens < 1 or repeats < 1 or not token_counts or min(token_counts) < 1:
        raise ValueError("context_tokens, repeats and every token count must be >= 1, with at least one count.")
    device = target.device
    adapter = TargetAdapter.for_drafter(target, drafter)
    reduced_cpu = device.type == "cpu" and target.dtype != torch.float32
    exact = row_exact_verify and reduced_cpu and row_exact.install(target, max(token_counts))
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(0, adapter.vocab_size, (1, context_tokens), generator=generator).to(device)
    cache = DynamicCache()
    prefill = adapter.forward(context, None, torch.arange(context_tokens, device=device)[None], cache)
    target_ms = _target_ms(adapter, cache, context_tokens, token_counts, exact, repeats, generator)
    block_sizes = [b for b in token_counts if 2 <= b <= int(drafter.config.block_size)]
    drafter_ms = _drafter_ms(adapter, drafter, context, prefill.context_hidden_states, block_sizes, repeats)
    step_ms = target_ms.get(1) or min(target_ms.values())
    return {
        "dtype": str(target.dtype).replace("torch.", ""),
        "context_tokens": context_tokens,
        "repeats": repeats,
        "row_exact": bool(exact),
        "target_ms": {str(k): v for k, v in target_ms.items()},
        "target_relative": {str(k): v / step_ms for k, v in target_ms.items()},
        "drafter_ms": {str(k): v for k, v in drafter_ms.items()},
        "drafter_relative": {str(k): v / step_ms for k, v in drafter_ms.items()},
    }


def plot_profiles(profiles: list[dict[str, Any]], axes) -> None:
    """Cost relative to a 1-token step vs tokens per forward: one target line and one drafter line per profile."""
    for profile in profiles:
        counts = [int(k) for k in profile["target_relative"]]
        line = axes.plot(
            counts, list(profile["target_relative"].values()), marker="o", label=f"target, {profile['dtype']}"
        )
        if profile["drafter_relative"]:
            axes.plot(
                [int(k) for k in profile["drafter_relative"]],
                list(profile["drafter_relative"].values()),
                marker="s",
                linestyle="--",
                color=line[0].get_color(),
                label=f"drafter, {profile['dtype']}",
            )
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens per forward (target) / block size (drafter)")
    axes.set_ylabel("cost / one 1-token target step")
    axes.set_title(f"Forward cost on a {profiles[0]['context_tokens']}-token context")
    axes.legend()
