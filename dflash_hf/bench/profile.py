"""Cost profile: what one target forward costs for k new tokens, and one drafter forward per block size, on this
machine, in the precision the models are loaded in.

This is what decides whether speculation can pay: a cycle costs one drafter forward plus a B-token verify, a plain
step costs a 1-token forward, so the speedup is at most tau x step / (verify(B) + draft(B)). Each forward is timed
the way the engine runs it (`dflash_hf.costs`: the target through [`TargetAdapter`] with LM-head logits for every new
token, inside row-exact verification where the engine would use it; the drafter with its context features and
draft-vocabulary logits), on a cache of `context_tokens` positions that is rolled back after every timed call.

Next to them it times the matrix products alone on k rows (every linear layer, then the LM head the engine's way), of
the target and of the drafter: what any forward must compute with this machine's kernels. Their growth from 1 to k rows
bounds how cheap a k-token verify can get here, however little the rest of the forward costs, and the drafter's bound
how cheap a draft can get.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..costs import Call, TimedForwards
from ..modeling import DFlashDraftModel
from ..target.adapter import TargetAdapter
from ..target.grouped_attention import uses_grouped_attention

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16)


def decoder_linears(model: PreTrainedModel) -> list[nn.Linear]:
    """Every linear layer of `model` except its LM head (if it has one), in module order."""
    head = model.get_output_embeddings()
    return [module for module in model.modules() if isinstance(module, nn.Linear) and module is not head]


def _matmul_calls(
    model: PreTrainedModel,
    logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_size: int,
    row_counts: list[int],
    generator: torch.Generator,
) -> dict[int, Call]:
    """`model`'s matrix products alone for each row count: every linear layer on `rows` rows of random activations,
    then `logits` (the LM head the engine's way) on as many, with nothing between them."""
    linears = decoder_linears(model)
    widths = {layer.in_features for layer in linears} | {hidden_size}
    device, dtype = model.device, next(model.parameters()).dtype

    def products(inputs: dict[int, torch.Tensor]) -> None:
        for layer in linears:
            layer(inputs[layer.in_features])
        logits(inputs[hidden_size])

    def random_inputs(rows: int) -> dict[int, torch.Tensor]:
        return {width: torch.randn(rows, width, generator=generator).to(device, dtype) for width in widths}

    return {rows: functools.partial(products, random_inputs(rows)) for rows in row_counts}


@torch.no_grad()
def measure_costs(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    token_counts: tuple[int, ...] = DEFAULT_TOKEN_COUNTS,
    context_tokens: int = 256,
    repeats: int = 5,
    seed: int = 0,
    row_exact_verify: bool = True,
    comparisons: bool = True,
) -> dict[str, Any]:
    """Time the target's forward for each of `token_counts` new tokens and the drafter's for each block size.

    Returns a JSON-ready dict: `dtype`, `context_tokens`, `row_exact` (whether multi-token target forwards ran
    row-exact, as the engine runs them in this precision), `target_ms` / `target_relative` (per token count, relative
    to a 1-token step) and `drafter_ms` / `drafter_relative` (per block size from `token_counts` >= 2 up to the
    drafter's, relative to the same 1-token step), and for a hybrid target `rollback_ms` / `rollback_relative` (per
    token count > 1: bringing its linear-attention states back after a verify that kept all but its last token,
    `target.linear_attention`). `row_exact_verify=False` times stock multi-token forwards instead
    (what a reduced-precision verify would cost without exactness; the engine never runs that).

    Multi-token target forwards run in the engine's grouped-query attention where it applies
    (`target.grouped_attention`). With `comparisons` they are also timed in Transformers' `sdpa`, in the same rounds
    (`stock_attention_ms` / `stock_attention_relative`, where grouped attention applies), and, given a 1-token count,
    the matrix products alone (see the module docstring): `matmul_ms` and `floor_relative`, the cost of a k-token
    forward relative to the step if everything but those products cost what it costs for one token,
    `(step - matmul(1) + matmul(k)) / step`; and `drafter_matmul_ms` / `drafter_matmul_relative`, the drafter's linear
    layers and draft-vocabulary head alone on B rows (its whole forward can cost no less).
    """
    if context_tokens < 1 or repeats < 1 or not token_counts or min(token_counts) < 1:
        raise ValueError("context_tokens, repeats and every token count must be >= 1, with at least one count.")
    adapter = TargetAdapter.for_drafter(target, drafter)
    generator = torch.Generator().manual_seed(seed)
    forwards = TimedForwards(adapter, drafter, context_tokens, max(token_counts), generator, row_exact_verify)
    block_sizes = forwards.block_sizes(token_counts)
    products = comparisons and 1 in token_counts  # the matmul floor needs a 1-token step
    kinds = {"target": forwards.target_calls(token_counts)}
    rollback = forwards.rollback_calls(token_counts)
    if rollback:  # a hybrid target: its rollback after each verify, in the same rounds
        kinds["rollback"] = rollback
    if comparisons and not forwards.row_exact and uses_grouped_attention(target):  # row-exact attention is left alone
        kinds["stock"] = forwards.target_calls(tuple(k for k in token_counts if k > 1), stock=True)
    if products:
        kinds["matmul"] = _matmul_calls(target, adapter.logits, adapter.hidden_size, list(token_counts), generator)
    draft_calls = {"drafter": forwards.drafter_calls(block_sizes)}
    if products:
        draft_ids = getattr(drafter, "draft_token_ids", None)
        draft_ids = None if draft_ids is None else draft_ids.to(target.device)
        draft_logits = functools.partial(adapter.draft_logits, token_ids=draft_ids)
        draft_calls["drafter_matmul"] = _matmul_calls(
            drafter, draft_logits, adapter.hidden_size, block_sizes, generator
        )
    # the target's forwards and products in the same rounds, so the floor pairs with them
    rounds = [{(kind, k): call for kind, calls in kinds.items() for k, call in calls.items()}]
    rounds += [{(kind, b): call for b, call in calls.items()} for kind, calls in draft_calls.items()]
    measured = forwards.medians(rounds, repeats)
    document = {
        "dtype": str(target.dtype).replace("torch.", ""),
        "context_tokens": context_tokens,
        "repeats": repeats,
        "row_exact": forwards.row_exact,
    }
    return document | _relative_costs(measured)


def _relative_costs(measured: dict[str, dict[int, float]]) -> dict[str, dict[str, float]]:
    """[`measure_costs`]'s timings as JSON: ms per count and relative to the 1-token step, per kind of call."""
    step_ms = measured["target"].get(1) or min(measured["target"].values())

    def costs(kind: str, ms_key: str, relative_key: str) -> dict[str, dict[str, float]]:
        ms = measured.get(kind, {})
        return {ms_key: {str(k): v for k, v in ms.items()}, relative_key: {str(k): v / step_ms for k, v in ms.items()}}

    result = costs("target", "target_ms", "target_relative") | costs("drafter", "drafter_ms", "drafter_relative")
    if "matmul" in measured:
        matmul_ms = measured["matmul"]
        result["matmul_ms"] = {str(k): v for k, v in matmul_ms.items()}
        result["floor_relative"] = {str(k): (step_ms - matmul_ms[1] + v) / step_ms for k, v in matmul_ms.items()}
        result |= costs("drafter_matmul", "drafter_matmul_ms", "drafter_matmul_relative")
    if measured.get("rollback"):
        result |= costs("rollback", "rollback_ms", "rollback_relative")
    if measured.get("stock"):
        result |= costs("stock", "stock_attention_ms", "stock_attention_relative")
    return result


def _at(points: dict[str, float], x: int) -> float:
    """A measured cost curve (`{count: cost}`) at `x`: linear between the measured counts around it, extended along
    the nearest segment beyond them (a single point: constant)."""
    xs = sorted(int(k) for k in points)
    ys = [points[str(k)] for k in xs]
    if len(xs) == 1:
        return ys[0]
    right = next((i for i, k in enumerate(xs) if k >= x), len(xs) - 1)
    right = min(max(right, 1), len(xs) - 1)
    (x0, y0), (x1, y1) = (xs[right - 1], ys[right - 1]), (xs[right], ys[right])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def predicted_speedup(
    profile: dict[str, Any], accepted_lengths: list[int], verify_widths: list[int], block_sizes: list[int]
) -> float | None:
    """The cost model's speedup over plain decoding of a run's cycles: tokens committed per cycle (tau) over what a
    cycle costs in 1-token target steps, `tau / mean(verify(w) + draft(B))`, each cycle's verify of `w` tokens and
    draft of a `B`-token block costed from [`measure_costs`]' `profile` (`target_relative`, `drafter_relative`;
    between measured sizes linearly). What a run measures beyond it is the engine's own overhead (and the prefill,
    and plain decoding's per-token overhead, both outside the model). `None` without cycles or drafter costs."""
    draft = profile.get("drafter_relative")
    if not accepted_lengths or not draft:
        return None
    verify = profile["target_relative"]
    rollback = profile.get("rollback_relative")  # a hybrid target's, after each verify (at most: all but one kept)
    cost = sum(
        _at(verify, w) + (_at(rollback, w) if rollback and w > 1 else 0.0) + _at(draft, b)
        for w, b in zip(verify_widths, block_sizes, strict=True)
    )
    return sum(accepted_lengths) / cost if cost > 0 else None


def plot_profiles(profiles: list[dict[str, Any]], axes) -> None:
    """Cost relative to a 1-token step vs tokens per forward: per profile a target line (and one in Transformers'
    `sdpa` and the matmul floor, where measured) and a drafter line (and its matmuls alone)."""
    for profile in profiles:
        counts = [int(k) for k in profile["target_relative"]]
        line = axes.plot(
            counts, list(profile["target_relative"].values()), marker="o", label=f"target, {profile['dtype']}"
        )
        if profile.get("stock_attention_relative"):
            axes.plot(
                [int(k) for k in profile["stock_attention_relative"]],
                list(profile["stock_attention_relative"].values()),
                linestyle="-.",
                color=line[0].get_color(),
                label=f"target in Transformers' sdpa, {profile['dtype']}",
            )
        if profile.get("floor_relative"):
            axes.plot(
                [int(k) for k in profile["floor_relative"]],
                list(profile["floor_relative"].values()),
                linestyle=":",
                color=line[0].get_color(),
                label=f"target, matmuls-only floor, {profile['dtype']}",
            )
            axes.plot(
                [int(b) for b in profile["drafter_matmul_relative"]],
                list(profile["drafter_matmul_relative"].values()),
                linestyle="none",
                marker="x",
                color=line[0].get_color(),
                label=f"drafter, matmuls alone, {profile['dtype']}",
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
