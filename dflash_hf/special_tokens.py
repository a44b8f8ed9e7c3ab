"""Token-id lists from the shapes configs and tokenizers give them in (an id, a list of ids, a tensor or `None`)."""

from __future__ import annotations

import torch


def token_ids(*values: int | list[int] | tuple[int, ...] | torch.Tensor | None) -> list[int]:
    """Every distinct token id among `values` (each an id, a list of ids, a tensor of any shape or `None`), in
    order."""
    ids: list[int] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            value = value.reshape(-1).tolist()
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def first_token_id(*values: int | list[int] | tuple[int, ...] | torch.Tensor | None) -> int | None:
    """The first token id among `values` (the pad-id fallback chain: pad token, else EOS), or `None`."""
    ids = token_ids(*values)
    return ids[0] if ids else None
