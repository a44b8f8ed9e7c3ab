"""Choosing a reduced draft vocabulary from the training data."""

from __future__ import annotations

import torch


def frequent_response_tokens(dataset, size: int, vocab_size: int) -> torch.LongTensor:
    """The `size` target ids that occur most often as response tokens (`loss_mask == 1`) in `dataset`, ascending.

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
    return torch.topk(counts - tie_break, size).indices.sort().values
