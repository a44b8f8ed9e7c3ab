"""`--mkl-mode`: which MKL code path runs decoding's float32 matmuls ([`select_mkl_mode`]), measured once per machine
for `auto`.

MKL picks its float32 kernels by CPU, and on some CPUs its default code path makes a matmul of a few rows (a block
verify, a draft) cost far more than a 1-row one, while one of its conditional-numerical-reproducibility modes
(`MKL_CBWR`) does not. Which mode pays is a property of the CPU and the MKL build, not of the vendor alone, so the
first `auto` run on a machine times the candidates and keeps the fastest. MKL reads `MKL_CBWR` once, at its first
matmul, so each candidate runs in a worker process of its own; the workers time their matmuls in interleaved rounds
(one round of every worker in turn, then the next round), so a shared machine's drift touches every candidate alike,
and the medians decide. The verdict, with the measured times, is stored in `<dflash-hf cache>/mkl.json` under the CPU
model, torch version, thread count and shapes; later runs only read it.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from . import runtime
from .fileio import atomic_write_text, cache_dir

MKL_MODES = ("auto", "cnr", "default")  # the choices of `--mkl-mode`
VERDICTS_FILE = "mkl.json"
DEFAULT = "default"  # MKL's own code path (no `MKL_CBWR`)
# (in, out) features of the linears a decode step and a block verify run: the bundled SmolLM2 pair's attention and
# MLP projections and its 8,192-row draft head
SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 8192))
ROWS = (1, 4, 8)  # a plain step, a B=4 verify, a B=8 verify

# A worker: times `x @ w.T` for every shape and row count, one round per line read from stdin, one JSON line out.
_WORKER = """
import json, sys, time, torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
weights = [torch.randn(out_f, in_f) for in_f, out_f in spec["shapes"]]
inputs = {rows: [torch.randn(rows, w.shape[1]) for w in weights] for rows in spec["rows"]}
print("ready", flush=True)
for _ in sys.stdin:
    result = {}
    for rows in spec["rows"]:
        for w, x in zip(weights, inputs[rows]):
            torch.nn.functional.linear(x, w)
        start = time.perf_counter()
        for _ in range(spec["repeats"]):
            for w, x in zip(weights, inputs[rows]):
                torch.nn.functional.linear(x, w)
        result[str(rows)] = (time.perf_counter() - start) * 1000 / spec["repeats"]
    print(json.dumps(result), flush=True)
"""


def candidates() -> tuple[str, ...]:
    """The code paths worth timing on this CPU: MKL's default, `AUTO`, and the instruction sets the CPU has."""
    flags = set((runtime._cpuinfo_field("flags") or "").split())
    modes = [DEFAULT, "AUTO"]
    if "avx2" in flags:
        modes.append("AVX2")
    if "avx512f" in flags:
        modes.append("AVX512")
    return tuple(modes)


