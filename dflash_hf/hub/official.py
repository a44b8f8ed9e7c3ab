"""The official (z-lab) DFlash checkpoint format, read by SGLang and vLLM.

An official checkpoint is a plain Qwen3-style `config.json` (`model_type: "qwen3"`) naming
`architectures: ["DFlashDraftModel"]`, with `auto_map: {"AutoModel": "dflash.DFlashDraftModel"}`, the draft depth in
`num_hidden_layers`, `num_target_layers`, `block_size` and `dflash_config: {"mask_token_id", "target_layer_ids"}`.
Tensor names are the same unprefixed names as ours, so only the config differs; a DFlash 2 drafter
(`architectures: ["DFlash2DraftModel"]`, its sizes in `dflash_config`) stores its selector's codebooks without the
`.weight` suffix, as the published ones do.

A Markov head (`DFlashConfig.markov_rank`) travels as its tensors `markov_head.markov_w1.weight`,
`markov_head.markov_w2.weight` (and `markov_head.gate_proj.*` when gated) with DSpark's fields in `dflash_config`:
`markov_rank` and `markov_head_type` (`"vanilla"` or `"gated"`), plus `sample_from_anchor: false` at the top level
(DSpark readers' name for this drafter's slot convention: slot 0 is the anchor, drafts start at slot 1). Readers that
know only plain DFlash may refuse the extra tensors; the dflash-hf remote code reads them back.

Reading is done by the remote code itself (`DFlashConfig.get_config_dict` / `DFlashConfig.from_dict` map an official
dict onto [`DFlashConfig`]), so that a checkpoint loads without this package; this module writes the format.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from ..drafters import DRAFT_LAYER_SIZES
from ..modeling import DFlashConfig, DFlashDraftModel
from ..modeling.configuration_dflash import DFLASH2_KEYS, OFFICIAL_DFLASH2_ARCHITECTURE, markov_head_type
from ..target.support import input_embedding_scale

OFFICIAL_MODEL_TYPE = "qwen3"
OFFICIAL_ARCHITECTURE = "DFlashDraftModel"
# The remote-code module an official checkpoint's `auto_map` points at; exports ship our modeling file under this name.
OFFICIAL_MODELING_FILE = "dflash.py"
OFFICIAL_AUTO_MAP = {"AutoModel": f"{OFFICIAL_MODELING_FILE.removesuffix('.py')}.{OFFICIAL_ARCHITECTURE}"}

# Draft-layer fields shared verbatim by `DFlashConfig` and a Qwen3 config (the official layout's config, and the
# `transformer_layer_config` of the speculators layout).
DRAFT_LAYER_KEYS = (
    *DRAFT_LAYER_SIZES,
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "attention_bias",
    "attention_dropout",
    "initializer_range",
)
_SHARED_KEYS = ("vocab_size", *DRAFT_LAYER_KEYS)


def to_official_config(config: DFlashConfig, target: PreTrainedModel | None = None) -> dict[str, Any]:
    """Return the official config dict of a drafter configured by `config`, for `target`.

    `rope_parameters` is written for Transformers v5 readers together with `rope_theta`/`rope_scaling` for readers on
    Transformers 4.x (which would otherwise fall back to a default RoPE base silently). `block_size` is written both at
    the top level (older readers) and inside `dflash_config` (newer readers). The draft layers' `layer_types`,
    `sliding_window` (with `use_sliding_window`, which a Qwen3 config needs to keep it) and `is_causal` go to the top
    level; `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` into `dflash_config`, as the
    values this drafter runs with: where it follows `target` (the target's scaled embedding, its softcap) they are
    the target's, which readers of the official layout do not apply on their own.
    """
    missing = [name for name in ("vocab_size", "mask_token_id", "target_layer_ids") if getattr(config, name) is None]
    if missing:
        raise ValueError(
            f"The official DFlash format needs {', '.join(missing)} in the drafter config; build the config with "
            "`DFlashConfig.from_target(target_config, ...)`, which fills them from the target."
        )
    rope = dict(config.rope_parameters or {})
    rope_scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    official: dict[str, Any] = {
        "architectures": [OFFICIAL_ARCHITECTURE],
        "auto_map": dict(OFFICIAL_AUTO_MAP),
        "model_type": OFFICIAL_MODEL_TYPE,
        **{key: getattr(config, key) for key in _SHARED_KEYS},
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta"),
        "rope_scaling": rope_scaling if rope_scaling.get("rope_type", "default") != "default" else None,
        "tie_word_embeddings": False,
        "block_size": int(config.block_size),
        "dflash_config": {
            "mask_token_id": int(config.mask_token_id),
            "target_layer_ids": [int(i) for i in config.target_layer_ids],
            "block_size": int(config.block_size),
        },
        "dtype": config.to_dict().get("dtype"),
        "transformers_version": transformers.__version__,
    }
    official.update(_draft_layer_layout(config))
    official["dflash_config"].update(_draft_scales(config, target))
    if config.num_target_layers is not None:
        official["num_target_layers"] = int(config.num_target_layers)
    if config.draft_vocab_size is not None:  # with the `d2t` tensor, as EAGLE-3-style readers expect
        official["draft_vocab_size"] = int(config.draft_vocab_size)
    if config.markov_rank:
        official["dflash_config"].update(markov_rank=int(config.markov_rank), markov_head_type=markov_head_type(config))
        official["sample_from_anchor"] = False
    if config.is_dflash2:
        official["architectures"] = [OFFICIAL_DFLASH2_ARCHITECTURE]
        official["dflash_config"].update({key: int(getattr(config, key)) for key in DFLASH2_KEYS})
    return official


def official_state_dict(drafter: DFlashDraftModel) -> dict[str, torch.Tensor] | None:
    """The tensors of `drafter` under the official layout's names where they differ from its own (a DFlash 2
    selector's codebooks are stored without `.weight`, as published), else `None` (the names are the same)."""
    if not drafter.config.is_dflash2:
        return None
    return {
        name.removesuffix(".weight") if name.endswith("_codebook.weight") else name: tensor
        for name, tensor in drafter.state_dict().items()
    }


def _draft_layer_layout(config: DFlashConfig) -> dict[str, Any]:
    """The draft layers' attention types, window and causality, as a Qwen3 config reads them back."""
    layout: dict[str, Any] = {
        "layer_types": list(config.layer_types),
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        "max_window_layers": 0,
    }
    if config.is_causal is not None:
        layout["is_causal"] = bool(config.is_causal)
    return layout


def _draft_scales(config: DFlashConfig, target: PreTrainedModel | None) -> dict[str, float]:
    """The `dflash_config` scales this drafter runs with (the official readers' defaults left out)."""
    scales: dict[str, float] = {}
    embedding = config.input_embedding_scale
    if embedding is None and target is not None:
        embedding = input_embedding_scale(target)
    if embedding is not None and float(embedding) != 1.0:
        scales["input_embedding_scale"] = float(embedding)
    if float(config.output_multiplier) != 1.0:
        scales["output_multiplier"] = float(config.output_multiplier)
    softcap = config.final_logit_softcapping
    if softcap is None and target is not None:
        softcap = getattr(target.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if softcap:
        scales["final_logit_softcapping"] = float(softcap)
    return scales


__all__ = [
    "DRAFT_LAYER_KEYS",
    "OFFICIAL_ARCHITECTURE",
    "OFFICIAL_AUTO_MAP",
    "OFFICIAL_MODELING_FILE",
    "OFFICIAL_MODEL_TYPE",
    "official_state_dict",
    "to_official_config",
]
