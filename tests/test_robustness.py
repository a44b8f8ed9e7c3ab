"""Hardening, probed as a user would: bad inputs through the API and the CLI (exception or exit code and the first
line of the message), concurrent calls on one shared target, mixed drafter/target dtypes on both generation paths,
file modes of what is published, and SIGKILLs of `make-data` and `train` (also during a checkpoint save) followed by
a resume that must lose and duplicate nothing.

Everything runs on the tiny random models of `testing_utils.py`; kills are real SIGKILLs of forked
children, sent by the child itself at a chosen point so that the test is deterministic.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import stat
import threading
from pathlib import Path

import pytest
import torch
from dflash_hf.trainers import checkpointing as checkpointing_module
from dflash_hf.trainers import trainer as trainer_module
from dflash_hf.trainers.checkpoint_io import last_complete_checkpoint
from safetensors.torch import load_file, save_file
from testing_utils import (
    greedy_reference,
    make_drafter,
    make_llama,
    make_target,
    make_tokenizer,
    save_tiny_target,
    write_prompts,
)
from transformers import AutoModel, LlamaConfig

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel, cli, fileio, targets
from dflash_hf.data import make as data_module
from dflash_hf.fileio import FILE_MODE

MAX_NEW = 16
export_module = importlib.import_module("dflash_hf.hub.export")  # the package attribute is the function


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama")
    return target, make_drafter(target)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny target folder, a drafter built for it (plain, exported, damaged copies) and one built for another."""
    root = tmp_path_factory.mktemp("robust")
    llama = make_llama()
    drafter = make_drafter(llama, seed=3, num_layers=1)
    paths = {"target": save_tiny_target(root / "target"), "drafter": root / "drafter", "export": root / "export"}
    drafter.save_pretrained(paths["drafter"])
    dflash_hf.export(drafter, paths["export"], target=llama.config, base_model="org/tiny")
    weights = (paths["drafter"] / "model.safetensors").read_bytes()
    for name, source in (("truncated", "drafter"), ("truncated_export", "export"), ("bad_config", "export")):
        paths[name] = root / name
        shutil.copytree(paths[source], paths[name])
    for name in ("truncated", "truncated_export"):
        (paths[name] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (paths["bad_config"] / "config.json").write_text('{"model_type": "dflash",')
    other = LlamaConfig(**{**llama.config.to_dict(), "num_hidden_layers": 30})
    paths["other"] = root / "other-drafter"
    DFlashDraftModel(DFlashConfig.from_target(other, num_hidden_layers=1, num_target_features=5)).save_pretrained(
        paths["other"]
    )
    paths["file"] = root / "a-file"
    paths["file"].write_text("not a folder")
    return paths


def _cli(capsys, argv: list[str]) -> tuple[int, list[str], list[str]]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.strip().splitlines()


# ---------------------------------------------------------------------------------------------------------------
# (1) concurrent calls on one shared target and drafter


def _concurrent_calls_match_greedy(target, drafter, candidates=("dflash+lookup",)) -> None:
    """Four threads, three calls each on one shared target and drafter (the calls' `candidates` in turn): every
    output plain greedy's."""
    torch.manual_seed(0)
    prompts = [torch.randint(3, 60, (1, n)) for n in (5, 9, 13, 7)]
    references = [greedy_reference(target, p, max_new_tokens=MAX_NEW) for p in prompts]
    failures: list[str] = []

    def worker(offset: int) -> None:
        for k in range(3):
            i = (offset + k) % len(prompts)
            source = candidates[(offset + k) % len(candidates)]
            try:
                out = dflash_hf.generate(
                    target, drafter, prompts[i], max_new_tokens=MAX_NEW, do_sample=False, candidates=source
                )
                if not torch.equal(out, references[i]):
                    failures.append(f"prompt {i} ({source}): differs from greedy")
            except Exception as err:  # noqa: BLE001 - every failure is reported by the assertion below
                failures.append(f"prompt {i}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_concurrent_calls_on_a_shared_target_match_greedy(pair):
    _concurrent_calls_match_greedy(*pair)


def test_concurrent_calls_on_a_shared_hybrid_target_match_greedy():
    """A hybrid target's verify attaches hooks to its linear-attention layers (shared modules): each call's act for
    its own forwards only, so calls in four threads, chains and trees mixed, each stay plain greedy."""
    target = make_target("qwen3_5_text")
    _concurrent_calls_match_greedy(target, make_drafter(target), ("dflash", "tree", "dflash+lookup"))


# ---------------------------------------------------------------------------------------------------------------
# (2), (3), (5), (9) bad input through the API: a ValueError whose message starts with what went wrong


def _api_cases(target, drafter, folders):
    ids = torch.tensor([[1, 5, 6, 7]])
    wrong = DFlashDraftModel.from_pretrained(folders["other"])
    return {
        "mask of another shape (all ones)": (
            lambda: dflash_hf.generate(target, drafter, ids, attention_mask=torch.ones(1, 6, dtype=torch.long)),
            r"`attention_mask` has shape \(1, 6\) but `input_ids` has shape \(1, 4\): pass the mask",
        ),
        "mask of another shape": (
            lambda: dflash_hf.generate(target, drafter, ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]])),
            r"`attention_mask` has shape \(1, 6\)",
        ),
        "float ids": (
            lambda: dflash_hf.generate(target, drafter, ids.float(), max_new_tokens=4),
            r"`input_ids` must hold integer token ids, got dtype torch.float32: pass `input_ids.long\(\)`",
        ),
        "fractional block size": (
            lambda: dflash_hf.generate(target, drafter, ids, block_size=2.5, max_new_tokens=4),
            r"block_size must be an int, 'adaptive' or a BlockSizePolicy, got 2.5",
        ),
        "string max_new_tokens": (
            lambda: dflash_hf.generate(target, drafter, ids, max_new_tokens="5"),
            r"max_new_tokens must be an int >= 0, got '5'",
        ),
        "ids outside the vocabulary": (
            lambda: dflash_hf.generate(target, drafter, torch.tensor([[1, 500]]), max_new_tokens=4),
            r"`input_ids` hold token ids outside the target's vocabulary \(ids 1\.\.500, valid 0\.\.63\): encode",
        ),
        "right padding": (
            lambda: dflash_hf.generate(
                target,
                drafter,
                torch.tensor([[1, 5, 6, 7], [1, 8, 0, 0]]),
                attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
                max_new_tokens=4,
            ),
            r"Row 1 of the batch ends with padding \(right padding\): DFlash generation needs left-padded prompts; "
            r"set `tokenizer.padding_side = \"left\"`",
        ),
        "prompt longer than the positions": (
            lambda: dflash_hf.generate(target, drafter, torch.randint(3, 60, (1, 1020)), max_new_tokens=8),
            r"The prompt \(1020 tokens\) plus max_new_tokens \(8\) needs 1028 positions but the target has 1024 "
            r"\(`max_position_embeddings`\): shorten the prompt or lower max_new_tokens",
        ),
        "prompt longer than the positions (custom_generate)": (
            lambda: target.generate(
                torch.randint(3, 60, (1, 1020)),
                custom_generate=dflash_hf.custom_generate,
                drafter=drafter,
                max_new_tokens=8,
            ),
            r"The prompt \(1020 tokens\) plus max_new_tokens \(8\) needs 1028 positions",
        ),
        "drafter of another target": (
            lambda: dflash_hf.generate(target, wrong, ids, max_new_tokens=4),
            rf"This drafter \({re.escape(str(folders['other']))}\) was built for another target: a 30-layer `llama` "
            r"target, but this target is a 6-layer `llama`\.",
        ),
    }


