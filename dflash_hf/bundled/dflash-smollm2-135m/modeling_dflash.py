"""DFlash block-diffusion drafter.

A small stack of Qwen3-style decoder layers that drafts a whole block of tokens in one forward pass, conditioned on
the target LLM's hidden states through K/V injection:

* the outputs of the target layers `config.target_layer_ids` are concatenated, projected by `fc` and normalised by
  `hidden_norm` into one *context feature* per committed token;
* in **every** layer, queries come from the block only while keys/values are `concat(context, block)`, the context
  part going through that layer's own `k_proj`/`v_proj`/`k_norm`;
* no causal mask: block queries see every context key and the whole block;
* RoPE over absolute positions; prediction is same-position (slot `i` predicts the token at slot `i`).

The drafter has no embedding and no LM head: callers embed `[anchor, MASK, ...]` with the target's input embedding
and project `last_hidden_state` with the target's LM head. An optional Markov head (`config.markov_rank`, DSpark's)
adds to each slot's logits a low-rank correction keyed on the token before the slot (`DFlashMarkovHead`).

This file ships inside every Hub checkpoint as remote code: it imports only torch, transformers and
`configuration_dflash` (relatively), never the dflash-hf package. It is one file, as Transformers' own modeling files
are: a Hub checkpoint's reader sees the whole model in one place. What differs between the Transformers versions it
supports is in one block below ("Transformers versions"); the package's own differences are in
`dflash_hf/transformers_compat.py`.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_dflash import DFlashConfig

# --- Transformers versions ----------------------------------------------------------------------------------------
# Everything this file does differently across the Transformers versions it supports (5.23 and 5.24) is in this block.

# Model outputs name their cache `cache` from Transformers 5.24 on, `past_key_values` in 5.23.
_OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def _cache_argument(cache: Cache | None, kwargs: dict) -> Cache | None:
    """The cache a forward was given: as `cache`, or as `past_key_values` (Transformers 5.23's native DFlash path
    passes it by that name), which is taken out of `kwargs` so that it goes no further down."""
    legacy = kwargs.pop("past_key_values", None)
    if cache is not None and legacy is not None:
        raise ValueError("The drafter got both `cache` and `past_key_values`: pass its cache once, as `cache`.")
    return legacy if cache is None else cache


def _forget_key_mapping(model: "PreTrainedModel", patterns: dict[str, str]) -> None:
    """Drop the renamings `patterns` from what Transformers keeps of a load (from 5.24 on, `_weight_conversions`,
    reverted by `save_pretrained`): a drafter read from published files saves its own tensor names."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        ours = set(patterns)
        model._weight_conversions = [
            conversion
            for conversion in conversions
            if not ours.issuperset(getattr(conversion, "source_patterns", None) or ["(none)"])
        ]


# --- The model ----------------------------------------------------------------------------------------------------


