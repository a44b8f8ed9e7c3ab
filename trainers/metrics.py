"""Loss weights, per-slot accuracy and acceptance arithmetic of DFlash training, as pure functions of tensors.

The trainer keeps only state (the running sums of each mode, their reduction across processes); every number it logs
is computed here:

* **loss weights:** `exp(-(k - 1) / gamma)` per slot ([`slot_loss_weights`], `gamma` by block size in
  [`default_loss_decay_gamma`]) or D-PACE ([`dpace_slot_weights`] of the [`label_probabilities`]); the per-slot loss is
  the cross-entropy of the label, mixed with distillation and total variation ([`slot_losses`]);
* **the batch's loss:** the slot losses (a Markov head's mixed with the backbone's: [`mixed_slot_losses`], any part
  of the slots at a time), weighted and normalised by the weights' sum;
* **per-slot accuracy:** correct and labelled slots summed over a batch ([`slot_accuracy_sums`]), divided at log time
  ([`slot_accuracies`]);
* **acceptance:** implied by the per-slot accuracies ([`implied_acceptance_length`]), measured block by block
  ([`accepted_drafts`]) and replayed as greedy decoding on each response ([`decoding_walk`]);
* **metric sums:** what one batch adds ([`batch_metric_sums`]) and the logged metrics they give ([`metrics_from_sums`]).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOSS_WEIGHTINGS = ("exp_decay", "dpace")

# Paper values of the loss decay gamma by block size.
PAPER_LOSS_DECAY_GAMMA: dict[int, float] = {8: 4.0, 10: 5.0, 16: 7.0}


# ------------------------------------------------------------------------------------------- loss weights, loss


def default_loss_decay_gamma(block_size: int) -> float:
    """Loss decay `gamma` for a block size.

    The paper's values for B = 8, 10 and 16 (4, 5, 7). Other block sizes interpolate piecewise-linearly through
    the points (8, 4), (10, 5), (16, 7) and extrapolate with the slope of the nearest segment: `B / 2` below 10
    and `7 + (B - 16) / 3` above 16; never below 1.
    """
    block_size = int(block_size)
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}.")
    if block_size in PAPER_LOSS_DECAY_GAMMA:
        return PAPER_LOSS_DECAY_GAMMA[block_size]
    if block_size <= 10:
        gamma = block_size / 2.0
    else:
        gamma = 5.0 + (block_size - 10) / 3.0
    return max(1.0, gamma)


def slot_loss_weights(block_size: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """Per-slot weights `(block_size,)`: 0 for the anchor slot, `exp(-(k - 1) / gamma)` for slot `k >= 1`."""
    if gamma <= 0:
        raise ValueError(f"loss_decay_gamma must be > 0, got {gamma}.")
    k = torch.arange(block_size, device=device, dtype=torch.float64)
    weights = torch.exp(-(k - 1) / float(gamma))
    weights[0] = 0.0
    return weights.to(dtype)


def dpace_slot_weights(label_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """D-PACE slot weights: each slot's effect on the block's expected accepted length.

    With `a_k` the drafter's probability of slot `k`'s true token (a differentiable stand-in for the chance that
    greedy verification accepts it), a block's expected number of accepted drafts is `E = sum_m prod_{j<=m} a_j`
    (slot `m` is accepted only if every slot before it is). The weight of slot `k` is `dE / d log a_k =
    sum_{m>=k} prod_{j<=m} a_j`: the probability mass of every accepted prefix that runs through `k`. Early slots,
    which every accepted prefix needs, weigh most; a later slot gains weight as the slots before it become reliable.
    Computed without gradient (a weighting, not a loss term).

    Args:
        label_probs: `(..., block)`: the drafter's probability of each slot's label; slot 0 (the anchor) is ignored.
        valid: `(..., block)` bool: slots that have a label. An invalid slot ends the chain (nothing after it counts).

    Returns:
        `(..., block)` weights, 0 at slot 0 and at invalid slots.
    """
    with torch.no_grad():
        accept = torch.where(valid, label_probs.float(), torch.zeros((), device=label_probs.device))
        accept[..., 0] = 1.0
        through = torch.cumprod(accept, dim=-1)  # prob. that every slot up to k is accepted
        through[..., 0] = 0.0
        weights = through.flip(-1).cumsum(-1).flip(-1)
        weights[..., 0] = 0.0
        return torch.where(valid, weights, torch.zeros((), device=weights.device))


def label_probabilities(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`(n,)`: the drafter's probability of each slot's label from its `logits` `(n, vocab)` (0 for a label it cannot
    draft, `-100`), without gradient: what [`dpace_slot_weights`] weighs slots by."""
    with torch.no_grad():
        probs = logits.float().softmax(dim=-1).gather(-1, labels.clamp_min(0)[:, None])[:, 0]
        return torch.where(labels >= 0, probs, torch.zeros_like(probs))