CASES = [
    "mask of another shape (all ones)",
    "mask of another shape",
    "float ids",
    "fractional block size",
    "string max_new_tokens",
    "ids outside the vocabulary",
    "right padding",
    "prompt longer than the positions",
    "prompt longer than the positions (custom_generate)",
    "drafter of another target",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_api_input_is_a_value_error(pair, folders, case):
    call, message = _api_cases(*pair, folders)[case]
    with pytest.raises(ValueError) as info:
        call()
    assert re.match(message, str(info.value).splitlines()[0]), str(info.value)


def test_one_dimensional_prompt_and_mask_and_left_padding_match_greedy(pair):
    target, drafter = pair
    ids = torch.tensor([1, 5, 6, 7])
    out = dflash_hf.generate(
        target, drafter, ids, attention_mask=torch.ones(4, dtype=torch.long), max_new_tokens=MAX_NEW
    )
    assert torch.equal(out, greedy_reference(target, ids[None], max_new_tokens=MAX_NEW))
    batch, mask = torch.tensor([[1, 5, 6, 7], [0, 0, 1, 8]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    out = dflash_hf.generate(target, drafter, batch, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(out, greedy_reference(target, batch, mask, max_new_tokens=MAX_NEW))


# ---------------------------------------------------------------------------------------------------------------
# (4) bad input through the CLI: exit code 2 and exactly one `error: ...` line


CLI_CASES = {
    "truncated weights (generate)": (
        ["generate", "the cat", "--target", "{target}", "--drafter", "{truncated}", "--threads", "1"],
        "error: The weights in {truncated} are not a readable safetensors file",
    ),
    "truncated weights (push)": (
        ["push", "{truncated_export}", "me/tiny", "--dry-run"],
        "error: {truncated_export}/model.safetensors is not a readable safetensors file",
    ),
    "invalid config.json (generate)": (
        ["generate", "the cat", "--target", "{target}", "--drafter", "{bad_config}", "--threads", "1"],
        "error: {bad_config}/config.json is not valid JSON",
    ),
    "invalid config.json (push)": (
        ["push", "{bad_config}", "me/tiny", "--dry-run"],
        "error: {bad_config}/config.json is not valid JSON",
    ),
    "make-data --out is a file": (
        ["make-data", "--target", "{target}", "--out", "{file}", "--quiet"],
        "error: --out {file}: {file} is a file, not a folder",
    ),
    "prompt longer than the positions": (
        [
            "generate",
            "the cat " * 130,
            "--target",
            "{target}",
            "--drafter",
            "{drafter}",
            "--no-chat-template",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
        ],
        "error: The prompt (260 tokens) plus max_new_tokens (8) needs 268 positions but the target has 256",
    ),
    "drafter of another target": (
        ["generate", "the cat", "--target", "{target}", "--drafter", "{other}", "--threads", "1"],
        "error: This drafter ({other}) was built for another target: a 30-layer `llama` target, but this target "
        "({target}) is a 6-layer `llama`.",
    ),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_cli_input_gives_one_error_line(folders, capsys, monkeypatch, case):
    argv, first = CLI_CASES[case]
    values = {key: str(path) for key, path in folders.items()}
    if case == "make-data --out is a file":  # found before the target is loaded
        monkeypatch.setattr(targets, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    if case == "prompt longer than the positions":  # refused before any forward (no warm-up prefill)
        from dflash_hf.commands import generate as generate_command

        monkeypatch.setattr(generate_command, "generate", lambda *a, **k: pytest.fail("generation started"))
    code, _, err = _cli(capsys, [arg.format(**values) for arg in argv])
    assert code == 2
    assert len(err) == 1 and err[0].startswith(first.format(**values)), err


def test_export_resolves_a_named_target_offline(folders, capsys, monkeypatch, tmp_path):
    """`--target smollm2-135m` reads the named target's config from its local cache (here: a stand-in folder) and
    writes its Hub id into the card; published files get ordinary modes (8)."""
    monkeypatch.setattr(export_module, "resolve_target_dir", lambda name: folders["target"])
    code, out, err = _cli(
        capsys, ["export", str(folders["drafter"]), str(tmp_path / "out"), "--target", "smollm2-135m"]
    )
    assert code == 0, err
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == FILE_MODE and set(modes.values()) == {FILE_MODE}, modes


def test_exported_files_have_ordinary_modes(folders):
    """(8) safetensors writes 0600 through a temporary file; published files get the mode of the config next to them."""
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folders["export"].iterdir()}
    assert set(modes.values()) == {FILE_MODE}, modes


# ---------------------------------------------------------------------------------------------------------------
# (7) mixed dtypes on both paths


def test_bf16_drafter_with_fp32_target_on_both_paths(pair, tmp_path):
    target, drafter = pair
    dflash_hf.export(make_drafter(target).to(torch.bfloat16), tmp_path / "bf16", target=target, base_model="org/tiny")
    loaded = AutoModel.from_pretrained(tmp_path / "bf16", trust_remote_code=True).eval()
    assert loaded.dtype == torch.bfloat16  # its saved dtype
    ids = torch.tensor([[1, 5, 6, 7]])
    reference = greedy_reference(target, ids, max_new_tokens=MAX_NEW)
    native = target.generate(
        ids, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=loaded, speculation_type="dflash"
    )
    assert torch.equal(native, reference)
    assert torch.equal(dflash_hf.generate(target, loaded, ids, max_new_tokens=MAX_NEW), reference)
    # the drafter computes in its own dtype and answers in the caller's
    embeds = target.get_input_embeddings()(torch.tensor([[5, 3, 3, 3]]))
    context = torch.randn(1, 2, 2 * target.config.hidden_size)
    for dtype in (torch.float32, torch.bfloat16):
        out = loaded(noise_embeds=embeds.to(dtype), context_hidden_states=context.to(dtype))
        assert out.last_hidden_state.dtype == dtype


# ---------------------------------------------------------------------------------------------------------------
# kills: make-data and train die by SIGKILL mid-run (also inside a checkpoint save) and resume completely


def _die_on_call(module, name: str, call: int) -> None:
    """Replace `module.name` with a wrapper that SIGKILLs this process on its `call`-th call."""
    real, calls = getattr(module, name), {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(module, name, wrapper)


def _killed_run(argv: list[str], module, name: str, call: int) -> None:
    """Run `dflash-hf argv` in a forked child that SIGKILLs itself on the `call`-th call of `module.name`."""

    def child() -> None:
        _die_on_call(module, name, call)
        torch.manual_seed(0)  # the state of a fresh process: a new drafter is initialised before the Trainer seeds
        cli.main(argv)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGKILL, process.exitcode


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    """A tiny target folder with its tokenizer, and prompts."""
    root = tmp_path_factory.mktemp("faults")
    target = make_target("qwen3")
    target.save_pretrained(root / "target")
    make_tokenizer().save_pretrained(root / "target")
    return root, write_prompts(root / "prompts.jsonl")


def _make_data_argv(root: Path, prompts: Path, out: str) -> list[str]:
    return [
        "make-data",
        "--target",
        str(root / "target"),
        "--prompts",
        str(prompts),
        "--out",
        str(root / out),
        "--max-new-tokens",
        "12",
        "--held-out-fraction",
        "0",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--quiet",
    ]


def _rows(folder: Path) -> list[tuple[str, list[int]]]:
    dataset = data_module.load_training_data(folder)
    return sorted(zip(dataset["id"], dataset["input_ids"]))


def test_make_data_features_out_trains_offline(train_setup, capsys, tmp_path):
    """`make-data --features-out`: the captured features folder covers every row and feeds offline training."""
    root, prompts = train_setup
    argv = _make_data_argv(root, prompts, "captured") + ["--features-out", str(root / "captured-features")]
    assert cli.main(argv + ["--target-layer-ids", "0", "2"]) == 0
    index = json.loads((root / "captured-features" / "index.json").read_text())
    rows = _rows(root / "captured")
    assert index["num_rows"] == len(rows) and index["target_layer_ids"] == [0, 2] and index["final_hidden"]
    train = [
        "train", "--target", str(root / "target"), "--data", str(root / "captured"), "--output_dir",
        str(tmp_path / "run"), "--base_model", "org/tiny", "--features", "offline", "--features_dir",
        str(root / "captured-features"), "--target_layer_ids", "0", "2", "--num_draft_layers", "1", "--block_size",
        "4", "--max_steps", "1", "--distill_weight", "0.5", "--use_cpu", "true", "--report_to", "none",
        "--disable_tqdm", "true", "--save_strategy", "no",
    ]  # fmt: skip
    assert cli.main(train) == 0, capsys.readouterr().err


def test_make_data_survives_sigkill(train_setup, capsys):
    root, prompts = train_setup
    assert cli.main(_make_data_argv(root, prompts, "data")) == 0
    # killed while generating the second batch, then between writing the third batch's part and renaming it into
    # place, then while the finished dataset is being renamed into place
    _killed_run(_make_data_argv(root, prompts, "killed"), data_module, "regenerate", 2)
    _killed_run(_make_data_argv(root, prompts, "killed"), data_module.os, "replace", 2)
    _killed_run(_make_data_argv(root, prompts, "killed"), data_module.os, "replace", 2)
    assert cli.main(_make_data_argv(root, prompts, "killed")) == 0
    capsys.readouterr()
    rows = _rows(root / "killed")
    assert rows == _rows(root / "data")
    assert len({row_id for row_id, _ in rows}) == len(rows)  # nothing duplicated


def _train_argv(root: Path, out: str, *extra: str) -> list[str]:
    return [
        "train",
        "--target",
        str(root / "target"),
        "--data",
        str(root / "data"),
        "--output_dir",
        str(root / out),
        "--max_steps",
        "4",
        "--save_steps",
        "1",
        "--block_size",
        "4",
        "--num_draft_layers",
        "1",
        "--num_target_features",
        "2",
        "--num_anchors",
        "8",
        "--per_device_train_batch_size",
        "2",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        "--base_model",
        "test-org/tiny-qwen3",
        "--seed",
        "0",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference_run(train_setup) -> Path:
    """Data, and an uninterrupted 4-step run to compare the resumed runs with."""
    root, prompts = train_setup
    if not (root / "data").exists():
        assert cli.main(_make_data_argv(root, prompts, "data")) == 0
    torch.manual_seed(0)  # as in the killed children
    assert cli.main(_train_argv(root, "reference")) == 0
    return root


def _assert_same_run(root: Path, run: Path) -> None:
    """The resumed run logged every step once and ends with the uninterrupted run's weights."""
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    steps = [entry["step"] for entry in state["log_history"] if "loss" in entry]
    assert steps == [1, 2, 3, 4]  # nothing lost, nothing duplicated
    reference = load_file(str(root / "reference" / "final" / "model.safetensors"))
    resumed = load_file(str(run / "final" / "model.safetensors"))
    assert reference.keys() == resumed.keys()
    for key, value in reference.items():
        assert torch.allclose(value, resumed[key], atol=1e-6), key


def test_train_survives_sigkill_mid_step(reference_run, capsys):
    root = reference_run
    _killed_run(_train_argv(root, "mid-step"), trainer_module.DFlashTrainer, "dflash_loss", 4)  # inside step 4
    run = root / "mid-step"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert cli.main(_train_argv(root, "mid-step", "--resume_from_checkpoint", "last")) == 0
    capsys.readouterr()
    _assert_same_run(root, run)


def test_train_survives_sigkill_during_a_checkpoint_save(reference_run, capsys):
    root = reference_run
    capsys.readouterr()
    # each checkpoint saves optimizer, scheduler and RNG state: the 7th call is inside checkpoint-3, after its weights
    _killed_run(_train_argv(root, "run"), checkpointing_module, "save_state", 7)
    run = root / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert [p.name for p in run.glob(".checkpoint-3*")] == [".checkpoint-3.partial"]  # never looks complete

    # a half-written last checkpoint as older code left it: `last` skips it, naming it; asked for, it is refused
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-3")
    (run / "checkpoint-3" / "trainer_state.json").unlink()
    code, _, err = _cli(capsys, _train_argv(root, "run", "--resume_from_checkpoint", str(run / "checkpoint-3")))
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        f"error: Checkpoint {run / 'checkpoint-3'} is incomplete (no trainer_state.json; its "
        f"save was interrupted): resume from {run / 'checkpoint-2'}"
    ), err

    assert last_complete_checkpoint(run) == (
        str(run / "checkpoint-2"),  # what Trainer.train(True) resumes from
        [f"{run / 'checkpoint-3'} (no trainer_state.json)"],
    )
    code, _, err = _cli(capsys, _train_argv(root, "run", "--resume_from_checkpoint", "last"))
    assert code == 0
    assert f"skipping incomplete checkpoint {run / 'checkpoint-3'} (no trainer_state.json)" in err
    assert not list(run.glob(".checkpoint-*"))  # leftovers cleared
    _assert_same_run(root, run)
    for folder in (run / "checkpoint-4", run / "final"):  # (8) ordinary modes in checkpoints and exports
        assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()} == {FILE_MODE}


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.safetensors"])
def test_last_skips_a_checkpoint_with_a_truncated_safetensors_file(tmp_path, damaged):
    """A weights or optimizer file cut short (a copy or a disk that failed) makes its checkpoint incomplete: `last`
    takes the one before, naming the file; the one asked for by name is refused with the same reason."""
    from dflash_hf.trainers.checkpoint_io import check_complete_checkpoint
    from transformers.trainer_callback import TrainerState

    run = tmp_path / "run"
    for step in (1, 2):
        folder = run / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file({"fc.weight": torch.ones(8, 8)}, str(folder / "model.safetensors"))
        save_file({"state": torch.zeros(16)}, str(folder / "optimizer.safetensors"))
        TrainerState(global_step=step).save_to_json(str(folder / "trainer_state.json"))
    broken = run / "checkpoint-2" / damaged
    broken.write_bytes(broken.read_bytes()[:-7])
    newest, skipped = last_complete_checkpoint(run)
    assert newest == str(run / "checkpoint-1")
    assert len(skipped) == 1 and f"{damaged} is truncated" in skipped[0]
    with pytest.raises(ValueError, match=f"{damaged} is truncated .*resume from .*checkpoint-1"):
        check_complete_checkpoint(run / "checkpoint-2")
    broken.write_bytes(b"\xff" * 16)
    assert "checkpoint-2" in last_complete_checkpoint(run)[1][0]


def test_atomic_folder_write_keeps_the_old_folder_on_failure_and_cleans_leftovers(tmp_path):
    folder = tmp_path / "out"
    fileio.atomic_write_folder(folder, lambda staging: (staging / "a.txt").write_text("old"))
    (tmp_path / ".out.partial").mkdir()  # left over by a killed earlier write
    (tmp_path / ".out.partial" / "junk").write_text("x")

    def failing(staging):
        (staging / "a.txt").write_text("new, half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        fileio.atomic_write_folder(folder, failing)
    assert (folder / "a.txt").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    fileio.atomic_write_folder(folder, lambda staging: (staging / "b.txt").write_text("new"))
    assert sorted(p.name for p in folder.iterdir()) == ["b.txt"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "out"
    ]


@pytest.mark.parametrize("planted", [".d.gguf.tmp", "d.gguf"])
def test_atomic_write_never_writes_through_a_planted_link(tmp_path, planted):
    """A link planted beside the output (at the old fixed temporary name, or at the output's own name) is neither
    written through nor kept: the victim is untouched and the output is a plain file."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.write_text("precious")
    (out / planted).symlink_to(victim)
    fileio.atomic_write_text(out / "d.gguf", "export")
    assert victim.read_text() == "precious"
    assert not (out / "d.gguf").is_symlink() and (out / "d.gguf").read_text() == "export"
    assert stat.S_IMODE((out / "d.gguf").stat().st_mode) == FILE_MODE


def test_atomic_write_clears_the_leftovers_of_a_killed_write_and_nothing_else(tmp_path):
    """Its own temporaries (`.NAME.<random>.<pid>@<host>.tmp`) of a writer that is gone go; a user's own file that
    merely looks alike stays."""
    import socket
    import subprocess

    ended = subprocess.Popen(["true"])
    ended.wait()
    leftover = tmp_path / f".manifest.json.k1ll3d.{ended.pid}@{socket.gethostname()}.tmp"
    leftover.mkdir()
    (leftover / "manifest.json").write_text("half")
    (tmp_path / ".manifest.json.mine.tmp").write_text("the user's")
    fileio.atomic_write_text(tmp_path / "manifest.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".manifest.json.mine.tmp", "manifest.json"]


def test_two_writers_of_one_path_both_finish_and_the_last_gives_it(tmp_path):
    """A second write of a path while the first is under way (two exports into one folder, two `profile` runs) leaves
    the first's temporary alone: both finish, and the one that finishes last gives the path."""
    file, folder = tmp_path / "d.gguf", tmp_path / "out"

    def first_file(temporary):
        temporary.write_text("first")
        fileio.atomic_write_text(file, "second")

    def first_folder(staging):
        (staging / "a.txt").write_text("first")
        fileio.atomic_write_folder(folder, lambda second: (second / "b.txt").write_text("second"))

    fileio.atomic_write(file, first_file)
    fileio.atomic_write_folder(folder, first_folder)
    assert file.read_text() == "first" and sorted(p.name for p in folder.iterdir()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "out"]


def test_leftovers_are_removed_only_once_their_writer_is_gone(tmp_path):
    import os
    import socket
    import subprocess

    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid names no process now
    host = socket.gethostname()
    names = {
        "gone": f".d.gguf.k1ll3d00.{ended.pid}@{host}.tmp",
        "running": f".d.gguf.w0rk1ng0.{os.getppid()}@{host}.tmp",
        "elsewhere": f".d.gguf.r3m0t300.{ended.pid}@another-{host}.tmp",
        "made up": f".d.gguf.b1gp1d00.{10**30}@{host}.tmp",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    fileio.atomic_write_text(tmp_path / "d.gguf", "new")
    kept = {name for name in names.values() if (tmp_path / name).exists()}
    assert kept == {names["running"], names["elsewhere"]}
    assert (tmp_path / "d.gguf").read_text() == "new"


def test_atomic_folder_write_never_writes_through_planted_links(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in (".out.partial", ".out.previous"):
        (tmp_path / name).symlink_to(victim)
    fileio.atomic_write_folder(tmp_path / "out", lambda staging: (staging / "a.txt").write_text("new"))
    assert not any(victim.iterdir()) and (tmp_path / "out" / "a.txt").read_text() == "new"
