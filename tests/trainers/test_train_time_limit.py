"""Runs on a lent machine: `max_train_seconds` ends the loop in time with a checkpoint to resume from,
`max_shard_size` writes checkpoints and the final export as shards no larger than asked, and the rate of the steps
after the first is what a short run reports."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from dflash_hf.modeling import DFlashDraftModel
from dflash_hf.trainers import DFlashDataCollator, DFlashTrainer
from dflash_hf.trainers.masks import valid_anchor_positions
from dflash_hf.trainers.throughput import ThroughputCallback
from dflash_hf.trainers.time_limit import TimeLimitCallback
from testing_utils import make_drafter, run_make_data, tiny_train_config, write_prompts
from transformers import TrainerControl, TrainerState, TrainingArguments

from dflash_hf.drafters import load_drafter
from dflash_hf.hub.export import export
from dflash_hf.hub.layout import SHARD_NAME

pytestmark = pytest.mark.usefixtures("single_thread")

SHARD = "40KB"  # above the tiny drafter's largest tensor, below its whole weights
SHARD_BYTES = 40_000


def step_ends(callback: TimeLimitCallback, times: list[float], save_strategy: str = "steps", max_steps: int = 100):
    """Feed `callback` a run whose training begins at `times[0]` and whose steps end at `times[1:]`; returns the
    steps run and the last control."""
    clock = iter(times)
    callback.clock = lambda: next(clock)
    args = TrainingArguments(output_dir="unused", save_strategy=save_strategy, report_to="none", use_cpu=True)
    state, control = TrainerState(max_steps=max_steps), TrainerControl()
    callback.on_train_begin(args, state, control)
    for state.global_step in range(1, len(times)):
        callback.on_step_end(args, state, control)
        if control.should_training_stop:
            break
    return state.global_step, control


def test_the_limit_stops_before_the_step_that_would_end_past_it():
    # steps of 10 s: after step 3 (30 s) a fourth would end at 40 s > 35 s
    steps, control = step_ends(TimeLimitCallback(35), [0, 10, 20, 30, 40, 50])
    assert (steps, control.should_training_stop, control.should_save) == (3, True, True)
    # a slow first step counts in the mean: it ends at 20 s, and a second of that mean would end at 40 s
    steps, _ = step_ends(TimeLimitCallback(35), [0, 20, 25, 30])
    assert steps == 1


def test_every_process_of_a_distributed_run_stops_when_one_would(monkeypatch):
    """Here 35 s leave room for a fourth step, but another process's clock says otherwise after the second: all stop."""
    distributed = torch.distributed
    monkeypatch.setattr(distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "get_world_size", lambda: 2)
    steps_seen = []

    def all_reduce(flag, op):  # the other process would stop from its second step on
        steps_seen.append(len(steps_seen) + 1)
        flag.fill_(max(float(flag), 1.0 if len(steps_seen) >= 2 else 0.0))

    monkeypatch.setattr(distributed, "all_reduce", all_reduce)
    steps, control = step_ends(TimeLimitCallback(35), [0, 5, 10, 15, 20])
    assert (steps, control.should_training_stop) == (2, True)


def test_the_limit_saves_only_where_the_run_saves_and_a_finished_run_is_no_early_stop():
    callback = TimeLimitCallback(15)
    _, control = step_ends(callback, [0, 10, 20], save_strategy="no")
    assert control.should_training_stop and not control.should_save and callback.stopped_early
    callback = TimeLimitCallback(15)
    steps, control = step_ends(callback, [0, 10], max_steps=1)  # the last step: nothing is cut short
    assert steps == 1 and not control.should_training_stop and not callback.stopped_early


@pytest.mark.parametrize("seconds", [0, -1.0])
def test_a_limit_must_be_positive(seconds, tmp_path):
    with pytest.raises(ValueError, match="max_train_seconds must be > 0"):
        tiny_train_config(tmp_path, max_train_seconds=seconds)