def total_variation(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Per slot `(n,)`: the total variation distance `0.5 * sum |softmax(logits) - target_probs|` between the drafter's
    and the target's next-token distributions (DSpark's training loss; `1 - TV` is the chance that speculative sampling
    accepts the drafter's token)."""
    return 0.5 * (logits.float().softmax(dim=-1) - target_probs).abs().sum(dim=-1)


def slot_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    target_probs: torch.Tensor | None,
    distill_weight: float,
    tv_weight: float = 0.0,
) -> torch.Tensor:
    """Per labelled slot `(n,)`: the cross-entropy of its label (0 where it is `-100`), mixed as
    `(1 - d - t) * CE + d * CE(target_probs) + t * TV(target_probs)` with `d = distill_weight` (distillation on the
    target's distribution `target_probs` `(n, vocab)`) and `t = tv_weight` ([`total_variation`]); `target_probs` is
    needed when either is > 0."""
    ce = F.cross_entropy(logits, labels, reduction="none", ignore_index=-100)
    if distill_weight > 0 or tv_weight > 0:
        ce = max(0.0, 1.0 - distill_weight - tv_weight) * ce
    if distill_weight > 0:
        ce = ce + distill_weight * -(target_probs * logits.float().log_softmax(dim=-1)).sum(dim=-1)
    if tv_weight > 0:
        ce = ce + tv_weight * total_variation(logits, target_probs)
    return ce


def mixed_slot_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    target_probs: torch.Tensor | None = None,
    distill_weight: float = 0.0,
    tv_weight: float = 0.0,
    backbone_logits: torch.Tensor | None = None,
    markov_loss_weight: float = 1.0,
) -> torch.Tensor:
    """Per labelled slot `(n,)`: its loss ([`slot_losses`]), with a Markov head mixed with the backbone's; a batch's
    loss is their sum weighted by the slots' weights and divided by the weights' sum.

    Args:
        logits: `(n, vocab)` of `n` labelled slots (with a Markov head: corrected by it). labels: `(n,)`.
        target_probs, distill_weight, tv_weight: the distillation / total-variation mix of [`slot_losses`].
        backbone_logits: `(n, vocab)`, with a Markov head: the logits before its correction; each slot's loss is then
            `w * loss(logits) + (1 - w) * loss(backbone_logits)` with `w = markov_loss_weight`.
    """
    losses = slot_losses(logits, labels, target_probs, distill_weight, tv_weight)
    if backbone_logits is not None and markov_loss_weight < 1.0:
        backbone = slot_losses(backbone_logits, labels, target_probs, distill_weight, tv_weight)
        losses = markov_loss_weight * losses + (1.0 - markov_loss_weight) * backbone
    return losses


# ------------------------------------------------------------------------------------------- accuracy, acceptance


