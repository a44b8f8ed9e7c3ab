"""The labelled slots of a training batch, found once.

A batch's blocks `(b, A, B)` have a label in some slots only (`BlockBatch.weights > 0`). The loss, its D-PACE weights,
the teacher's distribution and the accuracy statistics each gather those slots (all of them, or a chunk at a time)
or scatter values back into them.
Indexing by a boolean mask finds its True places anew each time, and on a GPU each search waits for the queue (its
output's size is on the device); [`LabelledSlots`] finds them once and gathers and scatters by index after that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LabelledSlots:
    """The labelled slots of a batch: `mask` `(b, A, B)` bool and `index`, its True places in row-major order."""

    mask: torch.Tensor
    index: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, mask: torch.Tensor) -> LabelledSlots:
        """The slots where `mask` is True (one read of the mask)."""
        return cls(mask, mask.nonzero(as_tuple=True))

    def __len__(self) -> int:
        return self.index[0].numel()

    @property
    def rows(self) -> torch.Tensor:
        """`(n,)`: the batch row of each slot."""
        return self.index[0]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """`(n, ...)`: the slots' entries of `tensor` `(b, A, B, ...)`, as `tensor[mask]` gives them."""
        return tensor[self.index]

    def chunks(self, size: int) -> list[tuple[torch.Tensor, ...]]:
        """The index in consecutive parts of at most `size` slots (one part for `size` 0)."""
        size = size or len(self) or 1
        return [tuple(axis[start : start + size] for axis in self.index) for start in range(0, len(self), size)]

    def spread(self, values: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """`(b, A, B, ...)`: `values` `(n, ...)` in the slots' places, `fill` elsewhere."""
        out = values.new_full((*self.mask.shape, *values.shape[1:]), fill)
        out[self.index] = values
        return out
