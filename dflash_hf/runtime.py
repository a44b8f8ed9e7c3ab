"""What the machine offers a run: the default device and dtype, CUDA-synchronised wall clocks, stopwatches that do not
wait for the device, available CPUs, and modules' compiled calls."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers.generation.configuration_utils import CompileConfig


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _cpuinfo_field(name: str) -> str | None:
    """The first `name : value` field of `/proc/cpuinfo`, or `None` where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows of it."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def default_device() -> str:
    """`cuda` when a GPU is available, else `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA, float32 elsewhere; else `float32`/`bfloat16`/`float16` (or a `torch.dtype`)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"Unknown dtype {name!r}: use auto, float32, bfloat16 or float16.")
    return table[name]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA only; a no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most memory allocated on `device` since the process started (CUDA only; `None` elsewhere)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def clock(device: torch.device) -> float:
    """`time.perf_counter()` once the work queued on `device` is done."""
    synchronize(device)
    return time.perf_counter()


class _WallMark:
    """A point in time taken by the host clock, with the interface of a CUDA timing event."""

    def __init__(self) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for: the host clock was read when the mark was taken."""

    def elapsed_time(self, end: _WallMark) -> float:
        """Milliseconds from this mark to `end`."""
        return 1000.0 * (end.time - self.time)


def _mark(device: torch.device) -> torch.cuda.Event | _WallMark:
    """A point in the work queued on `device`: a CUDA timing event recorded in the current stream, the host clock
    elsewhere (where the work is done when the call returns)."""
    if device.type != "cuda":
        return _WallMark()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class Stopwatch:
    """Accumulates the time of the code regions it wraps (`with watch: ...`) on `device` without waiting for it: on
    CUDA a region runs from an event recorded in the stream when it starts to one recorded when it ends (the device's
    time for the region's work), elsewhere on the wall clock. Reading `total` waits for the last region's work."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._total = 0.0
        self._regions: list[tuple] = []

    def __enter__(self) -> Stopwatch:
        self._start = _mark(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self._regions.append((self._start, _mark(self.device)))

    @property
    def total(self) -> float:
        """Seconds in the regions so far."""
        for start, end in self._regions:
            end.synchronize()
            self._total += start.elapsed_time(end) / 1000.0
        self._regions.clear()
        return self._total


def native_bf16_feature() -> str | None:
    """The CPU feature that makes bfloat16 matmuls native on this machine (`AMX-BF16`, `AVX512-BF16`), or `None`."""
    cpu = getattr(torch, "cpu", None)
    if cpu is None:
        return None
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX-BF16"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return None


def inference_dtype(name: str | torch.dtype, device: str | torch.device) -> tuple[torch.dtype, str]:
    """The dtype to generate in and why, where no measurement is needed: `auto` is bfloat16 on CUDA and float32 on
    a CPU without native bf16 (on a CPU with it, `dflash_hf.precision` measures which is faster; this returns
    bfloat16 there); any other name is taken as asked."""
    if name != "auto":
        dtype = resolve_dtype(name, device)
        return dtype, "as requested"
    if str(device).startswith("cuda"):
        return torch.bfloat16, "auto: CUDA"
    feature = native_bf16_feature()
    if feature is not None:
        return torch.bfloat16, f"auto: this CPU computes bfloat16 natively ({feature})"
    return torch.float32, "auto: this CPU has no native bfloat16 (no AMX-BF16 / AVX512-BF16)"


def mkl_mode() -> str:
    """How MKL runs this process's float32 matmuls, as recorded with measurements."""
    if not torch.backends.mkl.is_available():
        return "no MKL"
    value = os.environ.get("MKL_CBWR")
    return "MKL default code path" if value is None else f"MKL_CBWR={value}"


# graphs one compiled call may hold: every width, batch size and mask kind compiles once, and Transformers' models
# share the wrapper functions dynamo counts them on (its default limit, 8, would send later shapes to eager)
COMPILED_SHAPES = 64
# where a module keeps its compiled call: its last `CompileConfig` and the call compiled with it (on the module, as
# Transformers keeps `_compiled_call`: the call holds the module, so a table keyed by modules would keep them alive)
_COMPILED_ATTRIBUTE = "_dflash_compiled_call"
_COMPILED_LOCK = threading.Lock()


def compiled_call(module: torch.nn.Module, compile_config: CompileConfig) -> Callable:
    """`module.__call__` compiled with `compile_config` (compiled once, kept while the config stays the same, as
    Transformers' `get_compiled_call` keeps a generating model's), run alone ([`forwards_alone`]). Dynamo's recompile
    limit is raised to [`COMPILED_SHAPES`] for the process, never lowered: a limit set around each call would be put
    back by one thread while another compiles, and a frame over the limit runs eagerly from then on."""
    with _COMPILED_LOCK:
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, COMPILED_SHAPES)
        held = getattr(module, _COMPILED_ATTRIBUTE, None)
        if held is None or held[0] != compile_config:
            compiled = torch.compile(module.__call__, **compile_config.to_dict())

            def alone(*args, **kwargs):
                with _FORWARDS.exclusive(), _stock_attention(module):
                    return compiled(*args, **kwargs)

            held = (compile_config, alone)
            setattr(module, _COMPILED_ATTRIBUTE, held)
    return held[1]


# the engine's own `sdpa` variants (`target.attention_registry`): a model an eager call of another thread switched to
# one is traced on `sdpa` itself, whose graph holds no context variable
SDPA_VARIANTS: set[str] = set()


@contextlib.contextmanager
def _stock_attention(module: torch.nn.Module) -> Iterator[None]:
    """`module` on `sdpa` within this block where it runs one of [`SDPA_VARIANTS`] (no other forward runs meanwhile:
    [`_ForwardsGuard.exclusive`])."""
    config = getattr(module, "config", None)
    current = getattr(config, "_attn_implementation", None)
    switch = current in SDPA_VARIANTS and hasattr(module, "set_attn_implementation")
    if switch:
        module.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if switch:
            module.set_attn_implementation(current)


class _ForwardsGuard:
    """Compiled forwards one at a time, and never beside an eager one; eager forwards beside each other freely.

    Transformers' collector of a forward's hidden states (`output_capturing`) is a context variable, except while a
    compiled forward runs: dynamo cannot trace one, so it is then one global for the whole process, and a forward in
    another thread would read or clear another call's collector."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._eager = 0
        self._compiled = False

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._compiled and self._eager == 0)
            self._compiled = True
        try:
            yield
        finally:
            with self._condition:
                self._compiled = False
                self._condition.notify_all()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._compiled)
            self._eager += 1
        try:
            yield
        finally:
            with self._condition:
                self._eager -= 1
                self._condition.notify_all()


_FORWARDS = _ForwardsGuard()


def forwards_alone() -> contextlib.AbstractContextManager[None]:
    """Within this block an eager forward of the engine never runs beside a compiled one ([`compiled_call`]), in any
    thread (eager ones run beside each other)."""
    return _FORWARDS.shared()


# A plain copy from the host to a GPU (`torch.tensor(values, device="cuda")`) waits until the device has finished all
# the work queued before it, like a read does; `upload` copies through page-locked memory without blocking, so the host
# goes on queueing work while the copy waits its turn in the stream.
def upload(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (nested lists of numbers) as a tensor on `device`, copied without waiting for the device's queue."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
