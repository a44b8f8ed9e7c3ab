"""runtime.Stopwatch: the time of the regions it wraps, summed, read once they are done; runtime.compiled_call: one
compiled call per module and config, and dynamo's recompile limit raised for the process, never lowered."""

from __future__ import annotations

import subprocess
import sys
import time

import torch
from transformers import CompileConfig

from dflash_hf.runtime import COMPILED_SHAPES, Stopwatch, compiled_call


def test_stopwatch_sums_its_regions_and_reads_them_once():
    watch = Stopwatch(torch.device("cpu"))
    for _ in range(2):
        with watch:
            time.sleep(0.01)
    time.sleep(0.2)  # outside every region
    total = watch.total
    assert 0.02 <= total < 0.15
    assert watch.total == total  # read again: the same regions, counted once
    with watch:
        pass
    assert watch.total >= total


class _Affine(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def test_a_compiled_call_is_kept_per_module_and_config_and_the_recompile_limit_only_rises():
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's own patch: its config is no plain module
        module = _Affine()
        call = compiled_call(module, config)
        assert torch._dynamo.config.recompile_limit == COMPILED_SHAPES  # for the process: no per-call patch to undo
        assert compiled_call(module, CompileConfig(backend="eager", mode=None, fullgraph=True)) is call  # equal config
        assert compiled_call(module, CompileConfig(backend="eager", mode=None, fullgraph=False)) is not call
        inputs = torch.ones(4, 3)
        assert torch.equal(call(inputs), module(inputs))
    with torch._dynamo.config.patch(recompile_limit=4 * COMPILED_SHAPES):  # a caller's higher limit stays
        compiled_call(_Affine(), config)
        assert torch._dynamo.config.recompile_limit == 4 * COMPILED_SHAPES


def test_a_compiled_module_is_freed_with_its_last_reference():
    """In a fresh interpreter: what other compiles in this process left in dynamo's own caches is not the call's."""
    script = """
import gc, weakref, torch
from transformers import CompileConfig
from dflash_hf.runtime import compiled_call

class Affine(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1

module = Affine()
compiled_call(module, CompileConfig(backend="eager", mode=None, fullgraph=True))(torch.ones(2))
gone = weakref.ref(module)
del module
gc.collect()
print("freed" if gone() is None else "alive")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "freed"
