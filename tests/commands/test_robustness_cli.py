"""Hardening of the CLI commands (issue 41), probed as a user would: `push` refuses a folder whose config or weights
an export never writes, `train --seed` decides the new drafter's weights, and bad input to `results-doc`, `train
--config`, `cache-features`, `export` and `make-data` is one `error:` line and a non-zero exit; `--quiet` shows no
progress bar.

Everything runs offline on the tiny random models of `testing_utils.py`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch
from dflash_hf.trainers import drafter as drafter_module
from safetensors.torch import load_file, save_file
from testing_utils import make_drafter, make_target, make_tokenizer, save_tiny_target, tiny_train_config, write_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

import dflash_hf
from dflash_hf import cli, fileio, targets
from dflash_hf.data import make as data_module
from dflash_hf.hub.push import MAX_CONFIG_BYTES
from dflash_hf.targets import TargetSpec


def _cli(capsys, argv: list[str]) -> tuple[int, str, list[str]]:
    """`(exit code, stdout, the error lines)` of `dflash-hf argv`, once no traceback is known to be printed."""
    code = cli.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out, [line for line in captured.err.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny target folder (`target`), a drafter saved for it (`drafter`), its export (`export`) and a prompts
    file (`prompts.jsonl`)."""
    root = tmp_path_factory.mktemp("robust-cli")
    target_folder = save_tiny_target(root / "target")
    target = AutoModelForCausalLM.from_pretrained(target_folder)
    drafter = make_drafter(target, num_layers=1)
    drafter.save_pretrained(root / "drafter")
    dflash_hf.export(drafter, root / "export", target=target.config, base_model="org/tiny")
    write_prompts(root / "prompts.jsonl", prompts=["the cat sat", "a dog ran", "the bird flew"])
    return root


# ---------------------------------------------------------------------------------------------------------------
# push: what an export never writes is refused before anything is uploaded


def _broken_export(root: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(root / "export", folder)
    return folder


def _edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}, indent=2))


def test_push_refuses_changed_architectures(root, tmp_path, capsys, monkeypatch):
    folder = _broken_export(root, tmp_path)
    _edit_config(folder, architectures=["LlamaForCausalLM"])
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda *a, **k: pytest.fail("network used"))
    code, _, errors = _cli(capsys, ["push", folder, "me/tiny", "--dry-run"])
    assert code == 2 and len(errors) == 1, errors
    assert "`architectures` is ['LlamaForCausalLM'], an export writes ['DFlashDraftModel']" in errors[0]


def test_push_refuses_an_oversized_config(root, tmp_path, capsys, monkeypatch):
    folder = _broken_export(root, tmp_path)
    _edit_config(folder, padding="x" * MAX_CONFIG_BYTES)  # an unknown key, loadable but no export's
    size = (folder / "config.json").stat().st_size
    monkeypatch.setattr(sys.modules["dflash_hf.hub.push"], "read_config_dict", lambda *a: pytest.fail("read"))
    code, _, errors = _cli(capsys, ["push", folder, "me/tiny", "--dry-run"])
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: {folder}/config.json is {size:,d} bytes, more than the 1,048,576 bytes")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_push_refuses_non_finite_weights_before_uploading(root, tmp_path, capsys, monkeypatch, value):
    folder = _broken_export(root, tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["fc.weight"][0, 0] = value
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sys.modules["dflash_hf.hub.push"], "get_token", lambda: "hf_fake")
    for method in ("create_repo", "create_branch", "upload_folder"):
        monkeypatch.setattr(huggingface_hub.HfApi, method, lambda *a, **k: pytest.fail("uploaded"))
    for extra in (["--dry-run"], []):
        code, _, errors = _cli(capsys, ["push", folder, "me/tiny", *extra])
        assert code == 2 and len(errors) == 1, errors
        assert errors[0].startswith(
            f"error: {folder}/model.safetensors: tensor `fc.weight` holds 1 NaN or infinite values"
        ), errors


