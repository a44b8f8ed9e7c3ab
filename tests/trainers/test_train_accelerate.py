"""`accelerate launch --num_processes 2 --cpu examples/train.py --config recipe.yaml` really trains (DDP over gloo)
and exports; command-line flags override the recipe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from testing_utils import REPO, make_tiny_target, make_tokenizer, one_thread, write_prompts

from dflash_hf.cli import main as cli_main


@pytest.mark.slow
def test_accelerate_two_process_cpu_run(tmp_path):
    accelerate = shutil.which("accelerate") or str(Path(sys.executable).parent / "accelerate")
    if not Path(accelerate).exists():
        pytest.skip("accelerate CLI not installed")
    with one_thread():
        target = make_tiny_target("qwen3")
        tok = make_tokenizer()
        target.save_pretrained(tmp_path / "target")
        tok.save_pretrained(tmp_path / "target")
        src = write_prompts(tmp_path / "p.jsonl")
        assert (
            cli_main(
                [
                    "make-data",
                    "--target",
                    str(tmp_path / "target"),
                    "--prompts",
                    str(src),
                    "--out",
                    str(tmp_path / "data"),
                    "--max-new-tokens",
                    "12",
                    "--held-out-fraction",
                    "0",
                    "--device",
                    "cpu",
                    "--quiet",
                ]
            )
            == 0
        )
    recipe = tmp_path / "recipe.yaml"  # a TRL-style recipe, as in examples/recipes/
    recipe.write_text(
        f"target: {tmp_path / 'target'}\ndata: {tmp_path / 'data'}\noutput_dir: {tmp_path / 'elsewhere'}\n"
        "max_steps: 5\nsave_steps: 1\nblock_size: 4\nnum_draft_layers: 1\nnum_target_features: 2\nnum_anchors: 8\n"
        "per_device_train_batch_size: 2\nlogging_steps: 1\ndisable_tqdm: true\nuse_cpu: true\nreport_to: none\n"
        "base_model: test-org/tiny-qwen3\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(REPO / "examples" / "train.py"),
        "--config",
        str(recipe),
        "--output_dir",
        str(tmp_path / "run"),
        "--max_steps",
        "2",  # flags override the recipe file
        "--max_train_seconds",
        "600",  # each step asks every process whether to stop (a collective over gloo)
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 2 and not summary["stopped_at_time_limit"]
    assert summary["anchor_blocks_per_second_warm"] > 0  # the rates of step 2, summed over both processes
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "optimizer.safetensors").is_file()
    assert (ckpt / "rng_state_0.safetensors").is_file() and (ckpt / "rng_state_1.safetensors").is_file()  # per process
    assert not [p.name for p in ckpt.iterdir() if p.suffix in (".pt", ".pth", ".bin")]  # no pickles
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "dflash"
    assert "fc.weight" in load_file(str(final / "model.safetensors"))
