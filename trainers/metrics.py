"""Loss weights and acceptance arithmetic of DFlash training, as pure functions of tensors."""

from __future__ import annotations

import torch

LOSS_WEIGHTINGS = ("exp_decay", "dpace")


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
