"""Grouped-query attention without key/value copies for the engine's multi-token forwards on CPU.

Transformers' `sdpa` attention lets `scaled_dot_product_attention` read grouped key/value heads as they are
(`enable_gqa`) only when no mask is given; with a mask, as in every verify over a cache (and every tree verify), it
first copies the cached keys and values once per query head that shares them (`repeat_kv`). On CPU the kernel reads
grouped heads with a mask just as well and gives the same bits, so the copies are pure cost, and they grow with the
context (`dflash-hf profile` times a verify both ways). [`ATTENTION_NAME`] is `sdpa` with that
one difference, and [`grouped_attention`] switches a model to it for the duration of a block: the engine's generation
calls (the target, and the drafter, whose padded batches attend with a mask too), the bench's plain-decoding baseline
with the engine's kernels, the cost profile. Inside it, [`stock_attention`] runs Transformers' `sdpa` again (the cost
profile times both).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .attention_registry import SdpaVariant

ATTENTION_NAME = "grouped_sdpa"

_USERS: "weakref.WeakKeyDictionary[PreTrainedModel, int]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`sdpa`, except that a masked multi-row query on CPU attends to the grouped key/value heads directly."""
    grouped = (
        not _GROUPED.is_flagged()  # flagged: stock attention
        and query.device.type == "cpu"
        and attention_mask is not None
        and query.shape[2] > 1
        and getattr(module, "num_key_value_groups", 1) > 1
        and key.shape[-1] == value.shape[-1]
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )
    if not grouped:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


_GROUPED = SdpaVariant(ATTENTION_NAME, _grouped_sdpa)


def uses_grouped_attention(target: PreTrainedModel) -> bool:
    """Whether [`grouped_attention`] switches `target` (any model): on CPU, in `sdpa` attention, with grouped key/value
    heads (a multimodal wrapper: its text decoder's)."""
    config = target.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    per_layer = getattr(config, "per_layer_config", None)  # Gemma 4: key/value heads per layer
    if per_layer is not None:
        key_value_heads = min(per_layer[i].num_key_value_heads for i in range(config.num_hidden_layers))
    else:
        key_value_heads = getattr(config, "num_key_value_heads", heads)
    return (
        target.device.type == "cpu"
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and key_value_heads < heads
    )


@contextlib.contextmanager
def grouped_attention(target: PreTrainedModel) -> Iterator[None]:
    """Within this block a model that [`uses_grouped_attention`] runs [`ATTENTION_NAME`] (the same bits, fewer
    copies); other models are left alone. Blocks may overlap across threads: the model goes back to `sdpa` when the
    last one ends (a concurrent forward of the model meanwhile also runs grouped attention, with the same bits)."""
    with _LOCK:
        users = _USERS.get(target, 0)
        switch = users > 0 or uses_grouped_attention(target)
        if switch:
            if users == 0:
                target.set_attn_implementation(ATTENTION_NAME)
            _USERS[target] = users + 1
    try:
        yield
    finally:
        if switch:
            with _LOCK:
                _USERS[target] -= 1
                if _USERS[target] == 0:
                    del _USERS[target]
                    if target.config._attn_implementation == ATTENTION_NAME:  # unless someone switched it meanwhile
                        target.set_attn_implementation("sdpa")


def stock_attention() -> contextlib.AbstractContextManager[None]:
    """Within this block (in this thread or task) [`ATTENTION_NAME`] runs Transformers' `sdpa` unchanged."""
    return _GROUPED.flagged()
