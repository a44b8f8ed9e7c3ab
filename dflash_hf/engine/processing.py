"""Applying Transformers logits processors to block logits with the right prefix for every slot."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WatermarkLogitsProcessor,
)

# Processors whose output depends on the scores only, never on the prefix: they can be applied to a whole
# (rows x slots) batch in one call.
_PREFIX_FREE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
)
# Processors whose scores for a row depend only on that row's own sequence (once bound to the row, `_for_row`) and
# keep no state between calls: called once per row and slot with the row's prefix, they give what plain decoding
# gives that row.
_ROW_WISE = (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    ExponentialDecayLengthPenalty,
    SuppressTokensAtBeginLogitsProcessor,
    WatermarkLogitsProcessor,
)
# The processors the engine runs exactly. Matched by exact class: a subclass may override `__call__`.
EXACT_PROCESSORS = _PREFIX_FREE + _ROW_WISE


def _for_row(processor: LogitsProcessor, row: int) -> LogitsProcessor:
    """`processor` as plain decoding applies it to batch row `row` when it is called with that row alone."""
    if isinstance(processor, PrefixConstrainedLogitsProcessor):
        allowed, batch_id = processor._prefix_allowed_tokens_fn, row // processor._num_beams

        def allowed_in_row(_: int, sequence: torch.Tensor) -> list[int]:
            tokens = allowed(batch_id, sequence)
            if len(tokens) == 0:  # said here: the bound processor would name batch ID 0
                raise ValueError(
                    f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {batch_id}: the constraint is "
                    "unsatisfiable; check your `prefix_allowed_tokens_fn`."
                )
            return tokens

        return PrefixConstrainedLogitsProcessor(allowed_in_row, 1)
    if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
        processor.prompt_ignore_length, torch.Tensor
    ):
        bound = copy.copy(processor)
        bound.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        return bound
    return processor


class BlockLogitsProcessor:
    """Applies a `LogitsProcessorList` to `(batch, slots, vocab)` logits.

    Prefix-dependent processors (repetition penalty, min-new-tokens, ...) are called once per row and slot with
    that row's own sequence up to the slot, i.e. exactly what plain decoding of that row would pass them. Only
    `EXACT_PROCESSORS` are exact this way (`checks.check_logits_processors` refuses the others).
    """

    def __init__(self, logits_processor: LogitsProcessorList | None) -> None:
        self.processors = LogitsProcessorList(logits_processor or [])
        self.is_identity = len(self.processors) == 0
        self.prefix_free = all(isinstance(proc, _PREFIX_FREE) for proc in self.processors)
        self._row_processors: dict[int, LogitsProcessorList] = {}

    def for_row(self, row: int, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """Process `scores` `(1, vocab)` following `input_ids` `(1, length)` of batch row `row`."""
        if row not in self._row_processors:
            self._row_processors[row] = LogitsProcessorList(_for_row(proc, row) for proc in self.processors)
        return self._row_processors[row](input_ids, scores)

    def __call__(
        self, logits: torch.Tensor, rows: list[int], prefixes: Callable[[], list[torch.LongTensor]]
    ) -> torch.Tensor:
        """Process `logits[i, j]` as the scores following row `rows[i]`'s sequence extended by `j` block tokens.

        Args:
            logits: `(batch, slots, vocab)` float logits.
            rows: the batch row (of the call's input) of every entry of `logits`.
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
        for i, (row, sequence) in enumerate(zip(rows, prefixes())):
            for slot in range(slots):
                end = sequence.shape[0] - (slots - 1 - slot)
                out[i, slot] = self.for_row(row, sequence[None, :end], logits[i, slot][None])[0]
        return out
