"""Hybrid targets (Qwen3.5 / Qwen3.6 / Qwen3.8, Qwen3-Next): Gated DeltaNet linear-attention layers, whose cache is a
recurrent state and a convolution state rather than keys and values, and how a verify rolls them back.

A verify forward over `w` tokens moves each linear-attention layer's states past all of them; a row that accepts `m`
of them needs the states after its `m`-th. [`LinearAttentionStates`] does it without a second target forward:

* around the verify ([`LinearAttentionStates.verifying`]) it keeps each layer's recurrent state as it was (one copy),
  lets Transformers' cache layer record the convolution inputs of the block (`activate_past_recording`: the layer keeps
  `[previous kernel window, block inputs]`), and keeps each layer's input rows (a forward pre-hook, attached for that
  forward only);
* after the verdict ([`LinearAttentionStates.keep`]) each row's convolution state is the kernel window that ends at its
  `m`-th token, and its recurrent state is the kept one advanced over its `m` accepted tokens by the layer's own
  one-token recurrence (the module's `torch_recurrent_gated_delta_rule`, the function plain decoding steps with, or
  the kernel Transformers dispatches it to), on the queries, keys, values and gates the verify computed (convolved
  from the recorded inputs; the small gate projections re-applied to the kept input rows). Rows that accepted the
  same count share one call; rows that accepted the whole block keep the verify's own state.

What differs between the hybrid families (where the gates come from) is [`_gate_inputs`].
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

LINEAR_ATTENTION = "linear_attention"


def linear_attention_layers(config) -> list[int]:
    """Indices of a target's linear-attention layers (`layer_types`), empty for a target without any."""
    text = config.get_text_config(decoder=True)
    return [i for i, kind in enumerate(getattr(text, "layer_types", None) or []) if kind == LINEAR_ATTENTION]


def is_stateful(target: PreTrainedModel) -> bool:
    """Whether `target` has layers with a recurrent state (a hybrid model): its verifies need
    [`LinearAttentionStates`], and it cannot verify token trees in one forward."""
    return bool(linear_attention_layers(target.config))


def new_target_cache(target: PreTrainedModel) -> Cache:
    """An empty cache for `target`'s forwards: a `DynamicCache` of full-length layers (sliding windows are masks), and
    for a hybrid target a `LinearAttentionLayer` in place of each linear-attention layer's."""
    linear = set(linear_attention_layers(target.config))
    if not linear:
        return DynamicCache()
    layers = target.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[LinearAttentionLayer() if i in linear else DynamicLayer() for i in range(layers)])


def _gate_inputs(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(b, a)` gate projections of a Gated DeltaNet module for `hidden_states`, shaped `(batch, seq, v_heads)`:
    separate `in_proj_b` / `in_proj_a` (Qwen3.5), or one `in_proj_ba` grouped per key head (Qwen3-Next)."""
    if hasattr(module, "in_proj_ba"):
        batch, seq = hidden_states.shape[:2]
        per_key_head = module.num_v_heads // module.num_k_heads
        grouped = module.in_proj_ba(hidden_states).view(batch, seq, module.num_k_heads, 2 * per_key_head)
        b, a = torch.split(grouped, [per_key_head, per_key_head], dim=3)
        return b.reshape(batch, seq, module.num_v_heads), a.reshape(batch, seq, module.num_v_heads)
    return module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)


class LinearAttentionStates:
    """The linear-attention layers of a hybrid target and the rollback of their states after a verify (see the
    module docstring). One object per generation call, on that call's `cache`."""

    def __init__(self, target: PreTrainedModel, base_model: nn.Module, cache: Cache) -> None:
        self.cache = cache
        self.modules = {i: base_model.layers[i].linear_attn for i in linear_attention_layers(target.config)}
        for i, module in self.modules.items():
            if not hasattr(module, "conv1d") or not (hasattr(module, "in_proj_ba") or hasattr(module, "in_proj_a")):
                raise ValueError(
                    f"Layer {i} of this {target.config.model_type} target is a linear-attention layer of a kind "
                    f"dflash-hf cannot roll back ({type(module).__name__}): supported are the Gated DeltaNet layers "
                    "of Qwen3.5/3.6 and Qwen3-Next."
                )
        self._kept_states: dict[int, torch.Tensor] = {}
        self._inputs: dict[int, torch.Tensor] = {}

    def _layer(self, index: int) -> LinearAttentionCacheLayerMixin:
        return self.cache.layers[index]

    @contextlib.contextmanager
    def verifying(self) -> Iterator[None]:
        """Around one verify forward: keep each recurrent state, record the block's convolution inputs and each
        layer's input rows."""
        handles = []
        for i, module in self.modules.items():
            layer = self._layer(i)
            self._kept_states[i] = layer.recurrent_states[0].clone()
            layer.activate_past_recording()
            handles.append(module.register_forward_pre_hook(self._recorder(i), with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _recorder(self, index: int):
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return record

    @torch.no_grad()
    def keep(self, kept: list[int]) -> None:
        """Make every layer's states those after each row's first `kept[row]` verified tokens."""
        device = next(iter(self._inputs.values())).device if self._inputs else None
        for i, module in self.modules.items():
            layer = self._layer(i)
            window = layer.conv_kernel_size[0]
            recorded = layer.conv_states[0]  # (batch, channels, window + verified)
            verified = recorded.shape[-1] - window
            starts = torch.tensor(kept, device=recorded.device)
            index = (starts[:, None] + torch.arange(window, device=recorded.device)[None, :])[:, None, :]
            layer.conv_states[0] = recorded.gather(2, index.expand(-1, recorded.shape[1], -1)).contiguous()
            layer.record_past = False
            for count in sorted(set(kept)):
                if count == verified:  # the verify's own state is the one after its last token
                    continue
                rows = torch.tensor([r for r, n in enumerate(kept) if n == count], device=device)
                state = self._advanced(module, i, recorded, rows, count, window)
                layer.recurrent_states[0].index_copy_(0, rows, state.to(layer.recurrent_states[0].dtype))
        self._kept_states.clear()
        self._inputs.clear()

    def _advanced(
        self, module: nn.Module, index: int, recorded: torch.Tensor, rows: torch.Tensor, count: int, window: int
    ) -> torch.Tensor:
        """The kept recurrent state of `rows` advanced over their first `count` verified tokens."""
        functions = sys.modules[type(module).__module__]
        inputs = recorded[rows, :, : window + count]
        mixed = functions.causal_conv1d_fn(
            inputs, module.conv1d.weight.squeeze(1), module.conv1d.bias, activation=module.activation
        )[:, :, -count:].transpose(1, 2)
        query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        batch = rows.shape[0]
        query = query.reshape(batch, count, -1, module.head_k_dim)
        key = key.reshape(batch, count, -1, module.head_k_dim)
        value = value.reshape(batch, count, -1, module.head_v_dim)
        b, a = _gate_inputs(module, self._inputs[index][rows, :count])
        beta = b.sigmoid()
        g = -module.A_log.float().exp() * nn.functional.softplus(a.float() + module.dt_bias)
        _, state = functions.torch_recurrent_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=self._kept_states[index][rows],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return state
