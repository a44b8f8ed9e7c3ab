"""Precision choice and exact reduced-precision verification: row-exact attention and linears, the per-machine
`auto` dtype, the fallback when bf16 verification is not bit-exact, and the cost profile (never its timings)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from testing_utils import (
    FAMILIES,
    GEMMA_SLIDING_WINDOW,
    corrupt_slots,
    make_drafter,
    make_llama,
    make_oracle,
    make_target,
    save_tiny_target,
)

from dflash_hf import cli, costs, fileio, generate, mkl_choice, runtime
from dflash_hf import precision as precision_module
from dflash_hf.bench import profile as profile_module
from dflash_hf.bench.profile import measure_costs
from dflash_hf.commands import bench as bench_command
from dflash_hf.commands import generate as generate_command
from dflash_hf.commands import load_models
from dflash_hf.engine.draft_tree import DEFAULT_TREE_NODES
from dflash_hf.mkl_choice import measure as real_measure  # before the autouse stand-in replaces it
from dflash_hf.runtime import native_bf16_feature as real_native_bf16_feature  # the real one, too
from dflash_hf.target import row_exact

PROMPTS = [[1, 5, 9, 12, 5, 9, 3, 3], [1, 7, 7, 3, 30, 31, 7, 7, 40, 41, 42]]


def _bf16_target(family: str, seed: int = 0):
    return make_target(family, seed=seed).to(torch.bfloat16)


class _MultiRowQuirk(torch.nn.Linear):
    """A linear layer whose multi-row calls give other values than its one-row calls (as some CPU kernels' rounding
    does; here by so much that the tokens change, in every family)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + 2.0**-1 if x.shape[:-1].numel() > 1 else out


def _with_quirky_down_proj(target) -> None:
    for layer in target.get_decoder().layers:
        old = layer.mlp.down_proj
        quirky = _MultiRowQuirk(old.in_features, old.out_features, bias=False).to(old.weight.dtype)
        quirky.weight = old.weight
        layer.mlp.down_proj = quirky


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("block_size", [4, 8, "adaptive"])
def test_bf16_engine_equals_plain_bf16_greedy(family, block_size):
    """Greedy through the engine in bf16 (row-exact verification) equals stock bf16 `generate`, token for token."""
    reference_target = _bf16_target(family)
    target = _bf16_target(family)
    drafter = make_drafter(target, block_size=8).to(torch.bfloat16)
    for ids in PROMPTS:
        prompt = torch.tensor([ids])
        expected = reference_target.generate(prompt, max_new_tokens=40, do_sample=False)
        out = generate(target, drafter, prompt, max_new_tokens=40, do_sample=False, block_size=block_size)
        if not row_exact.install(target, 8):
            pytest.skip("this CPU's bf16 kernels cannot be made row-exact for this target (install says so)")
        assert torch.equal(out, expected)
    assert target.config._attn_implementation == "sdpa"  # the user's model is given back its attention


def test_after_an_eager_bf16_call_the_model_compiles_whole_and_a_compiled_bf16_call_warns():
    """Row-exact attention is the target's inside the engine's calls only: afterwards dynamo traces the model's own
    `sdpa` in one graph; a compiled call in bf16 on CPU (not row-exact) says that it may drift."""
    from torch._dynamo.testing import CompileCounter
    from transformers import CompileConfig

    class Counter(CompileCounter):
        def __deepcopy__(self, memo):
            return self

    target = _bf16_target("llama")
    drafter = make_drafter(target).to(torch.bfloat16)
    prompt = torch.tensor([PROMPTS[1]])
    generate(target, drafter, prompt, max_new_tokens=8, do_sample=False)
    assert target.config._attn_implementation == "sdpa"
    torch._dynamo.reset()
    try:
        compiled = torch.compile(target.model, backend=CompileCounter(), fullgraph=True)
        compiled(prompt)  # a graph break (row-exact attention's context variable) would raise here
        with pytest.warns(UserWarning, match="compile=True verifies blocks in compiled bfloat16 forwards"):
            generate(
                target,
                drafter,
                prompt,
                max_new_tokens=8,
                do_sample=False,
                compile=CompileConfig(backend=Counter(), mode=None, fullgraph=True),
            )
    finally:
        torch._dynamo.reset()
    assert target.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("prompt_length", [15, 19])
