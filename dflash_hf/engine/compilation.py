"""`compile=True`: the engine on static caches, its target and drafter forwards compiled at a fixed set of shapes.

With `compile=True` a call keeps the target's keys and values in a static cache (`cache_ops.static_cache`) sized for
the whole call, runs its prefill eagerly (prompts have any length) and every verify forward through the target
decoder's compiled call (`runtime.compiled_call`, with the call's `CompileConfig`: Transformers' default, inductor with
CUDA graphs, `mode="reduce-overhead"`). Every verify has one of a few shapes: the block (each size an adaptive policy
may choose), or the call's widest tree (`CandidatePlan.verify_width`; narrower trees are padded to it), over masks
that cover the whole cache. The drafter's keys and values live in a static cache too, and its forward runs compiled
with the pending context padded to a fixed width (`candidates.DFlashChain`).

Static caches are kept between calls ([`StaticCachePool`]): a call of the same batch size and a cache that fits takes
the one the last call on that model left, so a compiled forward keeps its shapes and its CUDA graphs their buffers.
"""

from __future__ import annotations

import threading
import weakref

from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import CompileConfig

from .cache_ops import attention_layer, empty, static_cache

STATIC_CACHE_MIN_LENGTH = 2048  # calls of usual lengths share one cache length (one compiled shape)


def static_cache_length(needed: int) -> int:
    """The length of a static cache for `needed` positions: a power of two of at least [`STATIC_CACHE_MIN_LENGTH`],
    so calls of usual lengths share one cache (one compiled shape)."""
    return max(STATIC_CACHE_MIN_LENGTH, 1 << (needed - 1).bit_length())


def compile_config_of(value: bool | CompileConfig | None) -> CompileConfig | None:
    """The `CompileConfig` of a `compile` argument: `True` gives Transformers' default one, `False`/`None` none."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileConfig()
    if isinstance(value, CompileConfig):
        return value
    raise ValueError(
        f"compile must be True, False or a transformers CompileConfig, got {value!r} "
        "(e.g. compile=CompileConfig(mode='max-autotune'))."
    )


class StaticCachePool:
    """The static caches calls on a model (a target or a drafter) left behind, one per batch size, reused by the next
    call that fits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: weakref.WeakKeyDictionary[PreTrainedModel, dict[int, Cache]] = weakref.WeakKeyDictionary()

    def take(
        self,
        model: PreTrainedModel,
        num_layers: int,
        batch: int,
        needed: int,
        linear_layers: frozenset[int] = frozenset(),
    ) -> Cache:
        """An empty static cache for `batch` rows of at least `needed` positions (linear-attention states at a hybrid
        target's `linear_layers`): the free one of that batch size if it is long enough and still of the model's dtype
        and device, else a new one."""
        with self._lock:
            cache = self._free.get(model, {}).pop(batch, None)
        layer = None if cache is None else attention_layer(cache)
        if (
            layer is None
            or layer.max_cache_len < needed
            or (layer.keys.dtype, layer.keys.device)
            != (
                model.dtype,
                model.device,
            )
        ):
            return static_cache(num_layers, static_cache_length(needed), linear_layers)
        empty(cache)  # what it held is hidden: every forward writes before it attends; states start from zero
        return cache

    def give_back(self, model: PreTrainedModel, batch: int, cache: Cache) -> None:
        """Keep `cache` for the next call of `batch` rows, if it was allocated and still has them (rows that finish
        while others run leave through smaller buffers)."""
        layer = attention_layer(cache)
        if not getattr(layer, "is_initialized", False) or layer.keys.shape[0] != batch:
            return
        with self._lock:
            self._free.setdefault(model, {})[batch] = cache


STATIC_CACHES = StaticCachePool()
