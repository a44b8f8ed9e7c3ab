"""Sliding-window attention of a target: the window its sliding layers attend over."""

from __future__ import annotations

from transformers import PreTrainedConfig


def sliding_window_of(config: PreTrainedConfig) -> int | None:
    """The attention window of a target with sliding-window layers (e.g. Gemma 3), else `None`: its sliding layers
    need their own tree mask, and their decode steps see only the window's keys."""
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    if any("sliding" in str(kind) for kind in layer_types):
        return getattr(text, "sliding_window", None)
    return None