def test_bf16_gemma_past_the_sliding_window_equals_plain_bf16_greedy(prompt_length):
    """Stock `generate` keeps only the window in a sliding layer's cache; row-exact verification attends each row over
    those keys alone (attending over the whole context with the old keys masked gives other bits, and other tokens)."""
    reference_target, target = _bf16_target("gemma3"), _bf16_target("gemma3")
    drafter = make_drafter(target).to(torch.bfloat16)
    prompt = torch.randint(3, 64, (1, prompt_length), generator=torch.Generator().manual_seed(7))
    assert prompt_length > GEMMA_SLIDING_WINDOW
    expected = reference_target.generate(prompt, max_new_tokens=32, do_sample=False)
    out = generate(target, drafter, prompt, max_new_tokens=32, do_sample=False)
    if not row_exact.install(target, 4):
        pytest.skip("this CPU's bf16 kernels cannot be made row-exact for this target (install says so)")
    assert torch.equal(out, expected)


def test_row_exact_attention_is_sdpa_outside_verification():
    """Installing changes nothing for ordinary forwards: prefill logits are bitwise those of stock `sdpa`."""
    stock, target = _bf16_target("llama"), _bf16_target("llama")
    row_exact.install(target, 4)
    ids = torch.tensor([PROMPTS[1]])
    assert torch.equal(stock(ids).logits, target(ids).logits)
    assert row_exact.install(target, 4) == row_exact.install(target, 2)  # cached, idempotent


def test_quirky_linear_is_detected_and_recomputed_row_by_row():
    """A linear whose multi-row kernel rounds differently breaks block verification until install hooks it.

    What `install` guarantees: every such linear is hooked and afterwards a block's rows equal decode steps bit for
    bit. Whether an ordinary linear is hooked as well depends on the CPU's bf16 kernels (on some hosts their multi-row
    kernel rounds differently too), so only the planted quirk's hooks are asserted.
    """
    target = _bf16_target("llama")
    _with_quirky_down_proj(target)
    linear = target.get_decoder().layers[0].mlp.down_proj
    assert not row_exact._rows_match(linear, 4, torch.Generator().manual_seed(0))
    target.set_attn_implementation(row_exact.ATTENTION_NAME)
    assert not row_exact.block_rows_match_decode(target, 4)  # attention alone does not fix the linear
    assert row_exact.install(target, 4)
    with row_exact.attention(target):  # the hooks are the target's inside the engine's calls only
        assert all(getattr(layer.mlp.down_proj, "_row_exact_hooked", False) for layer in target.get_decoder().layers)
    assert not any(getattr(layer.mlp.down_proj, "_row_exact_hooked", False) for layer in target.get_decoder().layers)
    assert row_exact.block_rows_match_decode(target, 4, seed=5)


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_with_a_quirky_linear_equals_plain_bf16_greedy(family, candidates):
    """On every CPU, whatever its own bf16 kernels do: with a linear whose multi-row kernel rounds differently (planted
    here), the engine's block and tree verifies still give plain bf16 greedy's tokens, past Gemma's sliding window
    too. (The bf16 tests that skip where `install` finds a host's kernels cannot be made row-exact rest on this
    guarantee; this test never skips.)"""
    reference_target, target = _bf16_target(family), _bf16_target(family)
    for model in (reference_target, target):
        _with_quirky_down_proj(model)
    prompt = torch.tensor([PROMPTS[1]])
    assert prompt.shape[1] > GEMMA_SLIDING_WINDOW
    expected = reference_target.generate(prompt, max_new_tokens=40, do_sample=False)
    corrupt = corrupt_slots(3)
    drafter = make_oracle(target, [expected[0].tolist()], corrupt=corrupt).to(torch.bfloat16)
    out = generate(target, drafter, prompt, max_new_tokens=40, do_sample=False, candidates=candidates)
    assert row_exact.install(target, 4) and torch.equal(out, expected)


