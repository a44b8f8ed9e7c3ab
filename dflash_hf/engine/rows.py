"""The rows of a generation call that are still generating, and the padding masks built from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def mask_or_none(mask: torch.Tensor, block: int = 0) -> torch.Tensor | None:
    """`mask` extended by `block` attended positions, or `None` when nothing is padded (unmasked fast path)."""
    if bool(mask.all()):
        return None
    return torch.cat([mask, mask.new_ones(mask.shape[0], block)], dim=1) if block else mask


@dataclass
class ActiveRows:
    """The rows still generating: ids, next anchors, committed-token counts, and the tapped target features the
    drafter has not seen yet (`pending_context_hidden_states`, at positions `pending_pos`).

    `mask` is the padding mask over the target cache (which already holds the pending context); `pending_shift` is
    how far each row must move right to be contiguous again once the drafter has ingested the pending context.
    """

    rows: list[int]
    anchors: torch.LongTensor
    committed: torch.LongTensor
    mask: torch.Tensor
    pending_context_hidden_states: torch.Tensor
    pending_pos: torch.LongTensor
    pending_shift: torch.LongTensor

    def select(self, index: torch.LongTensor) -> None:
        """Keep only the rows at `index` (positions in the current batch)."""
        self.rows = [self.rows[i] for i in index.tolist()]
        for name in ("anchors", "committed", "mask", "pending_context_hidden_states", "pending_pos", "pending_shift"):
            setattr(self, name, getattr(self, name)[index])

    def block_positions(self, block: int) -> torch.LongTensor:
        """`(rows, block)`: the positions of each row's next block, its anchor first."""
        return self.committed[:, None] + torch.arange(block, device=self.committed.device)[None, :]