def slot_accuracy_sums(correct: torch.Tensor, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct and labelled slots `(block,)` each (float64), summed over the batch and anchors of `(b, A, block)`
    bool tensors."""
    return correct.sum(dim=(0, 1)).to(torch.float64), selected.sum(dim=(0, 1)).to(torch.float64)


def slot_accuracies(slot_correct: torch.Tensor, slot_total: torch.Tensor) -> list[float]:
    """Accuracy of slots 1 .. B-1 from their sums; `nan` for a slot that had no label."""
    acc = (slot_correct / slot_total.clamp_min(1)).tolist()
    return [acc[k] if float(slot_total[k]) > 0 else float("nan") for k in range(1, len(acc))]


def implied_acceptance_length(slot_accuracy: list[float]) -> float:
    """Expected tokens per verify cycle if slot `k` is right with probability `acc_k` independently:
    `1 + sum_k prod_{i <= k} acc_i` (the bonus token plus the accepted prefix)."""
    total, run = 1.0, 1.0
    for acc in slot_accuracy:
        if math.isnan(acc):
            break
        run *= acc
        total += run
    return total


def accepted_drafts(correct: torch.Tensor) -> torch.Tensor:
    """Drafts greedy verification accepts per block, `(..., B) -> (...)`: the longest run of correct slots from slot 1
    (slot 0 is the given anchor)."""
    return torch.cumprod(correct[..., 1:].long(), dim=-1).sum(dim=-1)


def decoding_walk(prefix: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor) -> tuple[int, int]:
    """Greedy speculative decoding replayed on each row's own response: `(committed tokens, verify cycles)`.

    `prefix[r, j]` is the number of drafts the target accepts in the block anchored at `anchors[r, j]`. The first
    block is anchored at the row's first valid anchor and each next one where the previous stopped (its accepted
    drafts plus the bonus token later), which is where decoding puts them: after a rejection, unlike a mean over every
    anchor. Needs every valid anchor of the row, consecutive (the evaluation's anchors); rows whose anchors are not
    are skipped."""
    tokens = cycles = 0
    for row_prefix, row_anchors, row_valid in zip(prefix.tolist(), anchors.tolist(), anchor_valid.tolist()):
        count = sum(row_valid)
        if count == 0 or row_anchors[:count] != list(range(row_anchors[0], row_anchors[0] + count)):
            continue
        j = 0
        while j < count:
            committed = row_prefix[j] + 1
            tokens += committed
            cycles += 1
            j += committed
    return tokens, cycles


# ------------------------------------------------------------------------------------------------- metric sums


def zero_metric_sums(block_size: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The running sums behind the logged metrics, all zero (float64): `slot_correct` and `slot_total`
    `(block_size,)`, `prefix_sum` (accepted drafts) over `blocks`, `walk_tokens` over `walk_cycles` (replayed
    decoding), and a DFlash 2 drafter's `unary_correct` and `in_top_k` over `selector_slots`."""
    sums = {key: torch.zeros(block_size, device=device, dtype=torch.float64) for key in ("slot_correct", "slot_total")}
    for key in ("prefix_sum", "blocks", "walk_tokens", "walk_cycles", "unary_correct", "in_top_k", "selector_slots"):
        sums[key] = torch.zeros((), device=device, dtype=torch.float64)
    return sums


def batch_metric_sums(stats: dict[str, torch.Tensor], replay_decoding: bool) -> dict[str, torch.Tensor | int]:
    """What one batch adds to the sums of [`zero_metric_sums`], from the loss's statistics (`correct` and `selected`
    `(b, A, B)` bool; `anchors` and `anchor_valid` `(b, A)` unless no row had room for a block).

    `replay_decoding` also replays greedy decoding ([`decoding_walk`]), which needs every valid anchor of each row
    (evaluation takes them all; training samples some)."""
    correct, selected = stats["correct"].detach(), stats["selected"].detach()
    slot_correct, slot_total = slot_accuracy_sums(correct, selected)
    sums: dict[str, torch.Tensor | int] = {"slot_correct": slot_correct, "slot_total": slot_total}
    if "in_top_k" in stats:
        sums["selector_slots"] = selected.sum().to(torch.float64)
        for key in ("unary_correct", "in_top_k"):
            sums[key] = (stats[key].detach() & selected).sum().to(torch.float64)
    if "anchor_valid" in stats:
        prefix = accepted_drafts(correct)
        valid = stats["anchor_valid"]
        sums["prefix_sum"] = (prefix * valid).sum().to(torch.float64)
        sums["blocks"] = valid.sum().to(torch.float64)
        if replay_decoding:
            sums["walk_tokens"], sums["walk_cycles"] = decoding_walk(prefix, stats["anchors"], valid)
    return sums


def metrics_from_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The logged metrics of [`zero_metric_sums`]'s sums (empty when no slot had a label): `accuracy` (all slots),
    `accuracy_slot_{k}` for k = 1..B-1, `acceptance_length` (implied by the per-slot accuracies),
    `acceptance_length_blockwise` (mean accepted prefix + 1, when blocks were counted) and
    `acceptance_length_decoding` (tokens per cycle of replayed decoding, when it was replayed); with a DFlash 2
    drafter, whose `accuracy` is its selector's, `unary_accuracy` (the slots' argmax) and `unary_recall_at_k` (the
    label among the selector's candidates)."""
    total = sums["slot_total"]
    if float(total.sum()) == 0:
        return {}
    slot_acc = slot_accuracies(sums["slot_correct"], total)
    metrics = {"accuracy": float(sums["slot_correct"].sum() / total.sum())}
    for k, value in enumerate(slot_acc, start=1):
        metrics[f"accuracy_slot_{k}"] = value
    metrics["acceptance_length"] = implied_acceptance_length(slot_acc)
    if float(sums["blocks"]) > 0:
        metrics["acceptance_length_blockwise"] = 1.0 + float(sums["prefix_sum"] / sums["blocks"])
    if float(sums["walk_cycles"]) > 0:
        metrics["acceptance_length_decoding"] = float(sums["walk_tokens"] / sums["walk_cycles"])
    if float(sums["selector_slots"]) > 0:
        metrics["unary_accuracy"] = float(sums["unary_correct"] / sums["selector_slots"])
        metrics["unary_recall_at_k"] = float(sums["in_top_k"] / sums["selector_slots"])
    return metrics
