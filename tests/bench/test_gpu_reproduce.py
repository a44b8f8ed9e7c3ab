"""`examples/gpu/reproduce.sh` runs as written: its oracle part on a tiny random target on the CPU (the other parts
call the same commands with the bundled pair, and the trainer's flags are tested in tests/trainers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from testing_utils import REPO

SCRIPT = REPO / "examples" / "gpu" / "reproduce.sh"


def test_the_oracle_part_writes_its_bench_and_the_results_page(tmp_path: Path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # the venv's dflash-hf
        "HF_HUB_OFFLINE": "1",
        "PARTS": "oracle",
        "DEVICE": "cpu",
        "BIG_TARGET": "random:tiny-qwen3",
        "PROMPTS": "1",
        "TOKENS": "4",
        "ORACLE": "1.0",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    bench = json.loads((tmp_path / "out" / "oracle-random-tiny-qwen3" / "bench.json").read_text())
    assert [m["name"] for m in bench["methods"]] == ["greedy", "oracle_b16_p1"]
    assert "oracle P=1" in (tmp_path / "out" / "results.md").read_text()
    assert "bench: prompt 1/1 oracle_b16_p1" in done.stderr  # --no-progress still reports each finished run
