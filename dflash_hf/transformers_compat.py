"""What the package does differently across the Transformers versions it supports (5.23 and 5.24), in one place.

Moving the supported range means reading this module (and the remote code's own block, "Transformers versions" in
`modeling/modeling_dflash.py`, which ships alone in every checkpoint and so imports nothing from here): each helper
says which versions need it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria


def cache_keyword(forward: Callable) -> str:
    """The keyword `forward` (a model's forward method) takes its cache by: `cache` from Transformers 5.24 on,
    `past_key_values` in 5.23 (and in remote-code models written for it)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_of_call(kwargs: dict[str, Any]) -> Any:
    """The cache among a model call's keyword arguments (a forward pre-hook's `kwargs`): Transformers 5.24 passes it
    down as `cache`, 5.23 as `past_key_values`; `None` when the call has none."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def streamer_of_calling_generate() -> Any:
    """The `streamer` given to the `model.generate` call that invoked the `custom_generate` callable calling this.

    Transformers 5.23 and 5.24 hand a callable `custom_generate` only the keyword arguments its own signature adds, so
    a `streamer=` passed to `generate` reaches the prompt (`generate` streams it itself) but not the callable. It is
    read from the calling `generate` frame, two frames up: call this directly from the callable.
    """
    frame = inspect.currentframe()
    try:
        callable_frame = frame.f_back if frame is not None else None
        caller = callable_frame.f_back if callable_frame is not None else None
        if caller is None or caller.f_code.co_name != "generate":
            return None
        candidate = caller.f_locals.get("streamer")
        return candidate if hasattr(candidate, "put") and hasattr(candidate, "end") else None
    finally:
        del frame


def stop_strings_as_criteria(target: PreTrainedModel, kwargs: dict[str, Any]) -> None:
    """Turn `stop_strings` (with the `tokenizer` in `kwargs`, `model.generate`'s keyword arguments) into a
    `StopStringCriteria` in `kwargs`, the one `target.generate` builds.

    Transformers 5.23 and 5.24 hand a callable `custom_generate` no `tokenizer`, so `target.generate` called with one
    could not build the criterion itself and would refuse `stop_strings`.
    """
    tokenizer = kwargs.pop("tokenizer", None)
    if "stop_strings" in kwargs:
        stop_strings = kwargs["stop_strings"]
    else:  # a passed config's own, else the target's default (as `target.generate` merges them)
        passed = getattr(kwargs.get("generation_config"), "stop_strings", None)
        stop_strings = passed or getattr(target.generation_config, "stop_strings", None)
    if tokenizer is None or not stop_strings:
        return
    criteria = list(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = StoppingCriteriaList(criteria)
    kwargs["stop_strings"] = None  # overrides the configs' stop strings: the criterion above stands for them


__all__ = ["cache_keyword", "cache_of_call", "stop_strings_as_criteria", "streamer_of_calling_generate"]
