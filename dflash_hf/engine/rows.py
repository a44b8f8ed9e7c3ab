"""The rows of a generation call that are still generating, and the padding masks built from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import upload


def mask_or_none(mask: torch.Tensor, padded: bool, block: int = 0) -> torch.Tensor | None:
    """`mask` extended by `block` attended positions, or `None` when nothing is `padded` (unmasked fast path)."""
    if not padded:
        return None
    return torch.cat([mask, mask.new_ones(mask.shape[0], block)], dim=1) if block else mask


@dataclass
class ActiveRows:
    """The rows still generating: ids, next anchors, committed-token counts, and the tapped target features the
    drafter has not seen yet (`pending_context_hidden_states`, at positions `pending_pos`).

    `mask` is the padding mask over the target cache (which already holds the pending context); `pending_shift` is
    how far each row must move right to be contiguous again once the drafter has ingested the pending context.
    The host keeps what it decides from: the anchors' ids (`anchor_ids`), the shifts (`shifts`) and the masked
    positions of every row (`padding`), all known from the cycle's one read of the device.
    """

    rows: list[int]
    anchors: torch.LongTensor
    anchor_ids: list[int]
    committed: torch.LongTensor
    mask: torch.Tensor
    padding: list[int]
    pending_context_hidden_states: torch.Tensor
    pending_pos: torch.LongTensor
    pending_shift: torch.LongTensor
    shifts: list[int]

    def select(self, keep: list[int]) -> torch.LongTensor:
        """Keep only the rows at positions `keep` of the current batch; returns them as an index on the device."""
        index = upload(keep, self.anchors.device)
        for name in ("rows", "anchor_ids", "padding", "shifts"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        for name in ("anchors", "committed", "mask", "pending_context_hidden_states", "pending_pos", "pending_shift"):
            setattr(self, name, getattr(self, name)[index])
        return index

    def attention_mask(self, block: int = 0) -> torch.Tensor | None:
        """The padding mask over the target cache extended by `block` new positions, `None` when no row is padded."""
        return mask_or_none(self.mask, any(self.padding), block)

    def block_positions(self, block: int) -> torch.LongTensor:
        """`(rows, block)`: the positions of each row's next block, its anchor first."""
        return self.committed[:, None] + torch.arange(block, device=self.committed.device)[None, :]
