"""The engine's attention functions: variants of `sdpa` registered with Transformers under their own names.

A model runs one after `model.set_attn_implementation(name)`. Each has a flag that a `with variant.flagged():` block
sets in its own thread or task only (a context variable), read by the function at every call: what the flag changes
is the variant's own business (`target.grouped_attention`, `target.row_exact`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..runtime import SDPA_VARIANTS


class SdpaVariant:
    """An attention function with `sdpa`'s signature, registered under `name` with Transformers'
    `AttentionInterface` (and `sdpa`'s masks with `AttentionMaskInterface`), and its flag."""

    def __init__(self, name: str, attention: Callable) -> None:
        if "flash" in name:
            raise ValueError(
                f"Attention name {name!r}: Transformers takes any name with 'flash' in it for a flash kernel; pick "
                "another name."
            )
        self.name = name
        SDPA_VARIANTS.add(name)
        self._flag = contextvars.ContextVar(f"{name}_flag", default=False)
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, sdpa_mask)

    def is_flagged(self) -> bool:
        """The value of the innermost [`flagged`] block open in this thread or task (`False` outside any)."""
        return self._flag.get()

    @contextlib.contextmanager
    def flagged(self, value: bool = True) -> Iterator[None]:
        """Within this block (in this thread or task) [`is_flagged`] returns `value`."""
        token = self._flag.set(value)
        try:
            yield
        finally:
            self._flag.reset(token)
