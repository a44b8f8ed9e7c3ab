"""`examples/gpu/reproduce.sh` runs as written: its oracle part and its trainer part of the paper's shape on a tiny
random target on the CPU (the other parts call the same commands with the bundled pair, and the trainer's flags are
tested in tests/trainers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from testing_utils import REPO

SCRIPT = REPO / "examples" / "gpu" / "reproduce.sh"


def _run(out: Path, **settings: str) -> subprocess.CompletedProcess:
    """The script on the CPU with the tiny random target and `settings`, writing to `out`; it must succeed."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # the venv's dflash-hf
        "HF_HUB_OFFLINE": "1",
        "DEVICE": "cpu",
        "BIG_TARGET": "random:tiny-qwen3",
        **settings,
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_oracle_part_writes_its_bench_and_the_results_page(tmp_path: Path):
    done = _run(tmp_path / "out", PARTS="oracle", PROMPTS="1", TOKENS="4", ORACLE="1.0")
    bench = json.loads((tmp_path / "out" / "oracle-random-tiny-qwen3" / "bench.json").read_text())
    assert [m["name"] for m in bench["methods"]] == ["greedy", "oracle_b16_p1"]
    assert "oracle P=1" in (tmp_path / "out" / "results.md").read_text()
    assert "bench: prompt 1/1 oracle_b16_p1" in done.stderr  # --no-progress still reports each finished run


def test_the_paper_shape_trainer_part_writes_its_throughput_table(tmp_path: Path):
    """Three steps (the first is warm-up), so the table holds a warm rate and its GPU-hours."""
    _run(tmp_path / "out", PARTS="train-paper", BIG_BATCH_SIZES="1 0", TRAIN_ROWS="8", SECONDS_PER_RUN="600", STEPS="3")
    summary = json.loads((tmp_path / "out" / "train-random-tiny-qwen3-b1" / "train_summary.json").read_text())
    assert summary["global_step"] == 3 and summary["samples_per_second_warm"] > 0
    table = (tmp_path / "out" / "train-throughput.md").read_text().splitlines()
    assert len(table) == 4 and table[2].startswith("| random-tiny-qwen3 | 1 | 3 | ")
    hours = 100_000 / summary["samples_per_second_warm"] / 3600
    assert f"| {hours:.1f} |" in table[2]
    # a run that fails (batch 0 here, out of memory on a GPU) is a row that says so; the table is still written
    assert table[3] == "| random-tiny-qwen3 | 0 | failed (see the log) | - | - | - | - |"
