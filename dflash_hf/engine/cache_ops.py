"""The KV caches of a generation call and the small in-place edits speculative decoding makes to them.

A call's caches are Transformers caches: a `DynamicCache` (the default), or, with `compile=True`, a `Cache` of
`StaticLayer`s ([`static_cache`]) whose fixed buffers a compiled forward (and its CUDA graphs) can keep addressing.
The edits work on each layer's `keys`/`values` tensors (shape `(batch, heads, seq, head_dim)`), so they behave the
same whatever `crop` semantics the installed Transformers version has. On a dynamic layer truncation is a view (no
copy); on a static layer it moves the layer's fill mark (`cumulative_length`), and every other edit rewrites the
filled part of the buffers in place. Edits that depend on the filled length take it from the caller (`length`), who
knows it on the host.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StaticLayer,
)


def static_cache(num_layers: int, max_cache_len: int, linear_layers: frozenset[int] = frozenset()) -> Cache:
    """A cache of `num_layers` full-length `StaticLayer`s of `max_cache_len` positions (allocated at the first forward),
    with a `LinearAttentionLayer` (fixed-size states) at each of a hybrid target's `linear_layers`.

    Every layer holds the whole context, sliding-window layers included: the engine keeps each row contiguous, so the
    window is enforced by the attention mask exactly as with a `DynamicCache`, and the edits below stay plain slices.
    """
    return Cache(
        layers=[
            LinearAttentionLayer() if i in linear_layers else StaticLayer(max_cache_len=max_cache_len)
            for i in range(num_layers)
        ]
    )


def is_static(cache: Cache) -> bool:
    """Whether `cache` has fixed buffers (built by [`static_cache`])."""
    return any(isinstance(layer, StaticLayer) for layer in cache.layers)


def attention_layer(cache: Cache) -> CacheLayerMixin:
    """The first layer of `cache` that holds keys and values (a hybrid target's first layers may be linear attention):
    the one whose length and buffers stand for all of them."""
    return next(layer for layer in cache.layers if isinstance(layer, CacheLayerMixin))


def empty(cache: Cache) -> None:
    """Forget what `cache` holds: no positions filled, linear-attention states zeroed as before a first forward."""
    truncate_cache(cache, 0)
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.reset()


def _layers(cache: Cache) -> list[CacheLayerMixin]:
    """The cache's attention layers that hold keys and values (a hybrid target's linear-attention layers hold states
    of no sequence length, rolled back by `target.linear_attention`)."""
    return [
        layer
        for layer in cache.layers
        if isinstance(layer, CacheLayerMixin) and getattr(layer, "is_initialized", True) and layer.keys is not None
    ]


def _set_length(layer: StaticLayer, length: int) -> None:
    layer.cumulative_length.fill_(length)  # in place: compiled forwards keep reading the same tensor


def _rewrite(layer: CacheLayerMixin, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
    """Make `keys`/`values` the layer's first `length` positions (a static layer's buffers are written in place)."""
    if isinstance(layer, StaticLayer):
        layer.keys[..., :length, :].copy_(keys)
        layer.values[..., :length, :].copy_(values)
        _set_length(layer, length)
    else:
        layer.keys, layer.values = keys, values


def truncate_cache(cache: Cache, length: int) -> None:
    """Keep the first `length` positions of every layer (no copy: rolling back is free)."""
    for layer in _layers(cache):
        if isinstance(layer, StaticLayer):
            _set_length(layer, length)
        elif layer.keys.shape[-2] > length:
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


def shift_cache_right(cache: Cache, shifts: torch.Tensor, length: int) -> None:
    """Right-align every row of the first `length` positions again after rows committed different numbers of
    tokens."""
    for layer in _layers(cache):
        keys, values = layer.keys[..., :length, :], layer.values[..., :length, :]
        shifts = shifts.to(keys.device)
        _rewrite(layer, shift_right(keys, shifts, dim=2), shift_right(values, shifts, dim=2), length)


def drop_leading(cache: Cache, count: int, length: int) -> None:
    """Drop the first `count` of the `length` filled positions (padding every row has): what follows moves left."""
    for layer in _layers(cache):
        keys, values = layer.keys[..., count:length, :], layer.values[..., count:length, :]
        if isinstance(layer, StaticLayer):  # overlapping source and destination: copy first
            keys, values = keys.clone(), values.clone()
        _rewrite(layer, keys, values, length - count)


def select_rows(cache: Cache, rows: torch.Tensor) -> None:
    """Keep only the batch rows `rows` (finished rows leave the batch; a static layer gets new, smaller buffers; a
    linear-attention layer keeps those rows of its states)."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.reorder_cache(rows)
    for layer in _layers(cache):
        layer.keys = layer.keys[rows.to(layer.keys.device)]
        layer.values = layer.values[rows.to(layer.values.device)]
        if isinstance(layer, StaticLayer):
            layer.batch_size = layer.keys.shape[0]
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)


def keep_path(cache: Cache, start: int, order: torch.LongTensor) -> None:
    """Replace the positions from `start` on with the positions `start + order[row]` of each row (a tree verify keeps
    only its accepted path, `order` of shape `(batch, width)`); the cache then ends after the path."""
    width = order.shape[1]

    def path_of(
        tensor: torch.Tensor,
    ) -> torch.Tensor:  # keys and values may differ in heads and size (latent attention)
        index = order.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[-1])
        return tensor[..., start:, :].gather(2, index)

    for layer in _layers(cache):
        path_keys, path_values = path_of(layer.keys), path_of(layer.values)
        if isinstance(layer, StaticLayer):
            layer.keys[..., start : start + width, :].copy_(path_keys)
            layer.values[..., start : start + width, :].copy_(path_values)
            _set_length(layer, start + width)
        else:
            layer.keys = torch.cat([layer.keys[..., :start, :], path_keys], dim=2)
            layer.values = torch.cat([layer.values[..., :start, :], path_values], dim=2)
