"""The speculators DFlash checkpoint format (vLLM's `speculators` library), reduced draft vocabulary included.

vLLM serves DFlash drafters in the format of its `speculators` library (`DFlashSpeculatorConfig` /
`DFlashDraftModel`). What it reads, checked against speculators 0.9.0 (`examples/interop/`):

- `config.json`: `speculators_model_type: "dflash"`, `transformer_layer_config` (a Qwen3 config of the draft layers
  whose `vocab_size` is the *target's* vocabulary), a top-level `draft_vocab_size`, `block_size`, `mask_token_id`,
  `aux_hidden_state_layer_ids` and `speculators_config` (greedy proposal of `block_size - 1` tokens, the verifier's
  Hub id and architectures).
- Tapped layers are counted differently: speculators' id `L` is the *input* of verifier layer `L` (vLLM captures
  hidden states before each layer), so our (and the official layout's) output-of-layer id `L` is its `L + 1`. The
  verifier's last layer has no such id, so a drafter tapping it cannot be written.
- The draft body keeps our tensor names. `embed_tokens` and, for a full vocabulary, `lm_head` are not stored: they are
  reloaded from the verifier (its `lm_head.weight`, or its embedding when the head is tied, which is the same matrix).
- A reduced draft vocabulary is stored as `lm_head.weight` `[draft_vocab_size, hidden]` (the verifier's head rows of
  the draft tokens), `d2t` (int64 offsets: draft id `i` is target id `i + d2t[i]`, ids ascending) and `t2d` (bool mask
  over the target vocabulary). speculators' own converter of the official layout keeps none of these (it drafts over
  the full vocabulary, which is not the drafter we trained), so this format is written directly from the drafter.

A drafter with a Markov head is written as speculators' DSpark model (`speculators_model_type: "dspark"`,
`architectures: ["DSparkDraftModel"]`, the same fields plus `markov_rank`, `markov_head_type`,
`enable_confidence_head: false` and `sample_from_anchor: false`, our slot convention), its head tensors under their
DSpark names `markov_head.markov_w1.weight` `[verifier vocabulary, rank]`, `markov_head.markov_w2.weight`
`[draft_vocab_size, rank]` and, gated, `markov_head.gate_proj.{weight,bias}`. llama.cpp's converter reads this
layout too (its `DSparkModel`, vanilla heads only).

Not representable: targets that scale their input embedding (Gemma multiplies by sqrt(hidden)) or softcap their
logits, because speculators embeds the block with a plain embedding and projects with a plain head; exporting such a
drafter in this format raises a `ValueError` (use the official or dflash-hf layout).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel

from ..modeling import DFlashConfig, DFlashDraftModel
from ..modeling.configuration_dflash import markov_fields, markov_head_type
from .official import DRAFT_LAYER_KEYS

# The speculators release whose DFlash format this module writes and `examples/interop/` checks.
SPECULATORS_VERSION = "0.9.0"
# `speculators_model_type` of a drafter without and with a Markov head.
SPECULATORS_MODEL_TYPES = ("dflash", "dspark")
# the `architectures` of each `speculators_model_type`
SPECULATORS_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}


def check_speculators_target(config: DFlashConfig, target: PreTrainedModel) -> None:
    """Raise a `ValueError` when speculators' DFlash model cannot reproduce this drafter on `target`."""
    if config.is_dflash2:
        raise ValueError(
            "The speculators format has no DFlash 2 (convolutions and a candidate selector): export in the official "
            "layout, which vLLM and SGLang read, or as GGUF for llama.cpp."
        )
    restricted = config.restricts_attention or any(kind != "full_attention" for kind in config.layer_types)
    scaled = config.input_embedding_scale not in (None, 1.0) or float(config.output_multiplier) != 1.0
    if restricted or scaled or config.final_logit_softcapping:
        raise ValueError(
            "The speculators format has no sliding-window or block-causal draft layers, nor a drafter's own embedding "
            "scale, logit multiplier or softcap, which this drafter uses: export in the official layout instead."
        )
    text_config = target.config.get_text_config(decoder=True)
    scale = getattr(target.get_input_embeddings(), "embed_scale", None)
    if scale is not None and float(torch.as_tensor(scale).float().item()) != 1.0:
        raise ValueError(
            f"The speculators format cannot express this target's scaled input embedding ({type(target).__name__} "
            "multiplies it by sqrt(hidden_size); speculators embeds the draft block without the scale). Export in the "
            "official or dflash-hf layout instead."
        )
    if getattr(text_config, "final_logit_softcapping", None) is not None:
        raise ValueError(
            "The speculators format has no final-logit softcapping, which this target applies; export in the official "
            "or dflash-hf layout instead."
        )
    num_layers = int(text_config.num_hidden_layers)
    if num_layers - 1 in config.target_layer_ids:
        raise ValueError(
            f"This drafter taps the target's last layer ({num_layers - 1}); speculators/vLLM capture a layer's input, "
            "so the last layer's output has no id there. Train with taps below the last layer to serve it with vLLM."
        )


