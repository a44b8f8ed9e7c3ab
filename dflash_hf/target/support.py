"""Which targets DFlash supports, and the checks that a target (or its folder) is one a drafter can run with."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import PreTrainedConfig, PreTrainedModel

from ..fileio import read_json

# The one table of supported targets: `model_type` -> (display name, model-card family). The family names the
# `hub_cards/family_<family>.md` part of exported cards and is a Hub tag; `None`: no family notes, the tag is the
# model type.
_TARGET_TYPES: dict[str, tuple[str, str | None]] = {
    "qwen3": ("Qwen3", "qwen"),
    "qwen2": ("Qwen2", "qwen"),
    "llama": ("LLaMA (incl. SmolLM2)", "llama"),
    "mistral": ("Mistral", None),
    "gemma3_text": ("Gemma 3 (text)", "gemma"),
    "qwen3_moe": ("Qwen3-MoE (Qwen3-Coder-30B-A3B)", "qwen"),
    "gpt_oss": ("GPT-OSS", None),
    "minimax_m2": ("MiniMax-M2", None),
    "qwen3_5_text": ("Qwen3.5 / Qwen3.6 (hybrid)", "qwen"),
    "qwen3_5_moe_text": ("Qwen3.5-MoE / Qwen3.6-MoE (hybrid)", "qwen"),
    "qwen3_next": ("Qwen3-Next (hybrid, Qwen3-Coder-Next)", "qwen"),
    "gemma4_text": ("Gemma 4", "gemma"),
    "deepseek_v3": ("DeepSeek-V3 / Kimi K2 (MLA)", None),
    "muse_glimmer_text": ("Muse-Glimmer", None),
}
SUPPORTED_TARGET_TYPES: dict[str, str] = {model_type: name for model_type, (name, _) in _TARGET_TYPES.items()}
TARGET_FAMILIES: dict[str, str] = {model_type: family for model_type, (_, family) in _TARGET_TYPES.items() if family}


def _supported_list() -> str:
    """The supported target types, for error messages."""
    return ", ".join(f"{name} (`{key}`)" for key, name in SUPPORTED_TARGET_TYPES.items())


def text_config(target: PreTrainedModel) -> PreTrainedConfig:
    """The config of `target`'s text decoder: its own, or the text part of a multimodal wrapper's
    (`Qwen3_5ForConditionalGeneration`, `Gemma4ForConditionalGeneration`), whose decoder is what DFlash runs."""
    return target.config.get_text_config(decoder=True)


def check_supported(target: PreTrainedModel) -> None:
    """Raise a `ValueError` listing the supported targets when `target`'s text decoder is not one of them."""
    model_type = getattr(text_config(target), "model_type", None)
    if model_type not in SUPPORTED_TARGET_TYPES:
        raise ValueError(
            f"Unsupported target architecture `{model_type}` ({type(target).__name__}). "
            f"Supported targets: {_supported_list()}."
        )


def check_built_for(drafter_config: PreTrainedConfig, target: PreTrainedModel) -> None:
    """Raise a `ValueError` naming both sides when the drafter records another target (layer count or model type)."""
    config = text_config(target)
    layers, model_type = int(config.num_hidden_layers), getattr(config, "model_type", None)
    built_layers = getattr(drafter_config, "num_target_layers", None)
    built_type = getattr(drafter_config, "target_model_type", None)
    if (built_layers is None or int(built_layers) == layers) and built_type in (None, model_type):
        return
    drafter_name = getattr(drafter_config, "name_or_path", "") or ""
    target_name = getattr(target.config, "name_or_path", "") or ""
    built = " ".join(filter(None, (f"{built_layers}-layer" if built_layers else "", built_type and f"`{built_type}`")))
    raise ValueError(
        f"This drafter{f' ({drafter_name})' if drafter_name else ''} was built for another target: a {built} "
        f"target, but this target{f' ({target_name})' if target_name else ''} is a {layers}-layer `{model_type}`. "
        "Use the drafter trained for this target, or this drafter's own target."
    )


def input_embedding_scale(target: PreTrainedModel) -> float | None:
    """The factor by which `target`'s input embedding module multiplies rows of its table (Gemma's scaled embedding:
    `sqrt(hidden_size)`), `None` for a plain table. A target built on the meta device (shapes only) holds no value:
    the scaled embeddings of Transformers all scale by `sqrt(hidden_size)`."""
    scale = getattr(target.get_input_embeddings(), "embed_scale", None)
    if scale is None:
        return None
    if getattr(scale, "is_meta", False):
        return float(text_config(target).hidden_size) ** 0.5
    return float(scale)


def check_target_config(folder: str | os.PathLike) -> None:
    """Raise a `ValueError` naming the file when a local target folder's `config.json` is no readable JSON (one
    nested too deeply would be a `RecursionError` inside Transformers' reader)."""
    path = Path(folder) / "config.json"
    if path.is_file():
        read_json(path, "restore the target folder's config.json from its source.")