def test_engine_warns_when_bf16_verification_cannot_be_exact(monkeypatch):
    target = _bf16_target("llama")
    drafter = make_drafter(target).to(torch.bfloat16)
    monkeypatch.setattr(row_exact, "install", lambda target, max_rows: False)
    with pytest.warns(UserWarning, match="load the target in float32 for exact outputs"):
        generate(target, drafter, torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False)


def test_float32_targets_are_left_alone():
    target = make_target("llama")
    drafter = make_drafter(target)
    generate(target, drafter, torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False)
    assert target.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected"),
    [(False, False, None), (False, True, "AVX512-BF16"), (True, True, "AMX-BF16")],
    ids=["AVX2 EPYC or AVX-512 Xeon", "AVX512-BF16 EPYC", "AMX Xeon"],
)
def test_native_bf16_feature_names_the_cpus_bf16_unit(monkeypatch, amx, avx512_bf16, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert real_native_bf16_feature() == expected


@pytest.mark.parametrize(
    ("device", "feature", "expected"),
    [
        ("cpu", None, torch.float32),
        ("cpu", "AVX512-BF16", torch.bfloat16),
        ("cpu", "AMX-BF16", torch.bfloat16),
        ("cuda", None, torch.bfloat16),
    ],
)
def test_auto_dtype_follows_the_machine(monkeypatch, device, feature, expected):
    monkeypatch.setattr(runtime, "native_bf16_feature", lambda: feature)
    dtype, reason = runtime.inference_dtype("auto", device)
    assert dtype == expected and reason.startswith("auto: ")
    if feature:
        assert feature in reason
    assert runtime.inference_dtype("float32", device) == (torch.float32, "as requested")
    assert runtime.inference_dtype("bfloat16", device)[0] == torch.bfloat16


def _fake_timings(fastest: str):
    """A stand-in measurement in which `fastest` wins (every other mode costs twice as much at 4 and 8 rows)."""

    def measure(modes, threads, *args, **kwargs):
        return {m: {"1": 1.0, "4": 1.5 if m == fastest else 3.0, "8": 2.0 if m == fastest else 4.0} for m in modes}

    return measure


HOST_FLAGS = {  # the CPU kinds this project runs on, by the /proc/cpuinfo flags `mkl_choice.candidates` reads
    "amd-epyc-avx2": "fma avx2",
    "amd-epyc-avx512-bf16": "avx2 avx512f avx512_bf16",
    "intel-xeon-amx": "avx2 avx512f avx512_bf16 amx_bf16",
    "intel-xeon-avx512": "avx2 avx512f avx512_vnni",
}


@pytest.fixture(params=sorted(HOST_FLAGS))
def host(request, monkeypatch):
    """Each kind of host, faked, so every branch of the MKL choice runs on every machine."""
    flags = HOST_FLAGS[request.param]
    real_field = runtime._cpuinfo_field
    monkeypatch.setattr(runtime, "_cpuinfo_field", lambda name: flags if name == "flags" else real_field(name))
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    monkeypatch.setenv("DFLASH_HF_CACHE", str(request.getfixturevalue("tmp_path")))
    return request.param


@pytest.mark.parametrize(
    ("choice", "fastest", "preset", "expected"),
    [
        ("auto", "AUTO", None, "AUTO"),
        ("auto", "default", None, None),
        ("auto", "AVX2", None, "AVX2"),
        ("cnr", "default", None, "AUTO"),
        ("default", "AUTO", None, None),
        ("auto", "AUTO", "AVX2", "AVX2"),  # a mode set in the environment is kept
        ("default", "default", "AVX2", "AVX2"),
    ],
)
def test_mkl_mode_follows_the_measurement_and_the_environment(host, monkeypatch, choice, fastest, preset, expected):
    monkeypatch.setattr(mkl_choice, "measure", _fake_timings(fastest))
    if preset is None:
        monkeypatch.delenv("MKL_CBWR", raising=False)
    else:
        monkeypatch.setenv("MKL_CBWR", preset)
    reported = mkl_choice.select_mkl_mode(choice, threads=2)
    assert os.environ.get("MKL_CBWR") == expected
    assert reported == f"{runtime.mkl_mode()} ({mkl_choice.reason()})"
    assert runtime.mkl_mode() == ("MKL default code path" if expected is None else f"MKL_CBWR={expected}")
    if preset is not None:
        assert mkl_choice.reason() == "set in the environment"
    elif choice == "auto":
        assert mkl_choice.reason().startswith("auto: fastest of MKL's code paths measured on this machine")
        assert f"{fastest} " in mkl_choice.reason()
    else:
        assert mkl_choice.reason() == f"--mkl-mode {choice}"


def test_mkl_candidates_follow_the_cpu(host):
    modes = mkl_choice.candidates()
    assert modes[:2] == ("default", "AUTO")
    assert ("AVX2" in modes) == ("avx2" in HOST_FLAGS[host])
    assert ("AVX512" in modes) == ("avx512f" in HOST_FLAGS[host])


def test_measured_mkl_verdict_is_kept_per_machine_and_thread_count(host, monkeypatch, tmp_path):
    calls = []
    fake = _fake_timings("AUTO")
    monkeypatch.setattr(
        mkl_choice, "measure", lambda modes, threads, **kw: calls.append(threads) or fake(modes, threads)
    )
    assert mkl_choice.measured_mode(2, tmp_path)[0] == "AUTO"
    assert mkl_choice.measured_mode(2, tmp_path)[0] == "AUTO" and calls == [2]  # read back, not measured again
    stored = json.loads((tmp_path / mkl_choice.VERDICTS_FILE).read_text())
    (verdict,) = stored.values()
    assert set(verdict["ms_by_rows"]) == set(mkl_choice.candidates()) and verdict["measured"]
    assert mkl_choice.measured_mode(1, tmp_path)[0] == "AUTO" and calls == [2, 1]  # another thread count
    (tmp_path / mkl_choice.VERDICTS_FILE).write_text("[1, 2")  # a damaged file is measured anew
    assert mkl_choice.measured_mode(2, tmp_path)[0] == "AUTO" and calls == [2, 1, 2]


def test_mkl_fastest_prefers_mkls_default_on_ties():
    same = {"1": 1.0, "4": 2.0}
    assert mkl_choice.fastest({"AUTO": same, "default": same, "AVX2": same}) == "default"
    assert mkl_choice.fastest({"AUTO": {"1": 1.0, "4": 1.5}, "default": same}) == "AUTO"


def test_mkl_timing_workers_time_each_mode_in_its_own_process():
    """The real measurement (tiny shapes): one worker per mode, every row count timed."""
    timings = real_measure(("default", "AUTO"), threads=1, shapes=((8, 16),), rows=(1, 2), rounds=2, repeats=1)
    assert set(timings) == {"default", "AUTO"}
    assert all(set(ms) == {"1", "2"} and all(value > 0 for value in ms.values()) for ms in timings.values())


def test_mkl_mode_without_mkl_and_bad_choices(monkeypatch):
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert mkl_choice.select_mkl_mode("cnr") == "no MKL (this torch build has no MKL)" and "MKL_CBWR" not in os.environ
    with pytest.raises(ValueError, match="Unknown MKL mode 'fast': use auto, cnr, default"):
        mkl_choice.select_mkl_mode("fast")


def test_commands_choose_the_mkl_mode_before_loading_and_report_it(folders, monkeypatch, capsys):
    """`--mkl-mode` is applied before any model is loaded (MKL reads it at its first matmul), then reported."""
    target_dir, drafter_dir = folders
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    seen = []
    real_load = generate_command.load_models

    def load_models_spy(*args, **kwargs):
        seen.append(os.environ.get("MKL_CBWR"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(generate_command, "load_models", load_models_spy)
    argv = ["generate", "hi", "--target", str(target_dir), "--drafter", str(drafter_dir), "--max-new-tokens", "2"]
    assert cli.main([*argv, "--threads", "1", "--dtype", "float32", "--mkl-mode", "cnr"]) == 0
    assert seen == ["AUTO"] and "kernels: MKL_CBWR=AUTO (--mkl-mode cnr)" in capsys.readouterr().err.splitlines()
    with pytest.raises(SystemExit):  # argparse: one usage error line
        cli.main([*argv, "--mkl-mode", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    target_dir = save_tiny_target(root / "target")
    make_drafter(make_llama(), seed=3, num_layers=2).save_pretrained(root / "drafter")
    return target_dir, root / "drafter"


def test_auto_falls_back_to_float32_when_bf16_verification_is_not_exact(monkeypatch, folders, tmp_path):
    target_dir, drafter_dir = folders
    monkeypatch.setenv(fileio.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(runtime, "native_bf16_feature", lambda: "AVX512-BF16")
    monkeypatch.setattr(row_exact, "install", lambda target, max_rows: False)
    target, _, drafter, precision = load_models(str(target_dir), drafter_dir, torch.device("cpu"), "auto", 4)
    assert target.dtype == drafter.dtype == torch.float32
    assert precision.startswith("float32 (auto: this CPU computes bfloat16 natively (AVX512-BF16), but its block")
    verdict = json.loads((tmp_path / precision_module.VERDICTS_FILE).read_text())
    assert [v["bfloat16_exact"] for v in verdict.values()] == [False]
    target, _, _, precision = load_models(str(target_dir), drafter_dir, torch.device("cpu"), "bfloat16", 4)
    assert target.dtype == torch.bfloat16 and "NOT bit-exact" in precision  # asked for explicitly: kept, and said


@pytest.mark.parametrize(("bf16_ms", "expected"), [(5.0, torch.bfloat16), (50.0, torch.float32)])
def test_auto_measures_once_and_keeps_the_faster_precision(monkeypatch, folders, tmp_path, bf16_ms, expected):
    target_dir, drafter_dir = folders
    monkeypatch.setenv(fileio.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(runtime, "native_bf16_feature", lambda: "AMX-BF16")
    timed = []

    def cycle_ms(model, drafter, max_block, verify_tokens):
        timed.append((model.dtype, max_block, verify_tokens))
        return bf16_ms if model.dtype == torch.bfloat16 else 10.0

    monkeypatch.setattr(precision_module, "_cycle_ms", cycle_ms)
    target, _, drafter, precision = load_models(str(target_dir), drafter_dir, torch.device("cpu"), "auto", 4)
    assert target.dtype == drafter.dtype == expected and timed == [(torch.float32, 4, 4), (torch.bfloat16, 4, 4)]
    assert f"a B=4 cycle measured {bf16_ms} ms in row-exact bfloat16 vs 10.0 ms in float32" in precision
    # the stored verdict is read, not measured again
    target, _, _, again = load_models(str(target_dir), drafter_dir, torch.device("cpu"), "auto", 4)
    assert target.dtype == expected and len(timed) == 2 and again == precision
    # another block size is another verdict (so are another CPU, torch version, thread count or target)
    load_models(str(target_dir), drafter_dir, torch.device("cpu"), "auto", 2)
    assert len(timed) == 4
    # so is another verify width (a block of 4 with a 7-token lookup branch): the cycle timed is the tree's verify
    _, _, _, tree = load_models(str(target_dir), drafter_dir, torch.device("cpu"), "auto", 4, verify_tokens=11)
    assert timed[4:] == [(torch.float32, 4, 11), (torch.bfloat16, 4, 11)]
    assert "a B=4 (verify of 11 tokens) cycle measured" in tree


def test_auto_measures_the_cycle_each_command_runs(monkeypatch, folders, tmp_path):
    """generate and bench time the widest verify they will run: the block plus its lookup branch when greedy."""
    target_dir, drafter_dir = folders
    widths = []

    def load(target, drafter_dir, device, dtype, max_block, verify_tokens=None):
        widths.append((max_block, verify_tokens))
        raise RuntimeError("stop after choosing the precision")

    for module in (generate_command, bench_command):
        monkeypatch.setattr(module, "load_models", load)
    runs = {
        ("generate",): (4, 11),  # the drafter's block of 4 + the default 7-token branch
        ("generate", "--lookup-tokens", "2"): (4, 6),
        ("generate", "--candidates", "dflash"): (4, 4),
        ("generate", "--temperature", "0.7"): (4, 4),  # sampling verifies the block alone
        ("generate", "--block-size", "3"): (3, 10),
        ("generate", "--candidates", "tree"): (4, 4 + DEFAULT_TREE_NODES),  # the largest draft tree
        ("bench", "--block-sizes", "2,4", "--no-draft-tree"): (4, 9),  # the lookup rows take the smallest block
        ("bench", "--block-sizes", "2,4", "--lookup-tokens", "9", "--no-draft-tree"): (4, 11),
        ("bench", "--block-sizes", "2,4", "--no-lookup-branch", "--no-draft-tree"): (4, 4),
        ("bench", "--block-sizes", "2,4"): (4, 4 + DEFAULT_TREE_NODES),  # the tree rows' largest tree at B=4
    }
    for argv, expected in runs.items():
        command, *flags = argv
        prompt = ["hello"] if command == "generate" else ["--out", str(tmp_path / "bench")]
        with pytest.raises(RuntimeError, match="stop after"):
            cli.main([command, *prompt, "--target", str(target_dir), "--drafter", str(drafter_dir), *flags])
        assert widths.pop() == expected, argv


def test_the_verdict_times_a_verify_of_the_widest_tree_and_a_draft_of_the_block(monkeypatch):
    """`auto`'s cycle (`dflash_hf.costs.cycle_ms`): the verify of `verify_tokens` tokens and the drafter's block, each
    forward run as the engine runs it (stand-in times: a call's count, plus 100 for a draft)."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    rounds = []

    def medians(calls, repeats, device):
        for call in calls.values():
            call()
        rounds.append(sorted(calls))
        times: dict[str, dict[int, float]] = {}
        for kind, count in calls:
            times.setdefault(kind, {})[count] = count + (100.0 if kind == "drafter" else 0.0)
        return times

    monkeypatch.setattr(costs, "interleaved_medians", medians)
    assert precision_module._cycle_ms(target, drafter, 4, 11) == 11 + 104
    assert rounds == [[("target", 4), ("target", 11)], [("drafter", 4)]]


def test_cost_profile_measures_every_count_and_block():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    profile = measure_costs(target, drafter, token_counts=(1, 2, 4, 8), context_tokens=16, repeats=1)
    assert profile["dtype"] == "float32" and profile["row_exact"] is False
    assert list(profile["target_ms"]) == ["1", "2", "4", "8"] and list(profile["drafter_ms"]) == ["2", "4"]
    assert profile["target_relative"]["1"] == 1.0
    assert all(v > 0 for v in [*profile["target_ms"].values(), *profile["drafter_ms"].values()])
    assert list(profile["matmul_ms"]) == ["1", "2", "4", "8"] and profile["floor_relative"]["1"] == 1.0
    step, matmuls = profile["target_ms"]["1"], profile["matmul_ms"]
    assert profile["floor_relative"]["8"] == pytest.approx((step - matmuls["1"] + matmuls["8"]) / step)
    assert list(profile["drafter_matmul_ms"]) == ["2", "4"]
    # grouped-query attention (4 query heads on 2 key/value heads here), and Transformers' sdpa for comparison
    assert list(profile["stock_attention_ms"]) == ["2", "4", "8"] and profile["stock_attention_relative"]["8"] > 0
    assert profile["drafter_matmul_relative"]["4"] == pytest.approx(profile["drafter_matmul_ms"]["4"] / step)
    assert "matmul_ms" not in measure_costs(target, drafter, (2, 4), context_tokens=16, repeats=1)  # no 1-token step
    bare = measure_costs(target, drafter, (1, 4), context_tokens=16, repeats=1, comparisons=False)
    assert "matmul_ms" not in bare and "stock_attention_ms" not in bare
    bf16 = measure_costs(_bf16_target("llama"), drafter.to(torch.bfloat16), (1, 4), context_tokens=16, repeats=1)
    assert bf16["dtype"] == "bfloat16" and list(bf16["drafter_ms"]) == ["4"]
    assert bf16["row_exact"] and "stock_attention_ms" not in bf16  # row-exact attention is left alone
    with pytest.raises(ValueError, match="must be >= 1"):
        measure_costs(target, drafter, token_counts=(0, 2))


def test_matmul_floor_times_every_linear_layer_and_the_head_on_k_rows(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    linears, draft_linears = profile_module.decoder_linears(target), profile_module.decoder_linears(drafter)
    names = {module: name for name, module in [*target.named_modules(), *drafter.named_modules(prefix="draft")]}
    assert target.get_output_embeddings() not in linears and len(linears) == 7 * target.config.num_hidden_layers
    assert {names[m].rsplit(".", 1)[-1] for m in linears} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"}  # fmt: skip
    assert len(draft_linears) == 1 + 7 * drafter.config.num_hidden_layers  # its context projection and its layers
    calls: list[tuple[str, int]] = []
    for module in linears + draft_linears:
        module.register_forward_hook(lambda m, args, out: calls.append((names[m], args[0].shape[0])))
    for method in ("logits", "draft_logits"):  # the target's head, and the drafter's through it
        original = getattr(profile_module.TargetAdapter, method)
        monkeypatch.setattr(
            profile_module.TargetAdapter,
            method,
            lambda self, hidden, token_ids=None, original=original: (
                calls.append(("head", hidden.shape[0])) or original(self, hidden, token_ids)
            ),
        )
    measure_costs(target, drafter, token_counts=(1, 4), context_tokens=16, repeats=1)
    products = [call for call in calls if call[1] == 4]  # the forwards' calls have a batch dimension first
    target_run = [(names[m], 4) for m in linears] + [("head", 4)]
    draft_run = [(names[m], 4) for m in draft_linears] + [("head", 4)]
    # the drafter's products come last, timed in 2 rounds (1 untimed); before them the target's last round
    assert products[-2 * len(draft_run) :] == 2 * draft_run
    assert products[: -2 * len(draft_run)][-len(target_run) :] == target_run


def test_profile_command_writes_json_and_plot(folders, tmp_path, capsys):
    target_dir, drafter_dir = folders
    out = tmp_path / "profile"
    models = ["--target", str(target_dir), "--drafter", str(drafter_dir)]
    settings = ["--context", "8", "--repeats", "1", "--out", str(out)]
    code = cli.main(["profile", *models, "--tokens", "1,2,4", *settings, "--threads", "1"])
    assert code == 0
    document = json.loads((out / "profile.json").read_text())
    assert [p["dtype"] for p in document["profiles"]] == ["float32", "bfloat16"]
    code = cli.main(["profile", *models, "--tokens", "1,4", "--dtypes", "bfloat16", "--inexact", *settings])
    profiles = json.loads((out / "profile.json").read_text())["profiles"]
    expected = ["bfloat16", "bfloat16, not exact"] if profiles[0]["row_exact"] else ["bfloat16"]
    assert code == 0 and [p["dtype"] for p in profiles] == expected
    assert (out / "profile.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "float32 (as requested)" in printed and "4 tok" in printed
    assert cli.main(["profile", *models, "--dtypes", "fp8"]) == 2
