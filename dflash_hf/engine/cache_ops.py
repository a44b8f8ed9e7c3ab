"""Small in-place edits of a `DynamicCache` that speculative decoding needs.

They work on the cache's per-layer `keys`/`values` tensors (shape `(batch, heads, seq, head_dim)`), so they behave
the same whatever `crop` semantics the installed Transformers version has. Truncation is a view (no copy).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache


def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", True) and layer.keys is not None]


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer (a view: rolling back costs no copy)."""
    for layer in _layers(cache):
        if layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def shift_right(tensor: torch.Tensor, shifts: torch.Tensor, dim: int) -> torch.Tensor:
    """Shift each batch row of `tensor` right by `shifts[row]` along `dim`; vacated slots repeat index 0 (masked)."""
    length = tensor.shape[dim]
    index = (torch.arange(length, device=tensor.device)[None, :] - shifts[:, None]).clamp_(min=0)
    shape = [1] * tensor.dim()
    shape[0], shape[dim] = index.shape
    index = index.view(shape).expand_as(tensor)
    return torch.gather(tensor, dim, index)


def shift_cache_right(cache: DynamicCache, shifts: torch.Tensor) -> None:
    """Right-align every row again after rows committed different numbers of tokens."""
    for layer in _layers(cache):
        layer.keys = shift_right(layer.keys, shifts.to(layer.keys.device), dim=2)
        layer.values = shift_right(layer.values, shifts.to(layer.values.device), dim=2)


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only the batch rows `rows` (finished rows leave the batch)."""
    for layer in _layers(cache):
        layer.keys = layer.keys[rows.to(layer.keys.device)]
        layer.values = layer.values[rows.to(layer.values.device)]


def keep_path(cache: DynamicCache, start: int, order: torch.LongTensor) -> None:
    """Replace the positions from `start` on with the positions `start + order[row]` of each row (a tree verify keeps
    only its accepted path, `order` of shape `(batch, width)`)."""
    for layer in _layers(cache):
        index = order.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys[..., start:, :].gather(2, index)], dim=2)
        layer.values = torch.cat([layer.values[..., :start, :], layer.values[..., start:, :].gather(2, index)], dim=2)
