"""`compile=True`: the engine on static caches, its verify forwards compiled at a fixed set of widths.

With `compile=True` a call keeps the target's keys and values in a static cache (`cache_ops.static_cache`) sized
for the whole call, runs its prefill eagerly (prompts have any length) and every verify forward through the target
decoder's compiled call (Transformers' `get_compiled_call`, with the call's `CompileConfig`: inductor with CUDA graphs,
`mode="reduce-overhead"`, by default). Every verify has one of a few shapes: the block (each size an adaptive policy
may choose), or the call's widest tree (`CandidatePlan.verify_width`; narrower trees are padded to it), over masks
that cover the whole cache. The drafter runs eagerly on its dynamic cache.

Static caches are kept between calls ([`StaticCachePool`]): a call of the same batch size and a cache that fits takes
the one the last call left, so a compiled forward keeps its shapes and its CUDA graphs their buffers.
"""

from __future__ import annotations

import threading
import weakref

from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import CompileConfig

from .cache_ops import static_cache

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
    """The static caches calls on a target left behind, one per batch size, reused by the next call that fits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: weakref.WeakKeyDictionary[PreTrainedModel, dict[int, Cache]] = weakref.WeakKeyDictionary()

    def take(self, target: PreTrainedModel, num_layers: int, batch: int, needed: int) -> Cache:
        """A static cache for `batch` rows of at least `needed` positions: the free one of that batch size if it is
        long enough, else a new one."""
        with self._lock:
            cache = self._free.get(target, {}).pop(batch, None)
        if cache is None or cache.layers[0].max_cache_len < needed:
            cache = static_cache(num_layers, static_cache_length(needed))
        return cache

    def give_back(self, target: PreTrainedModel, batch: int, cache: Cache) -> None:
        """Keep `cache` for the next call of `batch` rows, if it still has them (finished rows shrink a cache)."""
        layer = cache.layers[0]
        if getattr(layer, "is_initialized", False) and layer.keys.shape[0] != batch:
            return
        with self._lock:
            self._free.setdefault(target, {})[batch] = cache


STATIC_CACHES = StaticCachePool()
