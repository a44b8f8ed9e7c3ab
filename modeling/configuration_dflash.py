"""Configuration of the DFlash block-diffusion drafter.

This file ships inside every Hub checkpoint as remote code: it imports only ``transformers`` (and, in the model
file, ``torch``), never ``dflash_hf``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from typing import Any

from transformers.configuration_utils import PreTrainedConfig


def default_target_layer_ids(num_target_layers: int, num_target_features: int) -> list[int]:
    """Spread ``num_target_features`` taps from layer 1 to layer ``n - 3`` of an ``n``-layer target.

    ``round(1 + i * (n - 4) / (k - 1))`` for ``i = 0..k-1``; a single tap takes the middle layer ``n // 2``.
    E.g. ``n=36, k=5 -> [1, 9, 17, 25, 33]`` and ``n=32, k=5 -> [1, 8, 15, 22, 29]``.
    """
    if num_target_features < 1:
        raise ValueError(f"num_target_features must be >= 1, got {num_target_features}.")
    if num_target_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"The default layer selection needs a target with at least 4 layers (got {num_target_layers}); "
            "pass `target_layer_ids` explicitly."
        )
    span = num_target_layers - 4
    ids = [int(round(1 + i * span / (num_target_features - 1))) for i in range(num_target_features)]
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"Cannot spread {num_target_features} distinct taps over a {num_target_layers}-layer target; "
            "use fewer features or pass `target_layer_ids` explicitly."
        )
    return ids


def _text_config(config: PreTrainedConfig) -> PreTrainedConfig:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


# RoPE keys of a target that rotate part of a head or split it by axis (Qwen3.5's multimodal RoPE, Gemma 4's
# proportional RoPE); a drafter rotates its whole head, at the target's base
_PARTIAL_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
_PARTIAL_ROPE_TYPES = {"proportional": "default"}


def _full_attention_rope(rope_parameters: Any) -> dict | None:
    """Return the RoPE parameters of the target's full-attention layers (Gemma 3/4 keep one dict per layer type), as a
    RoPE over the drafter's whole head: without the target's partial-rotation keys."""
    if not isinstance(rope_parameters, dict):
        return None
    rope = None
    if "rope_type" in rope_parameters or "rope_theta" in rope_parameters:
        rope = dict(rope_parameters)
    for key in ("full_attention", "global", "default"):
        if rope is None and isinstance(rope_parameters.get(key), dict):
            rope = dict(rope_parameters[key])
    if rope is None:
        return None
    for key in _PARTIAL_ROPE_KEYS:
        rope.pop(key, None)
    if rope.get("rope_type") in _PARTIAL_ROPE_TYPES:
        rope["rope_type"] = _PARTIAL_ROPE_TYPES[rope["rope_type"]]
    return rope


def _global_values(config: PreTrainedConfig) -> PreTrainedConfig:
    """`config`, or for a config with per-layer attributes (Gemma 4's `per_layer_config`) a copy whose attributes read
    their global values (the layers' common default; the drafter has one value of each)."""
    if getattr(config, "per_layer_config", None) is None:
        return config
    config = copy.copy(config)
    config.allow_global_per_layer_attribute_access = True
    return config


def real_token_count(tokenizer: Any) -> int:
    """Number of the tokenizer's real tokens: ``len(tokenizer)`` less the trailing placeholders ``[PAD<id>]`` that
    tokenizers read from a GGUF file list for the embedding's spare rows (Qwen2.5: ids 151665 and up)."""
    count = len(tokenizer)
    name_of = getattr(tokenizer, "convert_ids_to_tokens", None)
    while name_of is not None and count > 0 and name_of(count - 1) == f"[PAD{count - 1}]":
        count -= 1
    return count


# Upper bounds of a DFlash config's sizes: far above any drafter (the official ones: 5-8 layers, blocks of 10-16),
# low enough that a hostile config.json cannot ask for terabytes.
SIZE_LIMITS = {
    "hidden_size": 32_768,
    "intermediate_size": 262_144,
    "num_hidden_layers": 128,
    "num_attention_heads": 512,
    "num_key_value_heads": 512,
    "head_dim": 2_048,
    "block_size": 256,
    "vocab_size": 4_194_304,
    "draft_vocab_size": 4_194_304,
    "max_position_embeddings": 16_777_216,
    "num_target_layers": 1_024,
}
MAX_MARKOV_RANK = 8_192
# Upper bounds of DFlash 2's sizes (the published drafters: kernel 2, groups of 16, rank 256, top-16).
DFLASH2_LIMITS = {"conv_kernel_size": 64, "conv_group_size": 32_768, "selector_rank": 8_192, "selector_top_k": 1_024}
_OPTIONAL_SIZES = ("vocab_size", "draft_vocab_size", "num_target_layers", "head_dim")


# Keys of the official (z-lab) Qwen3-style layout that have no meaning for `DFlashConfig`.
_OFFICIAL_ONLY_KEYS = (
    "model_type",
    "auto_map",
    "dflash_config",
    "use_sliding_window",
    "max_window_layers",
    "use_cache",
    "sample_from_anchor",
)

# Attention types of a draft layer (the official layout's `layer_types`).
DRAFT_LAYER_TYPES = ("full_attention", "sliding_attention")

# DFlash knobs of the official layout, read from `dflash_config` first, then the top level (the reference's rule).
OFFICIAL_DFLASH_KEYS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    "markov_rank",
    "markov_head_type",
)
# Keys of DFlash 2 drafters (`architectures: ["DFlash2DraftModel"]`).
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Top-level keys of an official config that are plain Qwen3 / `PreTrainedConfig` bookkeeping, read or ignored without
# a word (everything else unknown is a warning naming it).
_OFFICIAL_BOOKKEEPING_KEYS = (
    "architectures",
    "rope_theta",
    "rope_scaling",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "num_target_layers",
    "target_hidden_size",
    "layer_types",
    "sliding_window",
    "is_causal",
)

# `markov_head_type` of DeepSpec / speculators / llama.cpp configs -> `DFlashConfig.markov_gated`.
MARKOV_HEAD_TYPES = {"vanilla": False, "gated": True}


OFFICIAL_DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


def _is_official_config_dict(config_dict: dict) -> bool:
    """Whether `config_dict` is an official DFlash config: a plain Qwen3-style config naming `DFlashDraftModel` or
    `DFlash2DraftModel`."""
    architectures = config_dict.get("architectures") or []
    return "dflash_config" in config_dict or any(
        name in architectures for name in ("DFlashDraftModel", OFFICIAL_DFLASH2_ARCHITECTURE)
    )


def _official_value(config_dict: dict, name: str, default: Any = None) -> Any:
    """An official config's DFlash knob: from `dflash_config` first, then the top level (the reference's rule)."""
    dflash = config_dict.get("dflash_config") or {}
    if isinstance(dflash, dict) and name in dflash:
        return dflash[name]
    return config_dict.get(name, default)


def _warn_unknown_official_keys(config_dict: dict) -> None:
    """A warning naming every DFlash key of an official config that this package does not read."""
    dflash = config_dict.get("dflash_config") or {}
    known = set(OFFICIAL_DFLASH_KEYS) | set(DFLASH2_KEYS)
    unknown = sorted(f"dflash_config.{key}" for key in dflash if key not in known)
    fields = set(DFlashConfig.__annotations__) | set(PreTrainedConfig.__annotations__)
    top_known = fields | set(_OFFICIAL_ONLY_KEYS) | set(_OFFICIAL_BOOKKEEPING_KEYS) | known
    unknown += sorted(key for key in config_dict if key not in top_known and not key.startswith("_"))
    if unknown:
        warnings.warn(
            f"This official DFlash config has keys dflash-hf does not read: {', '.join(unknown)}. The drafter is "
            "loaded without them; if it was trained with them, it will draft differently than it was trained.",
            UserWarning,
            stacklevel=3,
        )


def _config_dict_from_official(config_dict: dict) -> dict:
    """Map an official DFlash config dict onto `DFlashConfig` keys (`dflash_config.*` and `block_size` lifted).

    The official layout's defaults where a knob is absent are the reference's: the noise embeddings come from the
    target's raw embedding table (`input_embedding_scale` 1.0), the draft logits are neither scaled nor softcapped
    (`output_multiplier` 1.0, `final_logit_softcapping` 0), and a draft layer's causality follows the rule of
    [`DFlashConfig.layer_is_causal`].
    """
    dflash = config_dict.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ValueError(f"`dflash_config` must be a mapping of DFlash settings, got {type(dflash).__name__}.")
    _warn_unknown_official_keys(config_dict)
    dflash = dict(dflash)
    if dflash.get("target_layer_ids") is None:
        raise ValueError(
            "This official-format DFlash config has no `dflash_config.target_layer_ids`. They decide which target "
            "layers feed the drafter and are never guessed (a guess silently breaks published checkpoints): add "
            'the list the drafter was trained with, e.g. `"dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33], '
            '"mask_token_id": 151669}`.'
        )
    block_size = dflash.get("block_size", config_dict.get("block_size"))
    if block_size is None:
        raise ValueError(
            "This official-format DFlash config has no `block_size` (top level or in `dflash_config`): add the block "
            "size the drafter was trained with."
        )
    if config_dict.get("sample_from_anchor") is True:
        raise ValueError(
            "This config sets `sample_from_anchor: true` (DeepSpec's DSpark convention: the anchor's own output "
            "predicts the next token). A DFlash drafter's slot k predicts the token at anchor + k and slot 0 is never "
            "drafted, so this checkpoint cannot be read as one."
        )
    values = {key: value for key, value in config_dict.items() if key not in _OFFICIAL_ONLY_KEYS}
    values.update(
        target_layer_ids=list(dflash["target_layer_ids"]),
        mask_token_id=_official_value(config_dict, "mask_token_id"),
        block_size=int(block_size),
        input_embedding_scale=_official_value(config_dict, "input_embedding_scale", 1.0),
        output_multiplier=_official_value(config_dict, "output_multiplier", 1.0),
        final_logit_softcapping=_official_value(config_dict, "final_logit_softcapping", None) or 0.0,
    )
    if _official_value(config_dict, "markov_rank"):
        values.update(
            markov_fields(
                int(_official_value(config_dict, "markov_rank")),
                _official_value(config_dict, "markov_head_type", "vanilla"),
            )
        )
    values.update(_official_layer_types(config_dict))
    if OFFICIAL_DFLASH2_ARCHITECTURE in (config_dict.get("architectures") or []):
        missing = [key for key in DFLASH2_KEYS if _official_value(config_dict, key) is None]
        if missing:
            raise ValueError(
                f'This DFlash 2 config (`architectures: ["{OFFICIAL_DFLASH2_ARCHITECTURE}"]`) has no {", ".join(missing)} '
                "(in `dflash_config` or at the top level): add the values the drafter was trained with."
            )
        values.update({key: _official_value(config_dict, key) for key in DFLASH2_KEYS})
    else:
        for key in DFLASH2_KEYS:  # read only for DFlash 2 drafters (the reference's rule)
            values.pop(key, None)
    return values


def _official_layer_types(config_dict: dict) -> dict:
    """`layer_types`, `sliding_window` and `is_causal` of an official config, read as its Qwen3 config reads them: the
    window only where `use_sliding_window` is true (default 4096), sliding layers from `max_window_layers` on
    (default 28) where `layer_types` is absent."""
    window = config_dict.get("sliding_window", 4096) if config_dict.get("use_sliding_window", False) else None
    layer_types = config_dict.get("layer_types")
    if layer_types is None:
        first_sliding = config_dict.get("max_window_layers", 28)
        layer_types = [
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
            for i in range(int(config_dict.get("num_hidden_layers", 0) or 0))
        ]
    return {"layer_types": layer_types, "sliding_window": window, "is_causal": config_dict.get("is_causal")}


def markov_fields(markov_rank: int, markov_head_type: str) -> dict:
    """`DFlashConfig` fields of a Markov head described the DSpark way (`markov_rank`, `markov_head_type`)."""
    if markov_head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(
            f"markov_head_type {markov_head_type!r} is not supported: a DFlash drafter's Markov head is one of "
            f"{sorted(MARKOV_HEAD_TYPES)} (DSpark's recurrent 'rnn' head and correction heads are not)."
        )
    return {"markov_rank": int(markov_rank), "markov_gated": MARKOV_HEAD_TYPES[markov_head_type]}


def markov_head_type(config: "DFlashConfig") -> str:
    """DSpark's name (`markov_head_type`) of the variant of `config`'s Markov head."""
    return next(name for name, gated in MARKOV_HEAD_TYPES.items() if gated == bool(config.markov_gated))


class DFlashConfig(PreTrainedConfig):
    r"""
    Configuration of a [`DFlashDraftModel`]: a small block-diffusion drafter that reads the hidden states of a target
    LLM through K/V injection and drafts a whole block of tokens in one forward pass.

    The drafter has no embedding and no LM head of its own: it borrows the target's, so its width equals the
    target's hidden size. Build a config for a target with [`DFlashConfig.from_target`].

    Args:
        hidden_size (`int`): Width of the drafter, equal to the target's hidden size.
        intermediate_size (`int`): Width of the SwiGLU MLP.
        num_hidden_layers (`int`): Number of draft decoder layers (the paper uses 5).
        num_attention_heads (`int`): Query heads per layer.
        num_key_value_heads (`int`, *optional*): Key/value heads (grouped-query attention); defaults to
            `num_attention_heads`.
        head_dim (`int`, *optional*): Width of one head; defaults to `hidden_size // num_attention_heads`.
        hidden_act (`str`): MLP activation.
        rms_norm_eps (`float`): Epsilon of every RMSNorm.
        max_position_embeddings (`int`): Longest context the rotary embedding is set up for.
        rope_parameters (`dict`, *optional*): RoPE parameters (`rope_type`, `rope_theta`, ...), copied from the
            target's full-attention layers.
        attention_bias (`bool`): Whether q/k/v/o projections carry a bias.
        attention_dropout (`float`): Dropout on attention probabilities during training.
        initializer_range (`float`): Std of the normal init of linear weights.
        vocab_size (`int`, *optional*): Number of rows of the target's embedding matrix; used to validate that the
            drafter is paired with the right target and that `mask_token_id` is a valid row.
        block_size (`int`): Tokens per drafted block (anchor + `block_size - 1` masked slots).
        mask_token_id (`int`, *optional*): Target embedding row used for the masked slots.
        target_layer_ids (`list[int]`): 0-based target decoder layers whose outputs form the context feature
            (`hidden_states[i + 1]` in Transformers terms). Always stored explicitly.
        num_target_layers (`int`, *optional*): Number of decoder layers of the target, for validation.
        target_model_type (`str`, *optional*): `model_type` of the target the drafter was built for.
        draft_vocab_size (`int`, *optional*): Draft over a reduced vocabulary of this many target tokens (the rows of
            the target's LM head listed by the `d2t` buffer, EAGLE-3 convention: draft id `i` is target id
            `i + d2t[i]`). Cuts the cost of the draft LM head; tokens outside it are simply never proposed.
            `None` drafts over the full vocabulary.
        markov_rank (`int`): Rank `r` of a Markov head (DSpark's, arXiv 2607.05147), `0` for none. Slot `k`'s logits
            get a low-rank correction keyed on the token before it, `logits_k += W2 @ W1[token_{k-1}]`: `W1` is
            `markov_head.markov_w1.weight` `(vocab_size, r)`, indexed by target ids; `W2` is
            `markov_head.markov_w2.weight` `(draft vocabulary, r)`, over the reduced draft vocabulary when there is one.
            The correction is added to the drafter's logits as the target's LM head gives them (after its final-logit
            softcapping, where it has one). Slots are then drafted one after another: slot 1's previous token is the
            anchor, slot `k`'s is the token drafted at slot `k - 1` (a greedy argmax, or the sample drawn from slot
            `k - 1`'s corrected distribution). The tensor names and shapes are those of DeepSpec, speculators and
            llama.cpp (`markov_w1` / `markov_w2`). Transformers' native DFlash path (`speculation_type="dflash"`)
            does not apply the head: it drafts from the backbone's logits alone, which keeps its output exact.
        markov_gated (`bool`): The gated variant of the head (DSpark's `markov_head_type: "gated"`): the correction is
            `W2 @ (g * W1[token_{k-1}])` with `g = sigmoid(gate_proj([h_k; W1[token_{k-1}]]))` from the slot's final
            hidden state `h_k` (`markov_head.gate_proj`, `(r, hidden_size + r)` plus a bias). Needs `markov_rank > 0`.
        layer_types (`list[str]`, *optional*): Each draft layer's attention, `"full_attention"` (every context
            position) or `"sliding_attention"` (the last `sliding_window` positions); defaults to all full.
        sliding_window (`int`, *optional*): The window `W` of the sliding layers: block slot `i` sees the last
            `W - 1 - i` context positions (and the block). `None`: sliding layers see the whole context.
        is_causal (`bool`, *optional*): Whether block slot `i` sees only the slots `<= i` of its block, in every layer.
            `None` (the official layout's default): a sliding layer is causal inside the block, a full one is not.
        input_embedding_scale (`float`, *optional*): The block's embeddings are the target's raw embedding table times
            this (bypassing a scaled embedding module such as Gemma's). `None`: the target's own input embedding
            module embeds the block.
        output_multiplier (`float`): The draft logits (the target's LM head on the drafter's output) are multiplied by
            this before softcapping.
        final_logit_softcapping (`float`, *optional*): Softcap `c` of the draft logits, `tanh(x / c) * c` (0: none).
            `None`: the target's own final-logit softcapping, where it has one. A Markov head's correction is added
            after it.
        conv_kernel_size (`int`, *optional*): DFlash 2 (set together with the three fields below, `None` for plain
            DFlash): every draft layer wraps its attention and its MLP in a grouped dynamic causal convolution over the
            block's positions with this many taps (`DFlash2Convolution`).
        conv_group_size (`int`, *optional*): DFlash 2: channels per group of the convolutions' dynamic kernels (divides
            `hidden_size`).
        selector_rank (`int`, *optional*): DFlash 2: rank `r` of the candidate selector's codebooks and projection.
        selector_top_k (`int`, *optional*): DFlash 2: candidates per slot the selector chooses among (the top of the
            slot's draft logits), walking from the anchor with a predecessor/successor term
            (`DFlash2CandidateSelector`).
    """

    model_type = "dflash"

    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    vocab_size: int | None = None
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    target_model_type: str | None = None
    draft_vocab_size: int | None = None
    markov_rank: int = 0
    markov_gated: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None and "rope_theta" not in kwargs and "rope_scaling" not in kwargs:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is None and isinstance(self.num_hidden_layers, int):
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        super().__post_init__(**kwargs)
        self.validate_dflash()

    def validate_dflash(self) -> None:
        """Raise a `ValueError` naming the problem if the DFlash-specific fields are inconsistent, or a size is no
        integer within [`SIZE_LIMITS`] (a config from an untrusted folder must not allocate without bound)."""
        for name, limit in SIZE_LIMITS.items():
            value = getattr(self, name, None)
            if value is None and name in _OPTIONAL_SIZES:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise ValueError(
                    f"{name} must be an int between 1 and {limit:,} in a DFlash config, got {value!r}: fix config.json."
                )
        if int(self.block_size) < 2:
            raise ValueError(
                f"block_size must be >= 2 (one anchor plus at least one drafted slot), got {self.block_size}."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.target_layer_ids is not None:
            if len(self.target_layer_ids) == 0:
                raise ValueError("target_layer_ids must name at least one target layer.")
            if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
                raise ValueError(f"target_layer_ids must be distinct, got {self.target_layer_ids}.")
            upper = self.num_target_layers
            for layer_id in self.target_layer_ids:
                if layer_id < 0 or (upper is not None and layer_id >= upper):
                    raise ValueError(
                        f"target_layer_ids {self.target_layer_ids} is out of range for a target with "
                        f"{upper} decoder layers (valid ids: 0..{None if upper is None else upper - 1})."
                    )
        if self.draft_vocab_size is not None:
            upper = self.vocab_size if self.vocab_size is not None else self.draft_vocab_size
            if not 2 <= int(self.draft_vocab_size) <= int(upper):
                raise ValueError(
                    f"draft_vocab_size must be between 2 and the target vocabulary ({upper}), got "
                    f"{self.draft_vocab_size}; use None to draft over the full vocabulary."
                )
        rank = self.markov_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_MARKOV_RANK:
            raise ValueError(
                f"markov_rank must be an int between 0 (no Markov head) and {MAX_MARKOV_RANK}, got {rank!r}."
            )
        if self.markov_rank and self.vocab_size is None:
            raise ValueError("A Markov head (markov_rank > 0) embeds target tokens: set the target's vocab_size.")
        if self.markov_gated and not self.markov_rank:
            raise ValueError("markov_gated needs a Markov head: set markov_rank > 0 (DSpark uses 256).")
        if self.mask_token_id is not None and self.vocab_size is not None:
            if not 0 <= int(self.mask_token_id) < int(self.vocab_size):
                raise ValueError(
                    f"mask_token_id {self.mask_token_id} is not a row of the target embedding "
                    f"(vocab_size {self.vocab_size})."
                )
        self._validate_layout()
        self._validate_dflash2()

    @property
    def is_dflash2(self) -> bool:
        """Whether this is a DFlash 2 drafter (dynamic convolutions and a candidate selector)."""
        return self.conv_kernel_size is not None

    def _validate_dflash2(self) -> None:
        """DFlash 2's four sizes: all set or none, within [`DFLASH2_LIMITS`], consistent with the drafter."""
        values = {key: getattr(self, key) for key in DFLASH2_KEYS}
        if all(value is None for value in values.values()):
            return
        missing = [key for key, value in values.items() if value is None]
        if missing:
            raise ValueError(
                f"A DFlash 2 drafter sets all of {', '.join(DFLASH2_KEYS)}; this config lacks {', '.join(missing)}."
            )
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= DFLASH2_LIMITS[key]:
                raise ValueError(f"{key} must be an int between 1 and {DFLASH2_LIMITS[key]:,}, got {value!r}.")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}: the "
                "convolutions' channels are grouped evenly."
            )
        if self.vocab_size is None:
            raise ValueError("A DFlash 2 selector embeds target tokens: set the target's vocab_size.")
        candidates = int(self.draft_vocab_size or self.vocab_size)
        if self.selector_top_k > candidates:
            raise ValueError(
                f"selector_top_k {self.selector_top_k} is more candidates than the draft vocabulary has ({candidates})."
            )
        if self.markov_rank:
            raise ValueError("A DFlash 2 drafter has a candidate selector, not a Markov head: set markov_rank 0.")

    def _validate_layout(self) -> None:
        """The draft layers' attention types, window and causality, and the scales of the block and the logits."""
        types = self.layer_types
        if not isinstance(types, list) or len(types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must list one attention type per draft layer ({self.num_hidden_layers}), got {types!r}: "
                "fix config.json."
            )
        wrong = sorted({str(kind) for kind in types if kind not in DRAFT_LAYER_TYPES})
        if wrong:
            raise ValueError(
                f"layer_types holds {wrong}; a draft layer's attention is one of {list(DRAFT_LAYER_TYPES)}."
            )
        window = self.sliding_window
        if window is not None and (
            isinstance(window, bool)
            or not isinstance(window, int)
            or not 1 <= window <= SIZE_LIMITS["max_position_embeddings"]
        ):
            raise ValueError(f"sliding_window must be a positive int (or null: no window), got {window!r}.")
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ValueError(f"is_causal must be true, false or null, got {self.is_causal!r}.")
        for name, lowest in (
            ("input_embedding_scale", None),
            ("output_multiplier", None),
            ("final_logit_softcapping", 0),
        ):
            value = getattr(self, name)
            if value is None and name != "output_multiplier":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
            if (lowest is None and value <= 0) or (lowest is not None and value < lowest):
                kind = "positive" if lowest is None else "0 (no softcap) or positive"
                raise ValueError(f"{name} must be {kind}, got {value!r}.")

    def layer_is_causal(self, layer_idx: int) -> bool:
        """Whether draft layer `layer_idx` is causal inside the block: `is_causal` when set, else a sliding layer is
        and a full one is not (the official layout's rule)."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer_idx] == "sliding_attention"

    def layer_window(self, layer_idx: int) -> int | None:
        """The attention window of draft layer `layer_idx`, `None` for a full-attention layer (or no window)."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @property
    def restricts_attention(self) -> bool:
        """Whether some draft layer sees less than the whole context and block (a window, or causal in the block)."""
        return any(self.layer_window(i) is not None or self.layer_is_causal(i) for i in range(self.num_hidden_layers))

    @property
    def context_window(self) -> int | None:
        """How many context positions the drafter ever attends to (`sliding_window - 1` when every layer slides within
        a window), `None` when a layer sees the whole context."""
        if self.sliding_window is None or any(kind != "sliding_attention" for kind in self.layer_types):
            return None
        return self.sliding_window - 1

    @classmethod
    def _dflash_config_dict(cls, config_dict: dict) -> dict:
        """Return `config_dict` in this class's layout: official DFlash dicts are converted, other models refused."""
        model_type = config_dict.get("model_type", cls.model_type)
        if model_type == cls.model_type:
            return config_dict
        if _is_official_config_dict(config_dict):
            return _config_dict_from_official(config_dict)
        raise ValueError(
            f"config.json has model_type `{model_type}`, which is not a DFlash drafter. Expected `{cls.model_type}` "
            '(dflash-hf layout) or an official DFlash config (`architectures: ["DFlashDraftModel"]` with a '
            "`dflash_config`). Point to the drafter's folder, not the target's."
        )

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
        """Like [`PreTrainedConfig.get_config_dict`], with official (z-lab) DFlash configs mapped onto this class.

        The official layout is a Qwen3-style config with `architectures: ["DFlashDraftModel"]`,
        `dflash_config: {"mask_token_id", "target_layer_ids"}` and `block_size` at the top level or in `dflash_config`.
        """
        config_file = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "", "config.json")
        if os.path.isfile(config_file):  # a local folder: a broken config.json gets a ValueError naming the file
            try:
                with open(config_file, encoding="utf-8") as handle:
                    json.load(handle)
            except ValueError as err:
                raise ValueError(
                    f"{config_file} is not valid JSON ({err}): restore the drafter's config.json or re-export it."
                ) from err
            except RecursionError as err:
                raise ValueError(
                    f"{config_file} is nested too deeply to be a drafter's config: restore the drafter's config.json "
                    "or re-export it."
                ) from err
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        return cls._dflash_config_dict(config_dict), kwargs

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "DFlashConfig":
        """Like [`PreTrainedConfig.from_dict`]; also accepts an official DFlash config dict (see `get_config_dict`)."""
        return super().from_dict(cls._dflash_config_dict(config_dict), **kwargs)

    @property
    def num_target_features(self) -> int:
        """Number of tapped target layers, i.e. how many hidden states are concatenated into the context feature."""
        return len(self.target_layer_ids or [])

    @classmethod
    def from_target(
        cls,
        target_config: PreTrainedConfig,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        num_target_features: int = 5,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        tokenizer: Any | None = None,
        **kwargs,
    ) -> "DFlashConfig":
        """Derive a drafter config from a target's config.

        Every dimension (hidden size, heads, KV heads, head dim, intermediate size, activation, RoPE, vocab) is
        copied from the target (a target with per-layer values: their common default), as is a logit multiplier the
        target applies before its softcap (`output_multiplier`), and `target_layer_ids` is always written out
        explicitly.

        Mask token choice when `mask_token_id` is not given: the tokenizer's own mask token when a `tokenizer` that
        declares one is passed (`tokenizer.mask_token_id`); else the first embedding row past the tokenizer's real
        tokens ([`real_token_count`]) when the embedding has spare rows (Qwen3: 151669, the id of the official drafts;
        Qwen2.5: 151665); otherwise the last embedding row (`vocab_size - 1`). The mask row only feeds the drafter's masked slots; a
        generated token that happens to have the same id is an ordinary token everywhere else.
        """
        text = _global_values(_text_config(target_config))
        num_target_layers = int(text.num_hidden_layers)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_target_features)
        vocab_size = int(text.vocab_size)
        if mask_token_id is None:
            own = getattr(tokenizer, "mask_token_id", None)
            used = real_token_count(tokenizer) if tokenizer is not None else None
            if isinstance(own, int) and 0 <= own < vocab_size:  # Gemma's `<mask>` (4), as z-lab's Gemma 4 drafters
                mask_token_id = own
            else:
                mask_token_id = used if used is not None and used < vocab_size else vocab_size - 1
        num_heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // num_heads
        hidden_act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"
        rope = _full_attention_rope(getattr(text, "rope_parameters", None))
        if rope is None:
            rope = {"rope_type": "default", "rope_theta": float(getattr(text, "rope_theta", 10000.0))}
        values = dict(
            hidden_size=int(text.hidden_size),
            intermediate_size=int(text.intermediate_size),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            hidden_act=hidden_act,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 32768)),
            rope_parameters=rope,
            vocab_size=vocab_size,
            block_size=block_size,
            mask_token_id=int(mask_token_id),
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
            target_model_type=getattr(text, "model_type", None),
        )
        multiplier = getattr(text, "output_multiplier", None)  # Muse-Glimmer scales its logits before the cap
        if multiplier is not None and float(multiplier) != 1.0:
            values["output_multiplier"] = float(multiplier)
        values.update(kwargs)
        return cls(**values)


__all__ = [
    "DFLASH2_KEYS",
    "MARKOV_HEAD_TYPES",
    "DFlashConfig",
    "default_target_layer_ids",
    "markov_fields",
    "markov_head_type",
    "real_token_count",
]
