"""The target model itself: which targets are supported ([`support`]), the adapter that runs one for DFlash
([`adapter`]), the attention variants it runs in ([`grouped_attention`], [`row_exact`], registered through
[`attention_registry`]) and its sliding window ([`windows`]). The ground floor of the library: nothing here imports
the engine, the Hub code, the benchmarks, the data tools or the commands."""

from .adapter import TargetAdapter, TargetStep, engine_kernels, head_projection, uses_engine_kernels
from .support import SUPPORTED_TARGET_TYPES, TARGET_FAMILIES, check_built_for, check_supported, check_target_config
from .windows import sliding_window_of

__all__ = [
    "SUPPORTED_TARGET_TYPES",
    "TARGET_FAMILIES",
    "TargetAdapter",
    "TargetStep",
    "check_built_for",
    "check_supported",
    "check_target_config",
    "engine_kernels",
    "head_projection",
    "sliding_window_of",
    "uses_engine_kernels",
]
