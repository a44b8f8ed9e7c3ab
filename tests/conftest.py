"""Fixtures shared by the tests: the environment every test runs in (autouse), the target family, one torch thread,
tiny training data. The builders they use are in `testing_utils.py`."""

from __future__ import annotations

import itertools
import os
import tempfile
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# commands store per-machine verdicts (`--dtype auto`'s precision.json, `--mkl-mode auto`'s) in the dflash-hf cache:
# a fresh one, whatever the environment names, so that no verdict of an earlier run decides a test and no stand-in
# verdict of a test reaches the user's cache
os.environ["DFLASH_HF_CACHE"] = tempfile.mkdtemp(prefix="dflash-hf-tests-")

import pytest
import torch
from testing_utils import FAMILIES, make_tiny_target, make_tokenizer, one_thread, run_make_data, write_prompts

from dflash_hf import runtime

torch.set_num_threads(1)  # tiny models: one thread is fastest and deterministic
# MKL fixes its float32 code path at the process's first matmul (from `MKL_CBWR`): take it here, from the environment
# the suite was started in, so a test that sets `MKL_CBWR` for its commands changes only their subprocesses
torch.ones(2, 2) @ torch.ones(2, 2)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Commands set torch's thread count (`--threads`, by default the CPUs this host has): give it back after each
    test, so that no later test runs on another host's count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _host_without_native_bf16(monkeypatch):
    """`--dtype auto`, the trainer's Muon precision and its bf16 warning follow `runtime.native_bf16_feature`: every
    test runs as on a CPU without native bfloat16 unless it stands in another kind of host itself (the tests of those
    choices do, for each kind), so that no outcome depends on this machine's bf16 units."""
    monkeypatch.setattr(runtime, "native_bf16_feature", lambda: None)


@pytest.fixture(autouse=True)
def _engine_cycle_clock(monkeypatch):
    """The engine's adaptive choices (the block size, the lookup branch) follow each cycle's wall time, which differs
    per host and per run: in tests every cycle takes one second, so that those choices follow acceptance alone, the
    same on every machine (the policies' use of costs has its own tests, with given costs)."""
    from dflash_hf.engine import generation_call

    ticks = itertools.count()
    monkeypatch.setattr(generation_call, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test module compiles from a clean dynamo: what earlier modules compiled (other tiny targets of the same
    classes, other thread counts) would otherwise make its compiles recompiles, with float attributes such as an
    attention's `scaling` turned into graph inputs read on the host, and change what its tests count."""
    torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def _restore_mkl_mode():
    """CLI commands choose MKL's code path through `MKL_CBWR` (`mkl_choice.select_mkl_mode`): keep a test's choice
    from reaching later tests' subprocesses."""
    before = os.environ.get("MKL_CBWR")
    yield
    if before is None:
        os.environ.pop("MKL_CBWR", None)
    else:
        os.environ["MKL_CBWR"] = before


@pytest.fixture(autouse=True)
def _measured_mkl_mode(monkeypatch):
    """`--mkl-mode auto` times MKL's code paths in worker processes once per machine (`dflash_hf.mkl_choice`): tests
    stand in a measurement where MKL's default path is fastest, so no command spends seconds timing; the real
    measurement has its own tests (tests/test_precision.py)."""
    from dflash_hf import mkl_choice

    def measure(modes, threads, *args, **kwargs):
        return {mode: {"1": 1.0, "4": 2.0, "8": 3.0} for mode in modes}

    monkeypatch.setattr(mkl_choice, "measure", measure)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def single_thread():
    """Torch on one thread for the test (`testing_utils.one_thread`)."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """`(target, tokenizer, data)`: a tiny LLaMA, its character-level tokenizer and the training rows `make_data` gives
    for `testing_utils.PROMPTS` (24 new tokens, nothing held out), built once per test module."""
    from dflash_hf.data.make import load_training_data

    with one_thread():
        target = make_tiny_target("llama")
        tokenizer = make_tokenizer()
        root = tmp_path_factory.mktemp("tiny-data")
        run_make_data(target, tokenizer, root / "data", write_prompts(root / "prompts.jsonl"), max_new_tokens=24)
        return target, tokenizer, load_training_data(root / "data")
