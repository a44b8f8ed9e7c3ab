"""What a DFlash generation call returns with `return_dict_in_generate=True`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .acceptance import acceptance_rate_by_slot


@dataclass
class DFlashGenerateOutput:
    """Output of DFlash generation with `return_dict_in_generate=True`.

    Attributes:
        sequences: `(batch, prompt + generated)` ids, finished rows right-padded with the pad token.
        accepted_lengths: per row, the number of tokens committed in each verify cycle (accepted drafts + 1).
        cycles: number of target verify forwards per row.
        tau: mean tokens committed per verify forward over all rows and cycles.
        draft_time / verify_time / prefill_time: seconds spent in drafter forwards, target verify forwards and the
            target prefill.
        block_size: the largest block size used (the fixed size, or the adaptive policy's largest candidate).
        block_sizes: per row, the block size of each of its cycles (parallel to `accepted_lengths`).
        lookup_wins: per row, the cycles whose accepted path was the prompt-lookup branch (with
            `candidates="dflash+lookup"` or `"tree"` and greedy decoding; empty otherwise).
        verify_widths: per row, the tokens verified in each of its cycles (the block, plus the lookup branch or the
            draft tree's other nodes; parallel to `accepted_lengths`).
    """

    sequences: torch.LongTensor | None = None
    accepted_lengths: list[list[int]] = field(default_factory=list)
    cycles: list[int] = field(default_factory=list)
    tau: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    block_size: int = 0
    block_sizes: list[list[int]] = field(default_factory=list)
    lookup_wins: list[int] = field(default_factory=list)
    verify_widths: list[list[int]] = field(default_factory=list)

    @property
    def acceptance_rate_by_slot(self) -> list[float]:
        """For draft slot `i = 1..block_size-1`: the fraction of cycles that drafted slot `i` in which it was accepted."""
        lengths = [n for row in self.accepted_lengths for n in row]
        sizes = [k for row in self.block_sizes for k in row]
        return acceptance_rate_by_slot(lengths, sizes, self.block_size)