# ---------------------------------------------------------------------------------------------------------------
# train --seed: the new drafter is built under the run's seed


def _new_drafter(tmp_path: Path, target, seed: int, model=None, **overrides) -> dict[str, torch.Tensor]:
    """The weights of the drafter `dflash-hf train` would start from (`DFlashTrainer`'s `resolve_drafter`)."""
    config = tiny_train_config(tmp_path / f"run-{seed}", seed=seed, **overrides)
    drafter, _ = drafter_module.resolve_drafter(model, config, target, None, make_tokenizer())
    return drafter.state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_train_seed_decides_the_new_drafters_weights(tmp_path):
    target = make_target("llama")
    first = _new_drafter(tmp_path, target, 0)
    torch.manual_seed(1234)  # whatever the process did before, the seed decides
    assert _same(first, _new_drafter(tmp_path, target, 0))
    assert not _same(first, _new_drafter(tmp_path, target, 1))


def test_train_seed_decides_a_new_markov_head(tmp_path):
    target = make_target("llama")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    start = str(tmp_path / "drafter")
    first = _new_drafter(tmp_path, target, 0, model=start, markov_rank=4)
    torch.manual_seed(1234)
    assert _same(first, _new_drafter(tmp_path, target, 0, model=start, markov_rank=4))
    assert not _same(first, _new_drafter(tmp_path, target, 1, model=start, markov_rank=4))


# ---------------------------------------------------------------------------------------------------------------
# bad input: one error line, a non-zero exit, nothing written


def test_results_doc_of_a_deeply_nested_bench_json(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "bench.json").write_text("[" * 100_000 + "]" * 100_000)
    code, _, errors = _cli(capsys, ["results-doc", tmp_path, "--out", tmp_path / "results.md"])
    assert code == 2 and errors == [
        f"error: {tmp_path}/run/bench.json is nested too deeply to be a JSON file this package writes: rerun "
        "`dflash-hf bench`."
    ]
    assert not (tmp_path / "results.md").exists()


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"block_size: [16\nlearning_rate: {", "while parsing a flow sequence"),
        (b"\xff\xfe block_size", "codec can't decode"),
    ],
    ids=["malformed", "not-utf-8"],
)
def test_train_with_a_malformed_recipe(tmp_path, capsys, content, problem):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(content)
    code, _, errors = _cli(capsys, ["train", "--config", recipe, "--output_dir", tmp_path / "run"])
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: --config {recipe} is not a valid YAML file (") and problem in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("shard_mb", ["0", "-1"])
def test_cache_features_refuses_shards_of_no_size(tmp_path, capsys, monkeypatch, shard_mb):
    monkeypatch.setattr(data_module, "load_training_data", lambda *a: pytest.fail("data read"))
    argv = [
        "cache-features",
        "--target",
        "t",
        "--data",
        tmp_path / "d",
        "--out",
        tmp_path / "f",
        "--shard-mb",
        shard_mb,
    ]
    code, _, errors = _cli(capsys, argv)
    assert code == 2 and errors == [f"error: --shard-mb must be >= 1 (MiB of features per shard file), got {shard_mb}."]
    assert not (tmp_path / "f").exists()


def test_export_refuses_a_gguf_type_without_gguf_format(root, tmp_path, capsys):
    argv = ["export", root / "drafter", tmp_path / "out", "--target", root / "target", "--base-model", "org/tiny"]
    code, _, errors = _cli(capsys, [*argv, "--gguf-type", "q8_0"])
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(
        "error: gguf_type (`--gguf-type`) 'q8_0' applies to format='gguf' only, not to 'dflash-hf'"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="applies to format='gguf' only, not to 'official'"):
        dflash_hf.export(
            make_drafter(make_target("qwen3")), tmp_path / "o", target="x", format="official", gguf_type="f16"
        )
    assert _cli(capsys, [*argv, "--format", "official"])[0] == 0  # without the flag: the same export goes through


def test_make_data_without_any_sample_fails(root, tmp_path, capsys):
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"the cat {i}"}]} for i in range(3)]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["make-data", "--target", root / "target", "--prompts", source, "--out", tmp_path / "data"]
    code, out, errors = _cli(capsys, [*argv, "--responses", "source", "--held-out-fraction", "0", "--quiet"])
    assert code == 2 and out == "", out
    assert errors == [
        f"error: make-data made no training sample in {tmp_path / 'data'}: --prompts {source} gave 3 train "
        "prompt(s), of which 3 had no reply in the source; use a source whose conversations hold the replies, or "
        "--responses regenerate."
    ]


