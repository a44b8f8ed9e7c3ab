"""Training-time tensors of the DFlash recipe (docs/design.md §3): anchors, the sparse block mask, labels and weights.

Conventions (the two published DFlash training bugs are the shifted-by-one label and `context <= anchor`):

* **Anchors** are response tokens (`loss_mask == 1`) with room for a whole block: `anchor + block_size <= length`.
* **Block j** is `[token at anchor_j, MASK * (B - 1)]` at positions `anchor_j .. anchor_j + B - 1`.
* **Mask:** block `j` sees context positions `< anchor_j` (strictly: the anchor's own hidden state is not visible, at
  inference the anchor has not been through the target yet) and all of its own block; blocks never see each other.
* **Labels** are same-position: slot `k` (k = 1..B-1) is labelled with the token at `anchor_j + k`, only where that
  token is a response token. Slot 0 (the anchor itself) is never trained.
* **Loss weights:** `exp(-(k - 1) / gamma)` for slot `k >= 1` (`metrics.slot_loss_weights`), normalised by the sum
  of the weights of the valid labels.
* **Previous tokens** (a Markov head's input, teacher forcing): slot `k`'s is the true token at `anchor_j + k - 1`, so
  slot 1's is the anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metrics import slot_loss_weights


def valid_anchor_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean `(batch, seq)`: response positions `p` with `p + block_size <= length`."""
    seq = loss_mask.shape[1]
    pos = torch.arange(seq, device=loss_mask.device)[None, :]
    return loss_mask.bool() & (pos + block_size <= lengths[:, None])


def sample_anchors(
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` distinct valid anchors per sequence (uniformly, without replacement).

    Returns `anchors (batch, A)` sorted ascending and `anchor_valid (batch, A)`, where `A` is the largest number of
    anchors any row got (at least 1). Invalid entries (rows with fewer valid positions) hold anchor 0 and must be
    ignored through `anchor_valid`. Uses the global torch RNG unless a `generator` is given, so a resumed run
    (whose RNG state the Trainer restores) samples the same anchors.
    """
    valid = valid_anchor_positions(loss_mask, lengths, block_size)
    batch, seq = valid.shape
    counts = valid.sum(dim=1)
    num = int(min(num_anchors, int(counts.max().item()) if batch else 0))
    num = max(num, 1)
    if seq == 0:
        zeros = torch.zeros(batch, 1, dtype=torch.long, device=loss_mask.device)
        return zeros, zeros.bool()
    scores = torch.rand(batch, seq, generator=generator, device="cpu" if generator is not None else loss_mask.device)
    scores = scores.to(loss_mask.device)
    scores = torch.where(valid, scores, torch.full_like(scores, -1.0))
    top_scores, top_idx = scores.topk(min(num, seq), dim=1)
    anchor_valid = top_scores >= 0
    anchors = torch.where(anchor_valid, top_idx, torch.full_like(top_idx, seq))  # invalid sort last
    anchors, order = anchors.sort(dim=1)
    anchor_valid = anchor_valid.gather(1, order)
    anchors = torch.where(anchor_valid, anchors, torch.zeros_like(anchors))
    return anchors, anchor_valid


def block_attention_mask(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, seq_len: int, block_size: int
) -> torch.Tensor:
    """Dense boolean mask `(batch, 1, A * B, seq_len + A * B)`, True = attend.

    Query row `j * B + i` (block `j`, slot `i`) sees context keys `c < anchor_j` and the keys of its own block
    `seq_len + j * B .. seq_len + j * B + B - 1`. Invalid anchors see only their own block (no NaN rows).
    """
    batch, num = anchors.shape
    device = anchors.device
    q_block = torch.arange(num * block_size, device=device) // block_size  # (Q,)
    ctx = torch.arange(seq_len, device=device)
    anchor_per_q = anchors[:, q_block]  # (b, Q)
    valid_per_q = anchor_valid[:, q_block]
    ctx_mask = (ctx[None, None, :] < anchor_per_q[:, :, None]) & valid_per_q[:, :, None]
    kv_block = torch.arange(num * block_size, device=device) // block_size
    blk_mask = (q_block[:, None] == kv_block[None, :]).expand(batch, -1, -1)
    return torch.cat([ctx_mask, blk_mask], dim=2)[:, None]


def flex_block_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, seq_len: int, block_size: int):
    """The same mask as [`block_attention_mask`] as a flex-attention `BlockMask` (sparse: skips empty tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num = anchors.shape
    masked_anchor = torch.where(anchor_valid, anchors, torch.zeros_like(anchors))
    q_len = num * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block_size
        in_ctx = kv_idx < masked_anchor[b, j]
        in_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == j)
        return in_ctx | in_block

    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=seq_len + q_len, device=anchors.device)


@dataclass
class BlockBatch:
    """Everything one drafter forward over all blocks of a batch needs."""

    anchors: torch.Tensor  # (b, A)
    anchor_valid: torch.Tensor  # (b, A) bool
    block_ids: torch.Tensor  # (b, A*B): anchor token then mask ids
    position_ids: torch.Tensor  # (b, n + A*B): context positions then block positions
    labels: torch.Tensor  # (b, A, B): token at anchor + k, -100 where not trained
    previous_ids: torch.Tensor  # (b, A*B): true token at anchor + k - 1 (slot 0: the anchor), for a Markov head
    weights: torch.Tensor  # (b, A, B): slot weight where the label is valid, else 0

    @property
    def context_length(self) -> int:
        """`n`: the length of the context the blocks follow."""
        return self.position_ids.shape[1] - self.block_ids.shape[1]

    @property
    def block_positions(self) -> torch.Tensor:
        """`(b, A, B)`: the position of each slot, `anchor + k`."""
        return self.position_ids[:, -self.block_ids.shape[1] :].view_as(self.labels)


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> BlockBatch:
    """Block inputs, positions, same-position labels and loss weights for sampled anchors."""
    batch, seq = input_ids.shape
    device = input_ids.device
    offsets = torch.arange(block_size, device=device)
    pos = anchors[:, :, None] + offsets[None, None, :]  # (b, A, B) positions anchor + k
    pos_clamped = pos.clamp(max=seq - 1)
    in_range = pos < seq
    labels = input_ids.gather(1, pos_clamped.flatten(1)).view_as(pos)
    label_ok = loss_mask.gather(1, pos_clamped.flatten(1)).view_as(pos).bool() & in_range & anchor_valid[:, :, None]
    label_ok[:, :, 0] = False  # the anchor slot is given, not predicted
    labels = torch.where(label_ok, labels, torch.full_like(labels, -100))
    slot_w = slot_loss_weights(block_size, gamma, device=device)
    weights = slot_w[None, None, :] * label_ok.float()

    block_ids = torch.full_like(pos, int(mask_token_id))
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    previous_ids = input_ids.gather(1, (pos - 1).clamp(0, seq - 1).flatten(1)).view_as(pos)
    previous_ids[:, :, 0] = block_ids[:, :, 0]
    ctx_pos = torch.arange(seq, device=device)[None, :].expand(batch, -1)
    position_ids = torch.cat([ctx_pos, pos.flatten(1)], dim=1)
    return BlockBatch(
        anchors=anchors,
        anchor_valid=anchor_valid,
        block_ids=block_ids.flatten(1),
        position_ids=position_ids,
        labels=labels,
        previous_ids=previous_ids.flatten(1),
        weights=weights,
    )