def _worker_env(mode: str, threads: int) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "MKL_CBWR"}
    if mode != DEFAULT:
        env["MKL_CBWR"] = mode
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def measure(
    modes: tuple[str, ...],
    threads: int,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    rows: tuple[int, ...] = ROWS,
    rounds: int = 7,
    repeats: int = 10,
) -> dict[str, dict[str, float]]:
    """Median ms per row count (all `shapes` together) for each MKL mode, timed in interleaved rounds of one worker
    process per mode."""
    spec = json.dumps({"threads": threads, "shapes": shapes, "rows": rows, "repeats": repeats})
    workers = {
        mode: subprocess.Popen(
            [sys.executable, "-c", _WORKER, spec],
            env=_worker_env(mode, threads),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for mode in modes
    }
    try:
        for mode, worker in workers.items():
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the MKL timing worker for {mode} did not start")
        samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        for _ in range(rounds):
            for mode, worker in workers.items():
                worker.stdin.write("round\n")
                worker.stdin.flush()
                samples[mode].append(json.loads(worker.stdout.readline()))
    finally:
        for worker in workers.values():
            worker.kill()
            worker.wait()
    return {
        mode: {str(r): round(statistics.median(s[str(r)] for s in rounds_), 3) for r in rows}
        for mode, rounds_ in samples.items()
    }


def fastest(timings: dict[str, dict[str, float]]) -> str:
    """The mode with the lowest total over the row counts (a plain step and the verifies it competes with); MKL's
    default wins ties."""
    return min(timings, key=lambda mode: (sum(timings[mode].values()), mode != DEFAULT))


def verdict_key(threads: int) -> str:
    """What a stored verdict depends on: CPU model, torch version, threads and the timed shapes."""
    shapes = ",".join(f"{i}x{o}" for i, o in SHAPES)
    return f"{runtime.cpu_model()} | torch {torch.__version__} | {threads} threads | {shapes}"


def measured_mode(threads: int, cache: Path) -> tuple[str, dict]:
    """The fastest MKL mode on this machine (`default` or an `MKL_CBWR` value) and its verdict record, measured on
    the first call for this machine and read from `cache / mkl.json` afterwards."""
    path = cache / VERDICTS_FILE
    try:
        verdicts = json.loads(path.read_text())
    except (OSError, ValueError):
        verdicts = {}
    if not isinstance(verdicts, dict):
        verdicts = {}
    key = verdict_key(threads)
    verdict = verdicts.get(key)
    if not isinstance(verdict, dict) or verdict.get("mode") not in candidates():
        timings = measure(candidates(), threads)
        verdict = {
            "mode": fastest(timings),
            "ms_by_rows": timings,
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        verdicts[key] = verdict
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(verdicts, indent=1) + "\n")
    return verdict["mode"], verdict


def describe(verdict: dict) -> str:
    """One line: which mode was measured fastest, with every candidate's total over the timed row counts."""
    totals = ", ".join(
        f"{mode} {sum(ms.values()):.1f} ms"
        for mode, ms in sorted(verdict["ms_by_rows"].items(), key=lambda kv: sum(kv[1].values()))
    )
    rows = "/".join(next(iter(verdict["ms_by_rows"].values())))
    return f"auto: fastest of MKL's code paths measured on this machine ({rows}-row matmuls: {totals})"


_reason: str | None = None  # why `select_mkl_mode` left MKL as `runtime.mkl_mode` reports it


def reason() -> str | None:
    """Why [`select_mkl_mode`] chose the code path `runtime.mkl_mode` reports (`None` before it ran in this process)."""
    return _reason


def select_mkl_mode(choice: str = "auto", threads: int | None = None) -> str:
    """Choose MKL's code path for the few-row float32 matmuls of decoding; returns what `runtime.mkl_mode` then reports
    and why.

    `auto` takes the code path measured fastest on this machine for decoding's matmuls (MKL's default and its
    `MKL_CBWR` modes, timed once per machine with `threads` threads, the verdict kept in the dflash-hf cache); `cnr`
    sets `MKL_CBWR=AUTO`; `default` leaves MKL alone. A `MKL_CBWR` already in the environment is kept. MKL reads it
    once, at its first matmul, so this only takes effect when called before any (the CLI calls it first; scripts:
    first thing, or set `MKL_CBWR` in the environment).
    """
    global _reason
    if choice not in MKL_MODES:
        raise ValueError(f"Unknown MKL mode {choice!r}: use {', '.join(MKL_MODES)}.")
    if not torch.backends.mkl.is_available():
        why = "this torch build has no MKL"
    elif "MKL_CBWR" in os.environ:
        why = "set in the environment"
    elif choice == "auto":
        mode, verdict = measured_mode(threads or torch.get_num_threads(), cache_dir())
        if mode != DEFAULT:
            os.environ["MKL_CBWR"] = mode
        why = describe(verdict)
    else:
        if choice == "cnr":
            os.environ["MKL_CBWR"] = "AUTO"
        why = f"--mkl-mode {choice}"
    _reason = why
    return f"{runtime.mkl_mode()} ({why})"