def to_speculators_config(config: DFlashConfig, target: PreTrainedModel, base_model: str) -> dict[str, Any]:
    """The speculators `config.json` of a drafter configured by `config`, served with `base_model` (a Hub id)."""
    text_config = target.config.get_text_config(decoder=True)
    vocab_size = int(text_config.vocab_size)
    rope = dict(config.rope_parameters or {})
    layers = {key: getattr(config, key) for key in DRAFT_LAYER_KEYS}
    transformer_layer_config = {
        "model_type": "qwen3",
        **layers,
        "vocab_size": vocab_size,
        "rope_parameters": rope,
        "layer_types": ["full_attention"] * int(config.num_hidden_layers),
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }
    block_size = int(config.block_size)
    algorithm = SPECULATORS_MODEL_TYPES[bool(config.markov_rank)]
    markov = {}
    if config.markov_rank:
        markov = {
            "markov_rank": int(config.markov_rank),
            "markov_head_type": markov_head_type(config),
            "enable_confidence_head": False,
            "confidence_head_with_markov": False,
        }
    return {
        "architectures": [SPECULATORS_ARCHITECTURES[algorithm]],
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": transformer_layer_config,
        "draft_vocab_size": int(config.draft_vocab_size or vocab_size),
        "block_size": block_size,
        "mask_token_id": int(config.mask_token_id),
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in config.target_layer_ids],
        "target_hidden_size": None,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "tie_word_embeddings": False,
        **markov,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block_size - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": base_model, "architectures": list(target.config.architectures or [])},
        },
        "dtype": config.to_dict().get("dtype"),
        "transformers_version": transformers.__version__,
    }