class DFlashRMSNorm(nn.Module):
    """Root-mean-square layer norm computed in float32 (same as Llama/Qwen3)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class DFlashRotaryEmbedding(nn.Module):
    """Rotary position embedding; any RoPE type of `transformers.modeling_rope_utils` is supported."""

    inv_freq: torch.Tensor

    def __init__(self, config: DFlashConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(
        config: DFlashConfig, device: torch.device | None = None, seq_len: int | None = None
    ) -> tuple[torch.Tensor, float]:
        """Inverse frequencies of the original RoPE."""
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (
            base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
        )
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        positions = position_ids[:, None, :].float()
        device_type = x.device.type if isinstance(x.device.type, str) and x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv_freq @ positions).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys. `cos`/`sin` cover the keys (context + block); queries are the last `q_len` of them."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_len = q.shape[-2]
    q_embed = (q * cos[..., -q_len:, :]) + (rotate_half(q) * sin[..., -q_len:, :])
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, dim) -> (batch, kv_heads * n_rep, seq, dim)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention; `attention_mask` is boolean (True = attend) or additive float."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
        else:
            attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def key_positions(
    position_ids: torch.LongTensor, past_length: int, key_length: int, key_position_ids: torch.LongTensor | None
) -> torch.LongTensor:
    """Positions `(batch, key_length)` of the keys a layer attends over: `key_position_ids` when the caller gives them,
    else the cached keys directly precede the new ones (`position_ids`: the new context and the block). A layer whose
    cache keeps only a window holds fewer cached keys than `past_length`; keys past the new ones (a static cache's
    unfilled end) get positions no query reaches (the padding mask hides them too)."""
    if key_position_ids is not None:
        if key_position_ids.shape[-1] != key_length:
            raise ValueError(
                f"key_position_ids covers {key_position_ids.shape[-1]} keys but the layer attends over {key_length}."
            )
        return key_position_ids
    new = position_ids.shape[-1]
    cached = max(0, min(past_length, key_length - new))
    before = position_ids[:, :1] - cached + torch.arange(cached, device=position_ids.device)[None, :]
    after = position_ids[:, -1:] + (1 << 30) + torch.arange(key_length - cached - new, device=position_ids.device)
    return torch.cat([before, position_ids, after.expand(position_ids.shape[0], -1)], dim=1)


def block_structure_mask(
    query_positions: torch.LongTensor, key_positions: torch.LongTensor, window: int | None, causal: bool
) -> torch.Tensor:
    """Boolean `(batch, 1, queries, keys)`, True = attend: within `window` positions of the query (on both sides when
    not `causal`) and, when `causal`, at or before it. Block slot `i` thus sees the last `window - 1 - i` context
    positions."""
    distance = query_positions[:, :, None] - key_positions[:, None, :]
    visible = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        visible &= distance >= 0
    if window is not None:
        visible &= distance < window
        if not causal:
            visible &= -distance < window
    return visible[:, None]


def _restrict_mask(attention_mask, structure: torch.Tensor):
    """`attention_mask` (none, boolean or additive, 4-D) further restricted to `structure`."""
    if attention_mask is None:
        return structure
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise ValueError(
            "This drafter has sliding-window or block-causal layers, which need a 4-D mask (eager or sdpa attention) "
            "or a mask per layer type (`attention_mask={'full_attention': ..., 'sliding_attention': ...}`)."
        )
    if attention_mask.dtype == torch.bool:
        return attention_mask & structure
    return attention_mask.masked_fill(~structure, torch.finfo(attention_mask.dtype).min)


class DFlashAttention(nn.Module):
    """Attention with K/V injection: queries from the block, keys/values from `concat(context, block)`; a sliding or
    block-causal layer (`config.layer_types`, `config.is_causal`) restricts what each block slot sees by position."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = (
            False  # the attention backends' flag: block-causality is a mask by position (`causal_in_block`)
        )
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.layer_window(layer_idx)
        self.causal_in_block = config.layer_is_causal(layer_idx)
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context_hidden_states: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | dict | None = None,
        cache: Cache | None = None,
        position_ids: torch.LongTensor | None = None,
        past_length: int = 0,
        key_position_ids: torch.LongTensor | None = None,
        restricted_masks: dict | None = None,
        **kwargs: Unpack[FlashAttentionKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, q_len, _ = hidden_states.shape
        kv_input = hidden_states
        if context_hidden_states is not None and context_hidden_states.shape[1] > 0:
            kv_input = torch.cat([context_hidden_states, hidden_states], dim=1)
        kv_len = kv_input.shape[1]

        query_states = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, -1, self.head_dim)).transpose(1, 2)
        value_states = self.v_proj(kv_input).view(batch, kv_len, -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        if isinstance(attention_mask, dict):  # a mask per layer type, built by the caller
            attention_mask = attention_mask[self.layer_type]
        elif self.sliding_window is not None or self.causal_in_block:
            # built once per forward for each window, causality and key count (`restricted_masks`, the forward's own)
            shape = (self.sliding_window, self.causal_in_block, key_states.shape[-2])
            restricted = None if restricted_masks is None else restricted_masks.get(shape)
            if restricted is None:
                keys = key_positions(position_ids, past_length, key_states.shape[-2], key_position_ids)
                queries = position_ids[:, -q_len:]
                structure = block_structure_mask(queries, keys, self.sliding_window, self.causal_in_block)
                restricted = _restrict_mask(attention_mask, structure)
                if restricted_masks is not None:
                    restricted_masks[shape] = restricted
            attention_mask = restricted

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation is not None:  # None: a module built outside `from_pretrained`, eager
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(batch, q_len, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class DFlashMLP(nn.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))`."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlash2Convolution(nn.Module):
    """DFlash 2's grouped dynamic causal convolution over the block's positions, around one sub-layer.

    With `K` taps and channels in groups of `g`: `out[t, c] = sum_o (base[side, o, c] + D[t, side, o, c // g]) *
    x[t - o, c]` (zero before the block's first slot), where `base` (`base_kernel`, `(2, K, H)`) is learned and `D`
    is a bias-free projection (`kernel_projection`) of the sub-layer's normalised input: side 0 convolves that input
    (`prepare`), side 1 the sub-layer's output (`finish`). It starts as the identity (tap 0 one, the rest and the
    projection zero). The context is never convolved: it enters as keys and values only.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.kernel_size, self.group_size = int(config.conv_kernel_size), int(config.conv_group_size)
        groups = config.hidden_size // self.group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.kernel_size, config.hidden_size))
        self.kernel_projection = DFlashZeroInitLinear(config.hidden_size, 2 * self.kernel_size * groups, bias=False)

    def prepare(self, hidden_states: torch.Tensor, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sub-layer's input convolved, and the dynamic kernels of its output (for [`finish`]). `block_size`:
        the queries are consecutive blocks of this many slots (training), each convolved alone; `None`: one block."""
        groups = hidden_states.shape[-1] // self.group_size
        dynamic = self.kernel_projection(hidden_states).view(*hidden_states.shape[:-1], 2, self.kernel_size, groups)
        before = self._convolve(hidden_states, dynamic[..., 0, :, :], self.base_kernel[0], block_size)
        return before, dynamic[..., 1, :, :]

    def finish(self, hidden_states: torch.Tensor, dynamic: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """The sub-layer's output convolved with the kernels [`prepare`] made."""
        return self._convolve(hidden_states, dynamic, self.base_kernel[1], block_size)

    def _convolve(
        self, hidden_states: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int | None
    ) -> torch.Tensor:
        batch, length, width = hidden_states.shape
        block = length if block_size is None else int(block_size)
        if length % block:
            raise ValueError(f"{length} block slots are no whole number of blocks of {block}.")
        groups = width // self.group_size
        values = hidden_states.reshape(-1, block, groups, self.group_size)
        dynamic = dynamic.reshape(-1, block, self.kernel_size, groups, 1).to(hidden_states.dtype)
        base = base.to(hidden_states.dtype).view(self.kernel_size, groups, self.group_size)
        output = torch.zeros_like(values)
        for offset in range(self.kernel_size):
            shifted = values if offset == 0 else nn.functional.pad(values[:, :-offset], (0, 0, 0, 0, offset, 0))
            output = output + base[offset] * shifted + dynamic[:, :, offset] * shifted
        return output.view(batch, length, width)


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: RMSNorm -> K/V-injected attention -> residual -> RMSNorm -> MLP -> residual; in a DFlash 2
    drafter each sub-layer is wrapped in a [`DFlash2Convolution`] over the block."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = DFlash2Convolution(config) if config.is_dflash2 else None
        self.mlp_conv = DFlash2Convolution(config) if config.is_dflash2 else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        context_hidden_states: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        draft_block_size: int | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.attention_conv is not None:
            hidden_states, kernels = self.attention_conv.prepare(hidden_states, draft_block_size)
        hidden_states, _ = self.self_attn(
            hidden_states,
            context_hidden_states=context_hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        if self.attention_conv is not None:
            hidden_states = self.attention_conv.finish(hidden_states, kernels, draft_block_size)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if self.mlp_conv is not None:
            hidden_states, kernels = self.mlp_conv.prepare(hidden_states, draft_block_size)
        hidden_states = self.mlp(hidden_states)
        if self.mlp_conv is not None:
            hidden_states = self.mlp_conv.finish(hidden_states, kernels, draft_block_size)
        return residual + hidden_states


class DFlashMarkovEmbedding(nn.Embedding):
    """The Markov head's `markov_w1`: starts with unit-variance rows (`nn.Embedding`'s own init), so that the first
    updates of the zero-initialised `markov_w2` already move the logits; see `_init_weights`."""


class DFlashZeroInitLinear(nn.Linear):
    """A linear layer whose weights start at zero (the Markov head's `markov_w2`); see `_init_weights`."""


class DFlashMarkovHead(nn.Module):
    """DSpark's Markov head: a low-rank correction of each draft slot's logits keyed on the token before the slot.

    `markov_w1` embeds the previous token (a target id) in `markov_rank` dimensions and `markov_w2` projects the
    embedding onto the draft vocabulary (the reduced one when the drafter has `d2t`, else the target's). The gated
    variant first scales the embedding by `sigmoid(gate_proj([hidden; embedding]))`, from the slot's final hidden
    state. DeepSpec, speculators and llama.cpp use the same tensor names and shapes. `markov_w2` starts at zero, so a
    new head leaves the drafter's logits unchanged until it is trained.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        rank = int(config.markov_rank)
        self.markov_w1 = DFlashMarkovEmbedding(int(config.vocab_size), rank)
        self.markov_w2 = DFlashZeroInitLinear(rank, int(config.draft_vocab_size or config.vocab_size), bias=False)
        self.gate_proj = nn.Linear(config.hidden_size + rank, rank) if config.markov_gated else None

    def forward(self, previous_token_ids: torch.LongTensor, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """The logit correction `(..., draft vocabulary)` of slots whose previous tokens are `previous_token_ids`
        `(...)`; `hidden_states` `(..., hidden_size)` are the slots' final hidden states (read by the gated variant)."""
        embedded = self.markov_w1(previous_token_ids)
        if self.gate_proj is not None:
            if hidden_states is None:
                raise ValueError("The gated Markov head needs the slots' hidden states (`hidden_states`).")
            gate_input = torch.cat([hidden_states.to(embedded.dtype), embedded], dim=-1)
            embedded = torch.sigmoid(self.gate_proj(gate_input)) * embedded
        return self.markov_w2(embedded)


class DFlashZeroInitEmbedding(nn.Embedding):
    """An embedding whose rows start at zero (DFlash 2's successor codebook: a new selector changes no choice)."""


class DFlash2CandidateSelector(nn.Module):
    """DFlash 2's candidate selector: each slot's token among the top `selector_top_k` of its draft logits, chosen
    walking from the anchor with a low-rank term for the token before it.

    Slot `t`'s candidate `k` scores `U_t[k] + <A[prev] * (W h_t), B[cand_t[k]]>`: `U` the slot's draft logits,
    `A` (`predecessor_codebook`) and `B` (`successor_codebook`) codebooks `(vocab_size, r)` over target ids, `W`
    (`hidden_projection`) a bias-free projection of the slot's final hidden state `h_t`, `prev` the token chosen at
    slot `t - 1` (the anchor for slot 1). `successor_codebook` starts at zero, so a new selector takes the argmax.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        rank = int(config.selector_rank)
        self.top_k = int(config.selector_top_k)
        self.predecessor_codebook = nn.Embedding(int(config.vocab_size), rank)
        self.successor_codebook = DFlashZeroInitEmbedding(int(config.vocab_size), rank)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def transition_scores(
        self, hidden_states: torch.Tensor, candidates: torch.LongTensor, previous: torch.LongTensor
    ) -> torch.Tensor:
        """The selector's term `(..., slots, P, K)` for each slot's `K` candidates (target ids, `(..., slots, K)`)
        after each of `P` possible previous tokens (`(..., slots, P)`: for slot `t > 1` of a walk, slot `t - 1`'s
        candidates; the anchor for slot 1; the true previous token in training, `P = 1`), from the slots' final
        hidden states `(..., slots, hidden_size)`."""
        projected = self.hidden_projection(hidden_states.to(self.hidden_projection.weight.dtype))
        left = self.predecessor_codebook(previous) * projected[..., None, :]
        return left @ self.successor_codebook(candidates).transpose(-1, -2)

    def lattice(
        self, hidden_states: torch.Tensor, candidates: torch.LongTensor, anchors: torch.LongTensor
    ) -> torch.Tensor:
        """`(batch, slots, K, K)`: entry `[t, j, k]` is what candidate `k` of slot `t` adds when slot `t - 1` chose
        its candidate `j` (slot 1: every `j` stands for the anchor). A walk then needs only gathers."""
        previous = torch.cat([anchors[:, None, None].expand(-1, 1, candidates.shape[-1]), candidates[:, :-1]], dim=1)
        return self.transition_scores(hidden_states, candidates, previous)


@dataclass
class DFlashModelOutput(BaseModelOutputWithPast):
    r"""
    markov_bias (`torch.FloatTensor` of shape `(batch, block, draft vocabulary)`, *optional*):
        The Markov head's logit correction of every block slot for the `previous_token_ids` given to the forward (in
        training: the true tokens, teacher forcing); add it to the slots' logits over the draft vocabulary.
    """

    markov_bias: torch.FloatTensor | None = None


class DFlashPreTrainedModel(PreTrainedModel):
    """Weight init, attention backends and checkpointing shared by DFlash models."""

    config_class = DFlashConfig
    config: DFlashConfig
    base_model_prefix = "dflash"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # `output_hidden_states` / `output_attentions`: the input of the first layer and each layer's output (the last one
    # replaced by the normed `last_hidden_state`), and each layer's attention weights (`eager` computes them)
    _can_record_outputs = {"hidden_states": DFlashDecoderLayer, "attentions": DFlashAttention}

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, DFlashMarkovEmbedding):
            init.normal_(module.weight, mean=0.0, std=1.0)
        elif isinstance(module, (DFlashZeroInitLinear, DFlashZeroInitEmbedding)):  # new heads change no draft
            init.zeros_(module.weight)
        elif isinstance(module, DFlash2Convolution):  # the identity: tap 0 one, the other taps zero
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            init.copy_(module.base_kernel, identity)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        r"""
        Load a drafter, strictly and from safetensors only, in the dflash-hf layout or the official DFlash layout.

        Unlike [`PreTrainedModel.from_pretrained`]:

        * an official (z-lab) config, as a folder's `config.json` or as the Qwen3-style `config` object that
          `AutoModel` passes in, is mapped onto [`DFlashConfig`] (see `DFlashConfig.get_config_dict`);
        * weights are read from safetensors only: a folder holding only pickled weights (`pytorch_model.bin`) is
          refused without the pickle ever being opened;
        * missing, unexpected or wrongly shaped tensors raise a `ValueError` instead of being silently re-initialised,
          and so do a truncated or corrupt weights file, an invalid `config.json` and, in a local folder, a shard
          index naming a file outside it and a tensor of a non-floating dtype.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError("DFlash drafters load from safetensors only; drop `use_safetensors=False`.")
        folder = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder", ""))
        if os.path.isdir(folder):
            files = os.listdir(folder)
            if not any(name.endswith(".safetensors") for name in files):
                pickles = sorted(name for name in files if name.endswith((".bin", ".pt", ".pth", ".pkl")))
                found = f"only pickled weights ({', '.join(pickles)})" if pickles else "no weights"
                raise ValueError(
                    f"{folder} holds {found}. DFlash drafters are loaded from safetensors only and pickles are never "
                    "unpickled (they can run arbitrary code): convert the checkpoint to `model.safetensors` where you "
                    "trust its origin (`safetensors.torch.save_file`), or re-export it with `dflash_hf.export`."
                )
            _check_weight_files(folder)
        if isinstance(config, PreTrainedConfig) and not isinstance(config, cls.config_class):
            config = cls.config_class.from_dict(config.to_dict())
        return_loading_info = kwargs.pop("output_loading_info", False)
        kwargs.update(use_safetensors=True, ignore_mismatched_sizes=True, output_loading_info=True)
        kwargs.setdefault("key_mapping", dict(_CODEBOOK_KEY_MAPPING))
        try:
            model, loading_info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, config=config, **kwargs
            )
        except Exception as err:  # safetensors' own error type, matched by name: this file imports only transformers
            if type(err).__name__ != "SafetensorError":
                raise
            raise ValueError(
                f"The weights in {pretrained_model_name_or_path} are not a readable safetensors file ({err}): the file "
                "is truncated or corrupt; download or re-export the drafter."
            ) from err
        _forget_key_mapping(model, _CODEBOOK_KEY_MAPPING)
        problems = []
        if loading_info["missing_keys"]:
            problems.append(f"missing tensors {sorted(loading_info['missing_keys'])}")
        if loading_info["unexpected_keys"]:
            problems.append(f"unexpected tensors {sorted(loading_info['unexpected_keys'])}")
        for name, checkpoint_shape, model_shape in sorted(loading_info["mismatched_keys"]):
            problems.append(
                f"`{name}` has shape {tuple(checkpoint_shape)} in the checkpoint but {tuple(model_shape)} in the config"
            )
        if problems:
            raise ValueError(
                f"The weights in {pretrained_model_name_or_path} do not match its DFlash config: {'; '.join(problems)}. "
                "Expected unprefixed names (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...) with the shapes "
                "implied by config.json: fix config.json or re-export the drafter with `dflash_hf.export`."
            )
        return (model, loading_info) if return_loading_info else model


# DFlash 2's published files store the selector's codebooks without the `.weight` suffix
_CODEBOOK_KEY_MAPPING = {
    r"^candidate_selector\.(predecessor|successor)_codebook$": r"candidate_selector.\1_codebook.weight",
}

# safetensors dtypes a drafter's tensors may have (anything else would be cast silently on load): floating weights,
# and the draft-to-target id map `d2t` in int64
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_INTEGER_TENSORS = {"d2t": "I64"}
_MAX_HEADER_BYTES = 100 << 20


def _safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (its tensors' names, dtypes and shapes), read without loading it."""
    with open(path, "rb") as handle:
        size_bytes = handle.read(8)
        size = struct.unpack("<Q", size_bytes)[0] if len(size_bytes) == 8 else -1
        if not 0 < size <= _MAX_HEADER_BYTES:
            raise ValueError(
                f"{path} is not a readable safetensors file: the file is truncated or corrupt; download or re-export "
                "the drafter."
            )
        try:
            header = json.loads(handle.read(size).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise ValueError(
                f"{path} has no readable safetensors header ({err}): the file is truncated or corrupt; download or "
                "re-export the drafter."
            ) from err
    if not isinstance(header, dict):
        raise ValueError(f"{path} has no readable safetensors header: re-export the drafter.")
    return header


def _check_weight_files(folder: str) -> None:
    """Refuse weight files named outside `folder` by the shard index, and non-float tensors. The weight files are
    `model.safetensors` or the shards the index names; other files (a trainer checkpoint's optimizer and RNG states)
    are not read. (A weight file may be a link, as in a Hub cache snapshot; Transformers reads it through the link
    too.)"""
    names = ["model.safetensors"] if os.path.isfile(os.path.join(folder, "model.safetensors")) else []
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError) as err:
            raise ValueError(f"{index_path} is not a shard index ({err}): re-export the drafter.") from err
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError(f"{index_path} has no `weight_map` of tensor names to files: re-export the drafter.")
        names = sorted(set(weight_map.values()))
    for name in names:
        path = os.path.join(folder, name)
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(
                f"The drafter in {folder} names the weight file {name!r}, outside its folder: re-export it."
            )
        if not os.path.isfile(path):
            continue  # a missing shard is Transformers' own error
        for tensor, info in _safetensors_header(path).items():
            dtype = info.get("dtype") if isinstance(info, dict) else None
            expected = _INTEGER_TENSORS.get(tensor)
            if tensor != "__metadata__" and (dtype != expected if expected else dtype not in _FLOAT_DTYPES):
                raise ValueError(
                    f"The tensor `{tensor}` in {path} has dtype {dtype}, not {expected or 'a floating type'}: it would "
                    "be cast silently; re-export the drafter."
                )


class DFlashNotAnAssistantError(AttributeError, ValueError):
    """Raised when a DFlash drafter is used as a plain autoregressive assistant model.

    It is an `AttributeError` (so `hasattr(drafter, "generation_config")` stays False) and a `ValueError` (bad input).
    """


_NOT_AN_ASSISTANT = (
    "A DFlash drafter is not an autoregressive assistant model: it drafts a whole block from the target's hidden "
    'states. Add `speculation_type="dflash"`: `target.generate(**inputs, assistant_model=drafter, '
    'speculation_type="dflash")`, or use `dflash_hf.generate(target, drafter, input_ids)`.'
)


class DFlashDraftModel(DFlashPreTrainedModel):
    """The DFlash drafter: context fusion (`fc` + `hidden_norm`), K/V-injected decoder layers and a final `norm`.

    Tensor names are unprefixed (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...), the layout of the official
    DFlash checkpoints that SGLang and vLLM read; a Markov head adds `markov_head.*` (see `DFlashConfig.markov_rank`).
    Transformers' native DFlash path (`speculation_type="dflash"`) projects `last_hidden_state` itself and never
    calls the Markov head: there the drafter drafts from its backbone alone and the output stays exact.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        if not config.target_layer_ids:
            raise ValueError(
                "The DFlash config has no `target_layer_ids`. They decide which target layers feed the drafter and "
                "cannot be guessed safely: build the config with `DFlashConfig.from_target(target_config, ...)` or "
                "write `target_layer_ids` explicitly into config.json."
            )
        if config.mask_token_id is None:
            raise ValueError(
                "The DFlash config has no `mask_token_id`; set it to the target embedding row used for masked slots."
            )
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        if config.draft_vocab_size is not None:
            # draft id i -> target id i + d2t[i] (EAGLE-3 convention); identity until set_draft_vocabulary()
            self.register_buffer("d2t", torch.zeros(int(config.draft_vocab_size), dtype=torch.long))
        self.markov_head = DFlashMarkovHead(config) if config.markov_rank else None
        self.candidate_selector = DFlash2CandidateSelector(config) if config.is_dflash2 else None
        self.gradient_checkpointing = False
        self.post_init()

    def add_markov_head(self, rank: int, gated: bool = False) -> None:
        """Give this drafter a new Markov head of rank `rank` (gated or vanilla, see `DFlashConfig.markov_rank`).

        Its `markov_w2` starts at zero, so the drafts stay those of the backbone until the head is trained.
        """
        if self.markov_head is not None:
            raise ValueError(f"This drafter already has a Markov head (rank {self.config.markov_rank}).")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"A Markov head's rank must be an int >= 1, got {rank!r}.")
        if self.config.vocab_size is None:
            raise ValueError("A Markov head embeds target tokens: the drafter's config needs the target's vocab_size.")
        self.config.markov_rank, self.config.markov_gated = rank, bool(gated)
        head = DFlashMarkovHead(self.config).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        head.apply(self._init_weights)
        self.markov_head = head

    def add_dflash2(
        self, conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 256, selector_top_k: int = 16
    ) -> None:
        """Make this DFlash drafter a DFlash 2 drafter: a [`DFlash2Convolution`] around every sub-layer and a
        [`DFlash2CandidateSelector`] (defaults: the published DFlash 2 drafters' sizes).

        The convolutions start as the identity and the successor codebook at zero, so the drafter drafts exactly what
        it drafted before until it is trained (a trained DFlash drafter is a DFlash 2 starting point).
        """
        if self.config.is_dflash2:
            raise ValueError("This drafter is already a DFlash 2 drafter.")
        sizes = {
            "conv_kernel_size": conv_kernel_size,
            "conv_group_size": conv_group_size,
            "selector_rank": selector_rank,
            "selector_top_k": selector_top_k,
        }
        config = self.config.__class__.from_dict({**self.config.to_dict(), **sizes})  # validated before any change
        for key in sizes:
            setattr(self.config, key, getattr(config, key))
        placement = {"device": self.fc.weight.device, "dtype": self.fc.weight.dtype}
        for layer in self.layers:
            layer.attention_conv = DFlash2Convolution(self.config).to(**placement)
            layer.mlp_conv = DFlash2Convolution(self.config).to(**placement)
            layer.attention_conv.apply(self._init_weights)
            layer.mlp_conv.apply(self._init_weights)
        self.candidate_selector = DFlash2CandidateSelector(self.config).to(**placement)
        self.candidate_selector.apply(self._init_weights)

    @property
    def draft_token_ids(self) -> torch.LongTensor | None:
        """Target ids of the reduced draft vocabulary (ascending), or `None` when drafting over the full vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocabulary(self, token_ids: torch.LongTensor | list[int]) -> None:
        """Restrict drafting to the target tokens `token_ids` (e.g. the most frequent tokens of the training data)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        if self.config.draft_vocab_size is None or ids.numel() != int(self.config.draft_vocab_size):
            raise ValueError(
                f"set_draft_vocabulary got {ids.numel()} distinct ids but the config's draft_vocab_size is "
                f"{self.config.draft_vocab_size}; build the drafter with `draft_vocab_size={ids.numel()}`."
            )
        if self.config.vocab_size is not None and int(ids.max()) >= int(self.config.vocab_size):
            raise ValueError(f"draft vocabulary ids must be < vocab_size {self.config.vocab_size}.")
        self.d2t.copy_(ids.to(self.d2t.device) - torch.arange(ids.numel(), device=self.d2t.device))

    def fuse_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """Project concatenated tapped target hidden states `(batch, n, len(ids) * H)` to context features `(batch, n, H)`."""
        expected = self.fc.in_features
        if context_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"context_hidden_states has width {context_hidden_states.shape[-1]}, expected {expected} "
                f"({len(self.config.target_layer_ids)} target layers x hidden size {self.config.hidden_size})."
            )
        return self.hidden_norm(self.fc(context_hidden_states))

    def _attention_mask_for_backend(
        self, attention_mask: torch.Tensor | None, q_len: int, kv_len: int
    ) -> torch.Tensor | None:
        """Turn a 2D padding mask over all keys into what the configured attention backend expects.

        4D masks (boolean or additive) and backend-specific objects (e.g. a flex `BlockMask`) pass through unchanged.
        Hand-written rather than `masking_utils.create_bidirectional_mask`: that helper sizes the keys as cache +
        queries, but here the keys also hold the new context tokens, which enter the cache inside the layers.
        """
        if attention_mask is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            return attention_mask
        if attention_mask.shape[-1] != kv_len:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} keys but the drafter attends over {kv_len} "
                "(cached context + new context + block)."
            )
        if "flash" in (self.config._attn_implementation or ""):
            return attention_mask
        keep = attention_mask.bool()
        if bool(keep.all()):
            return None
        return keep[:, None, None, :].expand(-1, 1, q_len, -1)

    # one readable forward, as Transformers' own model files write it: half of its length is the documented arguments
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        previous_token_ids: torch.LongTensor | None = None,
        key_position_ids: torch.LongTensor | None = None,
        draft_block_size: int | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DFlashModelOutput:
        r"""
        Args:
            noise_embeds (`torch.Tensor` of shape `(batch, block, hidden_size)`):
                Target-embedded block: the anchor (last committed token) followed by mask tokens. Inputs of any
                floating dtype are cast to the drafter's; `last_hidden_state` comes back in `noise_embeds`' dtype.
            context_hidden_states (`torch.Tensor` of shape `(batch, n_ctx, len(target_layer_ids) * hidden_size)`, *optional*):
                Tapped target hidden states of the committed tokens not yet in the cache, concatenated on the last dim.
            position_ids (`torch.LongTensor` of shape `(batch, n_ctx + block)`, *optional*):
                Absolute positions of the new context tokens followed by the block tokens.
            attention_mask (`torch.Tensor` or `dict`, *optional*):
                2D padding mask over all keys (`cached + n_ctx + block`), or a ready 4D mask (boolean, True = attend,
                or additive) of shape `(batch, 1, block, keys)`, or a backend object such as a flex `BlockMask`.
                Sliding-window and block-causal layers (`config.layer_types`, `config.is_causal`) restrict a 2D or 4D
                mask further by position; a dict `{layer type: mask}` gives each layer type its finished mask.
            cache (`Cache`, *optional*):
                Cache of context keys/values (stored rotated); also accepted as `past_key_values`, the name
                Transformers 5.23's native DFlash path passes it by. The block's keys/values are appended too; the
                caller removes them.
            previous_token_ids (`torch.LongTensor` of shape `(batch, block)`, *optional*):
                For a drafter with a Markov head: the token before each block slot (target ids); the output's
                `markov_bias` is then the head's correction of every slot's logits (training feeds the true tokens).
            key_position_ids (`torch.LongTensor` of shape `(batch, keys)`, *optional*):
                Positions of every key the layers attend over, for sliding-window and block-causal layers when the
                cached keys are not the positions right before the new context (default: they are).
            draft_block_size (`int`, *optional*):
                For a DFlash 2 drafter, when `noise_embeds` holds several consecutive blocks of this many slots
                (training): each block is convolved alone. `None`: `noise_embeds` is one block per row.
            kwargs (`TransformersKwargs`, *optional*):
                As for every Transformers model: `output_hidden_states` and `output_attentions` return the layers'
                hidden states and attention weights, `return_dict=False` a tuple; the rest reaches the attention
                backend.
        """
        cache = _cache_argument(cache, kwargs)
        if use_cache and cache is None:
            cache = DynamicCache()
        batch, block_len, _ = noise_embeds.shape
        native_cache = type(cache).__name__ == "DFlashCache"
        if native_cache and self.config.is_dflash2:
            raise ValueError(
                "Transformers' native DFlash path drafts each slot's argmax and cannot run a DFlash 2 drafter's "
                "candidate selector. Use `dflash_hf.generate(target, drafter, input_ids)` or "
                "`target.generate(**inputs, custom_generate=dflash_hf.custom_generate, drafter=drafter)`."
            )
        if native_cache:
            self._warn_native_scales()
        if native_cache and batch > 1:
            raise ValueError(
                f'Transformers\' native DFlash path (`speculation_type="dflash"`) is batch-1 only, got a batch of '
                f"{batch}. Use `dflash_hf.generate(target, drafter, input_ids, attention_mask=...)` for batches."
            )

        context = None
        if context_hidden_states is not None and context_hidden_states.shape[1] > 0:
            context = self.fuse_context(context_hidden_states.to(self.fc.weight.dtype))
        n_ctx = 0 if context is None else context.shape[1]
        past_len = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + n_ctx + block_len, device=noise_embeds.device)
            position_ids = position_ids.unsqueeze(0).expand(batch, -1)
        if position_ids.shape[-1] != n_ctx + block_len:
            raise ValueError(
                f"position_ids must cover the new context and the block ({n_ctx} + {block_len} positions), "
                f"got {position_ids.shape[-1]}."
            )
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[0] != batch:
            position_ids = position_ids.expand(batch, -1)

        hidden_states = noise_embeds.to(self.fc.weight.dtype)
        mask = self._attention_mask_for_backend(attention_mask, block_len, past_len + n_ctx + block_len)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        restricted_masks: dict = {}  # the sliding and block-causal layers' masks, shared by layers that are alike
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                context_hidden_states=context,
                position_embeddings=position_embeddings,
                attention_mask=mask,
                cache=cache,
                position_ids=position_ids,
                past_length=past_len,
                key_position_ids=key_position_ids,
                restricted_masks=restricted_masks,
                draft_block_size=draft_block_size,
                **kwargs,
            )
        # computed in the drafter's dtype, returned in the caller's (the target's LM head takes it next)
        hidden_states = self.norm(hidden_states).to(noise_embeds.dtype)
        markov_bias = None
        if previous_token_ids is not None:
            if self.markov_head is None:
                raise ValueError("previous_token_ids feed a Markov head, and this drafter has none (markov_rank 0).")
            markov_bias = self.markov_head(previous_token_ids, hidden_states)
        return DFlashModelOutput(
            last_hidden_state=hidden_states, markov_bias=markov_bias, **{_OUTPUT_CACHE_FIELD: cache}
        )

    def _warn_native_scales(self) -> None:
        """Once per drafter: Transformers' native path embeds the block with the target's embedding module and
        drafts from the LM head's plain logits, so a drafter's own scales do not apply there."""
        if getattr(self, "_warned_native_scales", False):
            return
        config = self.config
        unused = [
            name
            for name, value, default in (
                ("input_embedding_scale", config.input_embedding_scale, (None, 1.0)),
                ("output_multiplier", config.output_multiplier, (1.0,)),
                ("final_logit_softcapping", config.final_logit_softcapping, (None, 0.0)),
            )
            if value not in default
        ]
        if unused:
            self._warned_native_scales = True
            warnings.warn(
                f"Transformers' native DFlash path does not apply this drafter's {', '.join(unused)}: its drafts differ "
                "from those it was trained to make (the output is still the target's). `dflash_hf.generate(target, "
                "drafter, input_ids)` applies them.",
                UserWarning,
                stacklevel=3,
            )

    def __getattr__(self, name: str):
        # Transformers' plain assisted decoding first reads `assistant_model.generation_config`: turn that into a
        # clear error instead of a silent autoregressive misuse of the drafter.
        if name == "generation_config":
            raise DFlashNotAnAssistantError(_NOT_AN_ASSISTANT)
        return super().__getattr__(name)

    def generate(self, *args, **kwargs):
        """A DFlash drafter cannot generate on its own; see the error message for the two supported call forms."""
        raise DFlashNotAnAssistantError(_NOT_AN_ASSISTANT)

    def spec_generate(
        self,
        target: PreTrainedModel,
        input_ids: torch.LongTensor,
        max_new_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        **kwargs,
    ) -> torch.LongTensor:
        """Generate with `target`, this drafter drafting, through Transformers' native DFlash path:
        `target.generate(input_ids, assistant_model=self, speculation_type="dflash", ...)`. One row; the output is
        the target's own (token for token when greedy); a Markov head is not used on this path.

        The call of the official DFlash checkpoints' remote code: `temperature` 0 decodes greedily and above 0 samples
        at that temperature, `stop_token_ids` replace the target's EOS ids, other keywords go to `target.generate`.
        For batches, the Markov head and adaptive block sizes use the dflash-hf package: `dflash_hf.generate(target,
        drafter, input_ids)`.
        """
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}.")
        options: dict = {"do_sample": temperature > 0}
        if temperature > 0:
            options["temperature"] = float(temperature)
        if max_new_tokens is not None:
            options["max_new_tokens"] = max_new_tokens
        if stop_token_ids is not None:
            options["eos_token_id"] = [int(token_id) for token_id in stop_token_ids]
        options.update(kwargs)
        return target.generate(input_ids, assistant_model=self, speculation_type="dflash", **options)


__all__ = [
    "DFlashDraftModel",
    "DFlashMarkovHead",
    "DFlashModelOutput",
    "DFlashNotAnAssistantError",
    "DFlashPreTrainedModel",
]
