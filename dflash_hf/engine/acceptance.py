"""Verification rules that keep speculative decoding lossless.

Shapes: `k = block_size - 1` drafted tokens per row; target distributions cover the `k + 1` block positions
(position `j` predicts the token after block slot `j`; the last one gives the bonus token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# How draft tokens are proposed when sampling: "argmax" (each slot's most likely token, a point-mass proposal; coherent
# blocks) or "sample" (each slot sampled from its own marginal). Both are lossless under `rejection_sample`.
SAMPLING_PROPOSALS = ("argmax", "sample")
DEFAULT_SAMPLING_PROPOSAL = "sample"  # measured: higher tau at T=0.7 and 1.0 on both bench prompt sets (README)


def sample(probs: torch.Tensor) -> torch.LongTensor:
    """One draw from each distribution over the last dimension of `probs` (not necessarily normalised), as
    `torch.multinomial(probs, 1)` draws it (the same exponential race over the same random numbers) but without its
    check of the probabilities, which waits for the device."""
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def greedy_accept(draft_tokens: torch.LongTensor, target_tokens: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix where the draft equals the target's argmax.

    Args:
        draft_tokens: `(batch, k)` proposals.
        target_tokens: `(batch, k + 1)` target argmax at every block position.

    Returns:
        `(accepted, next_token)`: number of accepted drafts per row `(batch,)` and the target's own token after
        them `(batch,)`.
    """
    k = draft_tokens.shape[1]
    matches = (draft_tokens == target_tokens[:, :k]).int()
    accepted = matches.cumprod(dim=1).sum(dim=1)
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)
    return accepted, next_token


def rejection_sample(
    draft_tokens: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling: the output is distributed exactly as the target's.

    Draft token `d_j ~ q_j` is accepted with probability `min(1, p_j(d_j) / q_j(d_j))`. At the first rejection the
    replacement is drawn from `normalize(max(0, p_j - q_j))`; if every draft is accepted the bonus is drawn from the
    last target distribution. A draft its own proposal gives no probability (`q_j(d_j) == 0`: a slot that proposed
    nothing, `q_j` all zeros) is always rejected, and the replacement then comes from `p_j` itself.

    Args:
        draft_tokens: `(batch, k)` tokens sampled from `draft_probs`.
        draft_probs: `(batch, k, vocab)` proposal distributions `q`.
        target_probs: `(batch, k + 1, vocab)` target distributions `p`.

    Returns:
        `(accepted, next_token)` as in [`greedy_accept`].
    """
    batch, k = draft_tokens.shape
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny), 0.0)
    keep = (torch.rand_like(ratio) < ratio).int()
    accepted = keep.cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, accepted]
    padded_q = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], dim=1)
    residual = (p_next - padded_q[rows, accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # All drafts accepted -> q is the zero pad and the residual is p itself. p == q exactly -> no residual mass:
    # that slot cannot be rejected, fall back to p to keep the sampler well-defined.
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_next)
    next_token = sample(residual)
    return accepted, next_token


def acceptance_rate_by_slot(
    accepted_lengths: Sequence[int], block_sizes: Sequence[int] | None, block_size: int
) -> list[float]:
    """For draft slot `i = 1..block_size-1`: the fraction of the cycles that drafted slot `i` in which it was accepted.

    Args:
        accepted_lengths: Tokens committed in each cycle (accepted drafts + 1).
        block_sizes: Block size of each cycle (adaptive or capped blocks draft fewer slots), or `None` when every
            cycle drafted every slot.
        block_size: The largest block size.
    """
    sizes = [block_size] * len(accepted_lengths) if block_sizes is None else block_sizes
    rates = []
    for slot in range(1, block_size):
        drafted = [n for n, k in zip(accepted_lengths, sizes) if k > slot]
        rates.append(sum(n > slot for n in drafted) / len(drafted) if drafted else 0.0)
    return rates
