"""Choosing a reduced draft vocabulary from the training data."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DraftVocabulary(NamedTuple):
    """A reduced draft vocabulary and how much of the training responses it can express."""

    token_ids: torch.LongTensor
    """The chosen target ids, ascending."""
    coverage: float
    """Share of the training response tokens that are in `token_ids` (a slot whose label is outside can never be
    accepted)."""


def frequent_response_tokens(dataset, size: int, vocab_size: int) -> DraftVocabulary:
    """The `size` target ids that occur most often as response tokens (`loss_mask == 1`) in `dataset`, ascending,
    with their coverage of those response tokens.

    Ties (including never-seen ids when the data has fewer than `size` distinct response tokens) go to lower ids.
    """
    if not 2 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be between 2 and the vocabulary size {vocab_size}, got {size}.")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for row in dataset:
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        mask = torch.as_tensor(row["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size).to(torch.float64)[:vocab_size]
    if counts.sum() == 0:
        raise ValueError("The training data has no response tokens (loss_mask is all zero): cannot pick a vocabulary.")
    tie_break = torch.arange(vocab_size, dtype=torch.float64) / (2 * vocab_size)  # < 1: only orders equal counts
    token_ids = torch.topk(counts - tie_break, size).indices.sort().values
    return DraftVocabulary(token_ids, float(counts[token_ids].sum() / counts.sum()))