def speculators_state_dict(drafter: DFlashDraftModel, target: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors of the speculators checkpoint: the draft body, plus `lm_head.weight` (the target's head rows in the
    target's dtype), `d2t` and `t2d` for a reduced draft vocabulary (draft ids in ascending target-id order)."""
    body = {name: tensor for name, tensor in drafter.state_dict().items() if name != "d2t"}
    ids = drafter.draft_token_ids
    if ids is None:
        return body
    ids = torch.sort(ids.cpu()).values
    head: nn.Module = target.get_output_embeddings()
    vocab_size = int(head.weight.shape[0])
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {
        **body,
        # exactly the target's rows, in its dtype: rounding them to the drafter's dtype would change the drafts
        "lm_head.weight": head.weight.detach()[ids.to(head.weight.device)].cpu().contiguous(),
        "d2t": ids - torch.arange(ids.numel()),
        "t2d": t2d,
    }


def is_speculators_config_dict(config_dict: dict) -> bool:
    """Whether `config_dict` is a speculators DFlash config (or DSpark: DFlash with a Markov head)."""
    return config_dict.get("speculators_model_type") in SPECULATORS_MODEL_TYPES


def config_from_speculators(config_dict: dict) -> DFlashConfig:
    """The [`DFlashConfig`] of the draft body described by a speculators DFlash `config_dict`."""
    layers = config_dict.get("transformer_layer_config") or {}
    missing = [key for key in ("block_size", "mask_token_id", "aux_hidden_state_layer_ids") if key not in config_dict]
    missing += [f"transformer_layer_config.{key}" for key in (*DRAFT_LAYER_KEYS, "vocab_size") if key not in layers]
    if missing:
        raise ValueError(f"The speculators DFlash config lacks {', '.join(missing)}; re-export the drafter.")
    if config_dict.get("sample_from_anchor") or config_dict.get("enable_confidence_head"):
        raise ValueError(
            "This speculators config samples from the anchor (`sample_from_anchor`, DeepSpec's convention) or carries a "
            "confidence head (`enable_confidence_head`); a DFlash drafter's slot k predicts the token at anchor + k and "
            "has no confidence head."
        )
    markov = {}
    if config_dict.get("speculators_model_type") == "dspark" and config_dict.get("markov_rank"):
        markov = markov_fields(int(config_dict["markov_rank"]), config_dict.get("markov_head_type", "vanilla"))
    vocab_size = int(layers["vocab_size"])
    draft_vocab_size = int(config_dict.get("draft_vocab_size") or vocab_size)
    return DFlashConfig(
        **{key: layers[key] for key in DRAFT_LAYER_KEYS},
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size if draft_vocab_size != vocab_size else None,
        rope_parameters=layers.get("rope_parameters"),
        block_size=int(config_dict["block_size"]),
        mask_token_id=int(config_dict["mask_token_id"]),
        target_layer_ids=[int(i) - 1 for i in config_dict["aux_hidden_state_layer_ids"]],
        **markov,
    )


def check_speculators_folder(folder: str | os.PathLike) -> None:
    """Raise a `ValueError` unless `folder` is a complete speculators DFlash checkpoint: its tensors are exactly the
    draft body of its config (names and shapes), plus a consistent `lm_head.weight` / `d2t` / `t2d` for a reduced
    draft vocabulary."""
    folder = Path(folder)
    config_dict = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = config_from_speculators(config_dict)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in DFlashDraftModel(config).state_dict().items() if name != "d2t"}
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{folder} has no model.safetensors; re-export the drafter with `dflash-hf export`.")
    with safe_open(weights, framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        mapping = {name: handle.get_tensor(name) for name in ("d2t", "t2d") if name in shapes}
    if config.draft_vocab_size is not None:
        draft, vocab = int(config.draft_vocab_size), int(config.vocab_size)
        expected.update({"lm_head.weight": (draft, int(config.hidden_size)), "d2t": (draft,), "t2d": (vocab,)})
    problems = [f"missing {name}" for name in sorted(set(expected) - set(shapes))]
    problems += [f"unexpected {name}" for name in sorted(set(shapes) - set(expected))]
    problems += [
        f"{name} has shape {shapes[name]}, the config implies {shape}"
        for name, shape in sorted(expected.items())
        if name in shapes and shapes[name] != shape
    ]
    if not problems and config.draft_vocab_size is not None:
        ids = mapping["d2t"].long() + torch.arange(mapping["d2t"].numel())
        if not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= int(config.vocab_size):
            problems.append("d2t does not map draft ids to ascending target ids inside the vocabulary")
        elif not torch.equal(mapping["t2d"].bool().nonzero().flatten(), ids):
            problems.append("t2d does not mark exactly the target ids of d2t")
    if problems:
        raise ValueError(
            f"The weights in {weights} do not match its speculators DFlash config: {'; '.join(problems)}. Re-export "
            "the drafter with `dflash-hf export --format speculators`."
        )


__all__ = [
    "SPECULATORS_ARCHITECTURES",
    "SPECULATORS_MODEL_TYPES",
    "SPECULATORS_VERSION",
    "check_speculators_folder",
    "check_speculators_target",
    "config_from_speculators",
    "is_speculators_config_dict",
    "speculators_state_dict",
    "to_speculators_config",
]
