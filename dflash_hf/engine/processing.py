"""Applying Transformers logits processors to block logits with the right prefix for every slot."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# Warpers whose output depends on the scores only, never on the prefix: they can be applied to a whole
# (rows x slots) batch in one call.
_PREFIX_FREE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


class BlockLogitsProcessor:
    """Applies a `LogitsProcessorList` to `(batch, slots, vocab)` logits.

    Prefix-dependent processors (repetition penalty, min-new-tokens, ...) are called once per row and slot with
    that row's own sequence up to the slot, i.e. exactly what plain decoding of that row would pass them.
    """

    def __init__(self, logits_processor: LogitsProcessorList | None) -> None:
        self.processors = LogitsProcessorList(logits_processor or [])
        self.is_identity = len(self.processors) == 0
        self.prefix_free = all(isinstance(proc, _PREFIX_FREE) for proc in self.processors)

    def __call__(self, logits: torch.Tensor, prefixes: Callable[[], list[torch.LongTensor]]) -> torch.Tensor:
        """Process `logits[i, j]` as the scores following row `i`'s sequence extended by `j` block tokens.

        Args:
            logits: `(batch, slots, vocab)` float logits.
            prefixes: builds, only when a processor needs them, per row the 1D sequence up to and including block
                slot `slots - 1`; slot `j` sees its first `len - (slots - 1 - j)` entries.
        """
        if self.is_identity:
            return logits
        batch, slots, vocab = logits.shape
        if self.prefix_free:
            flat_ids = torch.zeros(batch * slots, 1, dtype=torch.long, device=logits.device)
            return self.processors(flat_ids, logits.reshape(batch * slots, vocab)).view(batch, slots, vocab)
        out = torch.empty_like(logits)
        for row, sequence in enumerate(prefixes()):
            for slot in range(slots):
                end = sequence.shape[0] - (slots - 1 - slot)
                out[row, slot] = self.processors(sequence[None, :end], logits[row, slot][None])[0]
        return out