@pytest.mark.parametrize("size", ["40000", "5GiB", "-1MB", "0KB", "nanMB", "infMB", "1B"])
def test_a_shard_size_is_a_positive_size_that_save_pretrained_reads(tmp_path, size):
    with pytest.raises(ValueError, match=f"max_shard_size '{size}' is no size: give a positive number with a unit"):
        tiny_train_config(tmp_path, max_shard_size=size)


def test_a_fractional_shard_size_is_read_as_save_pretrained_reads_it(tmp_path):
    assert tiny_train_config(tmp_path, max_shard_size="1.5MB").max_shard_size == "1.5MB"


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("model*.safetensors"))  # not the optimizer or RNG states


def assert_sharded(folder: Path) -> None:
    shards = weight_files(folder)
    assert len(shards) > 1 and all(SHARD_NAME.fullmatch(p.name) for p in shards), [p.name for p in shards]
    assert all(p.stat().st_size <= SHARD_BYTES for p in shards)
    assert (folder / "model.safetensors.index.json").is_file()


def test_a_timed_run_stops_saves_shards_and_resumes(tiny_data, tmp_path):
    target, tok, data = tiny_data
    args = tiny_train_config(
        tmp_path / "run",
        max_steps=50,
        max_train_seconds=4.5,
        max_shard_size=SHARD,
        save_strategy="steps",
        save_steps=100,
        num_draft_layers=1,
    )
    trainer = DFlashTrainer(args=args, target=target, train_dataset=data, processing_class=tok)
    ticks = itertools.count()  # training begins at 0, step k ends at k seconds: the fifth would end past 4.5 s
    trainer.time_limit.clock = lambda: float(next(ticks))
    warm_ticks = iter([10.0, 13.0])  # the first step ends at 10 s, the run at 13 s
    trainer.throughput.clock = lambda device: next(warm_ticks)
    trainer.train()
    assert trainer.state.global_step == 4 and trainer.time_limit.stopped_early
    # 4 steps of 3 rows = two epochs of the 6 rows, each row with its valid anchors, 8 at most
    batch = DFlashDataCollator(pad_token_id=0)([data[i] for i in range(len(data))])
    valid = valid_anchor_positions(batch["loss_mask"], batch["attention_mask"].sum(1), 4).sum(1)
    total = trainer.anchor_blocks_trained
    assert len(data) == 6 and total == 2 * int(valid.clamp_max(8).sum())
    # the warm rate: the 3 steps after the first (the last one stops and saves: the stretch ends with it), their 9
    # rows and the blocks they trained, all but those of the first step's 3 rows, over 3 s
    warm = trainer.warm_throughput()
    assert warm["samples_per_second_warm"] == 3.0
    per_row = sorted(valid.clamp_max(8).tolist())
    fewest, most = (total - sum(per_row[3:])) / 3, (total - sum(per_row[:3])) / 3
    assert fewest - 0.05 <= warm["anchor_blocks_per_second_warm"] <= most + 0.05  # rounded to 0.1
    checkpoint = tmp_path / "run" / "checkpoint-4"
    assert_sharded(checkpoint)
    loaded = DFlashDraftModel.from_pretrained(checkpoint)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    resumed = DFlashTrainer(
        args=tiny_train_config(tmp_path / "run", max_steps=6, num_draft_layers=1),
        target=target,
        train_dataset=data,
        processing_class=tok,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    assert resumed.warm_throughput()["samples_per_second_warm"] > 0  # step 5 warms up, step 6 is timed


def test_the_warm_rate_leaves_out_the_first_step_evaluations_and_saves():
    """Steps end at 1, 2, 3 s; a save after step 3 lasts until 10 s; steps 4 and 5 end at 11 and 12 s, the last one
    stops the run: steps 2-5 are timed, 4 s for 4 steps of 10 blocks and 2 rows each."""
    trained = {"blocks": torch.zeros((), dtype=torch.float64), "rows": 0}
    times = iter([1.0, 3.0, 10.0, 12.0])  # when stretches open and close: after step 1, 3, before 4, after 5
    callback = ThroughputCallback(lambda: (trained["blocks"], trained["rows"]), clock=lambda device: next(times))
    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    state, control = TrainerState(max_steps=5), TrainerControl()
    callback.on_train_begin(args, state, control)
    for step in range(1, 6):
        callback.on_step_begin(args, state, control)
        trained["blocks"] += 10
        trained["rows"] += 2
        state.global_step = step
        control.should_save, control.should_training_stop = step == 3, step == 5
        callback.on_step_end(args, state, control)
    callback.on_train_end(args, state, control)
    assert next(times, None) is None
    assert callback.warm_rates(lambda total: total) == {
        "anchor_blocks_per_second_warm": 10.0,
        "samples_per_second_warm": 2.0,
    }
    # an epoch's evaluation (`eval_strategy="epoch"`): the stretch closes at the epoch's end, opens at the next step
    times = iter([20.0, 22.0, 30.0, 31.0])  # steps 2-3 end at 22 s, the evaluation lasts until 30 s
    state, control = TrainerState(max_steps=4), TrainerControl()
    callback.on_train_begin(args, state, control)
    for step, evaluates in ((1, False), (2, False), (3, True), (4, False)):
        callback.on_step_begin(args, state, control)
        trained["blocks"] += 10
        state.global_step, control.should_save, control.should_training_stop = step, False, step == 4
        callback.on_step_end(args, state, control)
        control.should_evaluate = evaluates
        callback.on_epoch_end(args, state, control)
        control.should_evaluate = False
    callback.on_train_end(args, state, control)
    assert callback.warm_rates(lambda total: total)["anchor_blocks_per_second_warm"] == 10.0  # 3 steps, 3 s
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        ThroughputCallback(lambda: (trained["blocks"], 0), warmup_steps=0)


def test_export_writes_shards_every_loader_reads(tmp_path):
    from testing_utils import make_tiny_target

    target = make_tiny_target("llama")
    drafter = make_drafter(target)
    out = export(drafter, tmp_path / "out", target=target, base_model="test-org/tiny", max_shard_size=SHARD)
    assert_sharded(out)
    loaded = load_drafter(out, target)
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    for format in ("speculators", "gguf"):
        with pytest.raises(ValueError, match="max_shard_size"):
            export(drafter, tmp_path / format, target=target, format=format, max_shard_size="15MB")
    for size in ("0KB", "infMB", 0, True):
        with pytest.raises(ValueError, match=r"max_shard_size \(`--max-shard-size`\) .* is no size"):
            export(drafter, tmp_path / "bad", target=target, base_model="test-org/tiny", max_shard_size=size)
    assert not (tmp_path / "bad").exists()


def test_train_command_stops_at_the_limit_and_exports_shards(tiny_data, tmp_path):
    from dflash_hf.cli import main as cli_main

    target, tok, _ = tiny_data
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    run_make_data(target, tok, tmp_path / "data", write_prompts(tmp_path / "p.jsonl"), max_new_tokens=12)
    argv = ["train", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data"), "--base_model", "a/b"]
    argv += ["--output_dir", str(tmp_path / "run"), "--block_size", "4", "--num_draft_layers", "1"]
    argv += ["--num_target_features", "2", "--num_anchors", "8", "--max_steps", "40", "--use_cpu", "true"]
    argv += ["--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
    # any step takes more than a millisecond: the run stops after its first
    argv += ["--max_train_seconds", "0.001", "--max_shard_size", SHARD]
    assert cli_main(argv) == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 1 and summary["stopped_at_time_limit"] is True
    assert summary["anchor_blocks"] > 0 and summary["anchor_blocks_per_second"] > 0
    # no step after the first: no warm rate
    assert summary["anchor_blocks_per_second_warm"] is None and summary["samples_per_second_warm"] is None
    assert summary["peak_device_memory_gb"] is None  # measured on CUDA devices only
    assert_sharded(tmp_path / "run" / "final")
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # save_strategy "no": nothing else written
