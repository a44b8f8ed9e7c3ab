"""Pickle-free training checkpoints (`trainers/checkpoint_io.py`): only safetensors and JSON are written, resuming
never unpickles and continues the same run, and a legacy pickle checkpoint is refused."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash_hf.trainers import DFlashTrainer, DFlashTrainingConfig
from dflash_hf.trainers.checkpoint_io import capture_rng_state, load_state, restore_rng_state, save_state
from testing_utils import make_tiny_target, make_tokenizer, one_thread, run_make_data, write_prompts

from dflash_hf.data.make import load_training_data

PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")  # pickle protocol >= 2; torch.save's zip container


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run checkpointed every step, and what it needs to run again."""
    with one_thread():
        target = make_tiny_target("llama")
        tok = make_tokenizer()
        root = tmp_path_factory.mktemp("ckpt")
        run_make_data(target, tok, root / "data", write_prompts(root / "prompts.jsonl"), max_new_tokens=16)
        data = load_training_data(root / "data")
        trainer = make_trainer(target, tok, data, root / "full")
        trainer.train()
        trainer.save_model(str(root / "full" / "saved"))
        return target, tok, data, root, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def make_trainer(target, tok, data, output_dir: Path) -> DFlashTrainer:
    args = DFlashTrainingConfig(
        output_dir=str(output_dir),
        block_size=4,
        num_anchors=8,
        num_draft_layers=1,
        num_target_features=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    return DFlashTrainer(args=args, target=target, train_dataset=data, processing_class=tok)


def assert_safetensors_or_json(path: Path) -> None:
    head = path.read_bytes()
    assert not head.startswith(PICKLE_MAGIC), f"{path.name} is a pickle"
    if path.suffix == ".safetensors":
        (size,) = struct.unpack("<Q", head[:8])
        json.loads(head[8 : 8 + size])
    else:
        assert path.suffix == ".json", f"{path.name}: neither safetensors nor JSON"
        json.loads(head)


@pytest.mark.parametrize("folder", ["checkpoint-1", "checkpoint-2", "saved"])
def test_checkpoints_hold_only_safetensors_and_json(run, folder):
    root = run[3] / "full" / folder
    files = sorted(p for p in root.rglob("*") if p.is_file())
    names = {p.name for p in files}
    assert {"model.safetensors", "training_args.json"} <= names
    if folder.startswith("checkpoint"):
        assert {
            "optimizer.safetensors",
            "optimizer.json",
            "scheduler.json",
            "rng_state.safetensors",
            "rng_state.json",
            "trainer_state.json",
        } <= names
    for path in files:
        if path.suffix in (".py", ".jinja"):  # the drafter's remote code, the tokenizer's chat template: text
            assert not path.read_bytes().startswith(PICKLE_MAGIC)
            path.read_text(encoding="utf-8")
            continue
        assert_safetensors_or_json(path)
    assert json.loads((root / "training_args.json").read_text())["save_steps"] == 1


def test_resume_never_unpickles_and_continues_the_run(run, tmp_path, monkeypatch):
    target, tok, data, root, reference = run

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load called while resuming")

    monkeypatch.setattr(torch, "load", no_unpickling)
    torch.manual_seed(123)  # a different process state: everything must come from the checkpoint
    random.seed(123)
    resumed = make_trainer(target, tok, data, tmp_path / "res")
    resumed.train(resume_from_checkpoint=str(root / "full" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    for key, value in resumed.model.state_dict().items():
        assert torch.allclose(value, reference[key], atol=1e-6), key


def test_legacy_pickle_checkpoint_is_refused(run, tmp_path, monkeypatch):
    target, tok, data, root, _ = run
    legacy = tmp_path / "checkpoint-1"
    shutil.copytree(root / "full" / "checkpoint-1", legacy)
    for name in ("optimizer", "scheduler", "rng_state"):  # what a plain Trainer writes instead
        for path in legacy.glob(f"{name}.*"):
            path.unlink()
    (legacy / "optimizer.pt").write_bytes(b"\x80\x04N.")  # pickle of None: never read
    (legacy / "rng_state.pth").write_bytes(b"\x80\x04N.")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called on a legacy checkpoint"))
    trainer = make_trainer(target, tok, data, tmp_path / "res")
    with pytest.raises(ValueError, match=r"pickle files \(optimizer.pt, rng_state.pth\)"):
        trainer.train(resume_from_checkpoint=str(legacy))


def test_state_round_trip_keeps_types_and_rng_streams(tmp_path):
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
    }
    save_state(state, tmp_path, "optimizer")
    back = load_state(tmp_path, "optimizer")
    assert back["param_groups"] == state["param_groups"] and isinstance(back["param_groups"][0]["betas"], tuple)
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert load_state(tmp_path, "missing") is None

    save_state(capture_rng_state(distributed=False), tmp_path, "rng_state")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    restore_rng_state(load_state(tmp_path, "rng_state"), distributed=False)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])
