"""Batching of rows of different lengths: the one padding helper (make-data pads left, the trainer pads right)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad(rows: Sequence[torch.Tensor], padding_value: int = 0, padding_side: str = "right") -> torch.Tensor:
    """Stack 1-D (or `(length, ...)`) tensors into one `(len(rows), longest, ...)` tensor, padding each row on
    `padding_side` with `padding_value` (the behaviour of `trl.trainer.utils.pad`, kept here because make-data and
    inference do not depend on TRL)."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    if not rows:
        raise ValueError("Nothing to pad: no rows.")
    longest = max(row.shape[0] for row in rows)
    out = rows[0].new_full((len(rows), longest, *rows[0].shape[1:]), padding_value)
    for index, row in enumerate(rows):
        if padding_side == "left":
            out[index, longest - row.shape[0] :] = row
        else:
            out[index, : row.shape[0]] = row
    return out