# ---------------------------------------------------------------------------------------------------------------
# --quiet: no progress bar, also of a named target's cache build, the model load and the dataset save


@pytest.fixture
def named_target(root, tmp_path, monkeypatch) -> str:
    """A named target `tiny-quiet` (a fresh cache, built from the tiny target folder on first load)."""
    monkeypatch.setenv(fileio.CACHE_ENV, str(tmp_path / "cache"))

    def load_source(scratch: Path):
        return AutoModelForCausalLM.from_pretrained(root / "target"), AutoTokenizer.from_pretrained(root / "target")

    monkeypatch.setitem(targets.TARGETS, "tiny-quiet", TargetSpec("tiny-quiet", "tiny", "pytest", load_source))
    return "tiny-quiet"


def test_quiet_commands_show_no_progress_bar(root, named_target, tmp_path, capsys):
    data, features = tmp_path / "data", tmp_path / "features"
    make = ["make-data", "--target", named_target, "--prompts", root / "prompts.jsonl", "--out", data]
    cache = ["cache-features", "--target", named_target, "--data", data, "--out", features]
    for argv in (
        [*make, "--max-new-tokens", "4", "--held-out-fraction", "0", "--quiet"],
        [*cache, "--target-layer-ids", "1", "3", "--device", "cpu", "--quiet"],
    ):
        assert cli.main([str(arg) for arg in argv]) == 0
    err = capsys.readouterr().err
    assert (fileio.cache_dir() / "targets" / named_target).is_dir()  # the cache was built, silently
    assert "it/s" not in err and "%|" not in err, err
    # the libraries' own settings are back once the command is done
    assert hf_logging.is_progress_bar_enabled() and not datasets.are_progress_bars_disabled()
    assert not huggingface_hub.utils.are_progress_bars_disabled()


def test_train_on_a_random_target_asks_for_its_hub_id_without_calling_it_a_folder(tmp_path, capsys):
    argv = ["train", "--target", "random:tiny-qwen3", "--data", tmp_path, "--output_dir", tmp_path / "run"]
    code, _, errors = _cli(capsys, argv)
    assert code == 2 and len(errors) == 1, errors
    assert "names no Hub id (a local folder or a random target): pass --base_model org/name" in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path: os.mkfifo(path), "is not a regular file"),
        (lambda path: path.write_text("a: " + "[" * 20_000 + "]" * 20_000), "nested too deeply|not a valid YAML"),
        (lambda path: path.write_text("target: x\n" + "#" * (2 << 20)), "is larger than"),
        (lambda path: path.write_text("- a\n- b\n"), "holds no mapping"),
    ],
    ids=["fifo", "nested", "huge", "a list"],
)
def test_train_config_is_read_as_every_settings_file(tmp_path, capsys, make, message):
    cli_main = cli.main
    """`train --config` (and `--config=FILE`) goes through the same bounded reader as the other commands: one error
    line, no blocked read, no traceback."""
    recipe = tmp_path / "recipe.yaml"
    make(recipe)
    for argv in (["train", "--config", str(recipe)], ["train", f"--config={recipe}"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --config") and re.search(message, err[0]), err
    assert cli_main(["train", "--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "b.yaml")]) == 2
    assert "more than once" in capsys.readouterr().err
