"""Files, Hub folders and the command line, probed as a user and an attacker would: hostile or damaged folders and
files through the API and the CLI (the exception's or the `error:` line's first line, and the exit code).

A drafter folder pushed or loaded runs its remote code under `trust_remote_code=True`, and the package reads and
deletes the files its indexes name: `push` validates a folder against what `export` writes, every path read or
deleted resolves inside its folder, `export --overwrite` replaces only an earlier export. Everything runs on the tiny
random models of `testing_utils.py`, built offline.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from testing_utils import REPO, WORDS, make_drafter, make_llama, save_tiny_target

import dflash_hf
from dflash_hf import DFlashDraftModel, cli, target_cache
from dflash_hf.data.features import OfflineFeatureDataset
from dflash_hf.data.make import load_training_data
from dflash_hf.data.prompts import load_prompts
from dflash_hf.runtime import available_cpus

PROMPTS = [f"{a} {b} {c}" for a, b, c in zip(WORDS, WORDS[3:], WORDS[6:])][:6]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny target folder, a drafter export for it and damaged or hostile copies of both, by case name."""
    root = tmp_path_factory.mktemp("files")
    llama = make_llama()
    drafter = make_drafter(llama, seed=3, num_layers=1)
    paths = {"root": root, "target": save_tiny_target(root / "target"), "export": root / "export"}
    dflash_hf.export(drafter, paths["export"], target=llama.config, base_model="org/tiny")
    (root / "secret.txt").write_text("a stand-in secret\n")
    for name, damage in FOLDER_DAMAGES.items():
        paths[name] = root / name
        shutil.copytree(paths["export"], paths[name])
        damage(paths[name])
    paths["deep_target"] = root / "deep_target"
    shutil.copytree(paths["target"], paths["deep_target"])
    (paths["deep_target"] / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    paths["prompts"] = root / "prompts.jsonl"
    paths["prompts"].write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    for name, text in PROMPT_FILES.items():  # malformed_json -> malformed.json
        paths[name] = root / name.replace("_", ".")
        paths[name].write_bytes(text)
    return paths


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def _shard_outside(folder: Path) -> None:
    """Weights moved out of the folder, the index pointing at them there."""
    weights = load_file(folder / "model.safetensors")
    shutil.move(folder / "model.safetensors", folder.parent / f"{folder.name}-outside.safetensors")
    weight_map = {name: f"../{folder.name}-outside.safetensors" for name in weights}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _int32_weights(folder: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    save_file({name: t.to(torch.int32) for name, t in weights.items()}, folder / "model.safetensors", {"format": "pt"})


def _executable(folder: Path) -> None:
    (folder / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (folder / "run.sh").chmod(0o755)


FOLDER_DAMAGES = {
    "linked": lambda folder: (folder / "notes.txt").symlink_to(folder.parent / "secret.txt"),
    "auto_map_elsewhere": lambda folder: _edit_config(
        folder, auto_map={"AutoConfig": "configuration_dflash.DFlashConfig", "AutoModel": "evil/repo--x.Model"}
    ),
    "edited_code": lambda folder: (folder / "modeling_dflash.py").write_text(
        (folder / "modeling_dflash.py").read_text() + "\nimport os  # runs under trust_remote_code\n"
    ),
    "extra_python": lambda folder: (folder / "helper.py").write_text("print('runs on import')\n"),
    "executable": _executable,
    "index_outside": _shard_outside,
    "nested": lambda folder: (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000),
    "string_size": lambda folder: _edit_config(folder, hidden_size="32"),
    "int32": _int32_weights,
}
PROMPT_FILES = {
    "malformed_json": json.dumps([{"prompt": "the cat"}, {"prompt": "a dog"}]).encode()[:-1]
    + b', {"prompt": oops}, {"prompt": "sat on"}, {"prompt": "ran far"}]',
    "listed_jsonl": b'{"prompt": "the cat"}\n{"prompt": "a dog"}\n["not", "an", "object"]\n{"prompt": "sat"}\n',
    "latin1_jsonl": '{"prompt": "caf\u00e9"}\n'.encode("latin-1"),
}


def _cli(capsys, argv: list[str]) -> tuple[int, list[str]]:
    """The exit code of `dflash-hf argv` and its `error:` lines (loading bars may precede them on stderr)."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------------------------------------------------------
# push: a folder is exactly what `export` writes (3, 7, 8), drafter folders are read safely (15, 16)

PUSH_CASES = {
    "link to a file outside the folder": ("linked", "{linked} holds links (notes.txt): the files they point at"),
    "auto_map pointing at another repo": (
        "auto_map_elsewhere",
        "{auto_map_elsewhere} is not what `dflash-hf export --format dflash-hf` writes: `auto_map` is",
    ),
    "edited remote code": (
        "edited_code",
        "{edited_code} is not what `dflash-hf export --format dflash-hf` writes: modeling_dflash.py is not the remote "
        "code of this dflash-hf version",
    ),
    "extra python file": (
        "extra_python",
        "{extra_python} is not what `dflash-hf export --format dflash-hf` writes: it holds files an export does not "
        "write (helper.py)",
    ),
    "extra executable file": (
        "executable",
        "{executable} is not what `dflash-hf export --format dflash-hf` writes: it holds files an export does not "
        "write (run.sh)",
    ),
    "weight index pointing outside": (
        "index_outside",
        "{index_outside}/model.safetensors.index.json (a shard) names '../index_outside-outside.safetensors', which "
        "is not a path inside {index_outside}",
    ),
    "config.json nested 100,000 deep": ("nested", "{nested}/config.json is nested too deeply"),
    "non-integer hidden_size": ("string_size", "{string_size}/config.json: `hidden_size` must be a positive integer"),
    "int32 weights": ("int32", "{int32}/model.safetensors holds 14 non-floating-point weight tensors"),
}


@pytest.mark.parametrize("case", list(PUSH_CASES))
def test_push_validation_api(folders, case):
    folder, first = PUSH_CASES[case]
    values = {key: str(path) for key, path in folders.items()}
    with pytest.raises(ValueError) as info:
        dflash_hf.validate_hub_folder(folders[folder])
    assert str(info.value).splitlines()[0].startswith(first.format(**values)), str(info.value)


@pytest.mark.parametrize("case", list(PUSH_CASES))
def test_push_validation_cli(folders, capsys, case):
    folder, first = PUSH_CASES[case]
    values = {key: str(path) for key, path in folders.items()}
    code, err = _cli(capsys, ["push", str(folders[folder]), "me/tiny", "--dry-run"])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + first.format(**values)), err


# ---------------------------------------------------------------------------------------------------------------
# the command line: one error line, exit code 2 (13, 15, 16)

GENERATE = ["generate", "the cat", "--target", "{target}", "--dtype", "float32", "--max-new-tokens", "2"]
CLI_CASES = {
    "--threads above the CPUs": (
        [*GENERATE, "--drafter", "{export}", "--threads", str(available_cpus() + 1)],
        f"error: --threads must be between 1 and {available_cpus()} (the CPUs available to this process), got "
        f"{available_cpus() + 1}.",
    ),
    "--device foo": (
        [*GENERATE, "--drafter", "{export}", "--device", "foo"],
        "error: --device 'foo' is not a device: use cpu, cuda or cuda:N.",
    ),
    "--device of a GPU this machine lacks": (
        [*GENERATE, "--drafter", "{export}", "--device", f"cuda:{torch.cuda.device_count()}"],
        f"error: --device cuda:{torch.cuda.device_count()}: this machine cannot use it (",
    ),
    "non-UTF-8 bytes in the prompt": (
        ["generate", b"the \xff\xfe cat".decode("utf-8", "surrogateescape"), *GENERATE[2:], "--drafter", "{export}"],
        "error: The prompt holds bytes that are not UTF-8 text (at character 4)",
    ),
    "empty prompt without chat template": (
        ["generate", "", *GENERATE[2:], "--drafter", "{export}", "--threads", "1", "--no-chat-template"],
        "error: The prompt '' encodes to no tokens: pass a non-empty prompt",
    ),
    "drafter config.json nested 100,000 deep": (
        [*GENERATE, "--drafter", "{nested}"],
        "error: {nested}/config.json is nested too deeply",
    ),
    "target config.json nested 100,000 deep": (
        ["make-data", "--target", "{deep_target}", "--out", "{root}/deep-out", "--device", "cpu", "--quiet"],
        "error: {deep_target}/config.json is nested too deeply",
    ),
    "non-integer hidden_size": (
        [*GENERATE, "--drafter", "{string_size}"],
        "error: {string_size}/config.json: `hidden_size` must be a positive integer, got '32'",
    ),
    "int32 weights": (
        [*GENERATE, "--drafter", "{int32}"],
        "error: {int32}/model.safetensors holds 14 non-floating-point weight tensors",
    ),
    "export of a missing drafter folder": (
        ["export", "{root}/missing", "{root}/out", "--target", "{target}", "--base-model", "org/tiny"],
        "error: No drafter folder at {root}/missing, and '{root}/missing' is no Hub id (org/name)",
    ),
    "export with a --repo-id that is no repo id": (
        ["export", "{export}", "{root}/out", "--target", "{target}", "--base-model", "org/tiny", "--repo-id", "a b"],
        "error: repo_id 'a b' is not a Hub repo id of the form org/name",
    ),
    "prompt file with a malformed element": (
        ["make-data", "--target", "{target}", "--prompts", "{malformed_json}", "--out", "{root}/m", "--quiet"],
        "error: {malformed_json}: element [2] of the array is not valid JSON",
    ),
    "prompt file with a non-object line": (
        ["make-data", "--target", "{target}", "--prompts", "{listed_jsonl}", "--out", "{root}/l", "--quiet"],
        "error: {listed_jsonl}:3 is a JSON list, not an object",
    ),
    "undecodable prompt file": (
        ["make-data", "--target", "{target}", "--prompts", "{latin1_jsonl}", "--out", "{root}/u", "--quiet"],
        "error: {latin1_jsonl} is not UTF-8 text (invalid continuation byte at byte 15)",
    ),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_cli_input_gives_one_error_line(folders, capsys, case):
    argv, first = CLI_CASES[case]
    values = {key: str(path) for key, path in folders.items()}
    code, err = _cli(capsys, [arg.format(**values) if "{" in arg else arg for arg in argv])
    assert code == 2 and len(err) == 1 and err[0].startswith(first.format(**values)), err


API_CASES = {
    "prompt file with a malformed element": (
        lambda f: load_prompts(str(f["malformed_json"])),
        "{malformed_json}: element [2] of the array is not valid JSON (Expecting value, at character",
    ),
    "prompt file with a non-object line": (
        lambda f: load_prompts(str(f["listed_jsonl"])),
        "{listed_jsonl}:3 is a JSON list, not an object",
    ),
    "undecodable prompt file": (lambda f: load_prompts(str(f["latin1_jsonl"])), "{latin1_jsonl} is not UTF-8 text"),
    "repo id with code in it": (
        lambda f: dflash_hf.export(
            DFlashDraftModel.from_pretrained(f["export"]),
            f["root"] / "snippet",
            target=f["target"],
            base_model="org/tiny",
            repo_id='me/x", trust_remote_code=True)\nimport os  #',
        ),
        "repo_id 'me/x\", trust_remote_code=True)\\nimport os  #' is not a Hub repo id of the form org/name",
    ),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_bad_api_input_is_a_value_error(folders, case):
    call, first = API_CASES[case]
    values = {key: str(path) for key, path in folders.items()}
    with pytest.raises(ValueError) as info:
        call(folders)
    assert str(info.value).splitlines()[0].startswith(first.format(**values)), str(info.value)


def test_metric_strings_cannot_break_the_card_table(folders, tmp_path):
    metrics = [{"tau": 2.0, "speedup": 1.5, "hardware": "AMD | EPYC\n| injected | row |", "date": "2026-01-01"}]
    drafter = DFlashDraftModel.from_pretrained(folders["export"])
    dflash_hf.export(drafter, tmp_path / "card", target=folders["target"], base_model="org/tiny", metrics=metrics)
    card = (tmp_path / "card" / "README.md").read_text().splitlines()
    assert "| 2.00 | 1.50x | AMD \\| EPYC \\| injected \\| row \\| | 2026-01-01 |" in card
    assert not any(line.startswith("| injected") for line in card)


# ---------------------------------------------------------------------------------------------------------------
# export --overwrite replaces only an earlier export (9)

OVERWRITE_CASES = {  # what the folder holds (given the fixture's folders), the first line
    "other runs and notes": (
        lambda out, folders: ((out / "runs").mkdir(), (out / "notes.txt").write_text("mine")),
        "{out} is not an earlier export: overwriting it would delete notes.txt, runs/.",
    ),
    "an earlier export with its git history": (
        lambda out, folders: (shutil.copytree(folders["export"], out, dirs_exist_ok=True), (out / ".git").mkdir()),
        "{out} is not an earlier export: overwriting it would delete .git/.",
    ),
    "a target model folder": (
        lambda out, folders: shutil.copytree(folders["target"], out, dirs_exist_ok=True),
        "{out} is not an earlier export: overwriting it would delete ",  # every file it holds
    ),
}


@pytest.mark.parametrize("case", list(OVERWRITE_CASES))
def test_overwrite_refuses_a_folder_that_is_no_earlier_export(folders, tmp_path, capsys, case):
    fill, first = OVERWRITE_CASES[case]
    out = tmp_path / "out"
    out.mkdir()
    fill(out, folders)
    before = sorted(path.relative_to(out) for path in out.rglob("*"))
    drafter = DFlashDraftModel.from_pretrained(folders["export"])
    with pytest.raises(ValueError) as info:
        dflash_hf.export(drafter, out, target=folders["target"], base_model="org/tiny", overwrite=True)
    assert str(info.value).startswith(first.format(out=out)), str(info.value)
    argv = ["export", str(folders["export"]), str(out), "--target", str(folders["target"]), "--overwrite"]
    code, err = _cli(capsys, [*argv, "--base-model", "org/tiny"])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + first.format(out=out)), err
    assert sorted(path.relative_to(out) for path in out.rglob("*")) == before  # nothing lost


# ---------------------------------------------------------------------------------------------------------------
# features folders: paths inside the folder (4), temporaries of killed writes cleaned (10)


def _make_data(folders: Path, out: str, *extra: str) -> list[str]:
    return [
        "make-data", "--target", str(folders["target"]), "--prompts", str(folders["prompts"]), "--out",
        str(folders["root"] / out), "--max-new-tokens", "3", "--batch-size", "2", "--held-out-fraction", "0",
        "--device", "cpu", "--dtype", "float32", "--quiet", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def captured(folders) -> tuple[list[str], Path]:
    """The `make-data --features-out` command of a made folder, and its features folder."""
    features = folders["root"] / "captured-features"
    argv = _make_data(folders, "captured", "--features-out", str(features), "--target-layer-ids", "0", "2")
    assert cli.main(argv) == 0
    return argv, features


def test_temporaries_of_killed_shard_writes_are_removed_on_the_next_open(folders, captured, capsys):
    """A killed shard write leaves safetensors' own temporary file (up to a whole shard)."""
    argv, features = captured
    (features / ".tmpAb12Cd").write_bytes(b"half a shard")
    assert cli.main(argv) == 0
    assert not (features / ".tmpAb12Cd").exists()
    root = folders["root"]
    cache = ["cache-features", "--target", str(folders["target"]), "--data", str(root / "captured"), "--out"]
    cache += [str(root / "cached"), "--target-layer-ids", "0", "2", "--max-length", "64", "--device", "cpu"]
    cache += ["--dtype", "float32", "--quiet"]
    assert cli.main(cache) == 0
    (root / "cached" / ".tmpZz9Yy8").write_bytes(b"half a shard")
    assert cli.main(cache) == 0
    assert not (root / "cached" / ".tmpZz9Yy8").exists()
    capsys.readouterr()


def test_a_features_index_cannot_name_files_outside_its_folder(folders, captured, capsys):
    """Resuming deletes nothing outside the folder, training reads nothing outside it."""
    argv, features = captured
    root = folders["root"]
    index_text = (features / "index.json").read_text()
    index = json.loads(index_text)
    victim = root / "victim.txt"
    victim.write_text("not a shard")
    end = index["shards"][-1]["end"]
    extra = {"file": "../victim.txt", "start": end, "end": end + 2, "lengths": [3, 3], "fingerprint": "0"}
    try:
        (features / "index.json").write_text(json.dumps({**index, "shards": [*index["shards"], extra]}))
        code, err = _cli(capsys, argv)
        first = f"error: {features}/index.json (a shard) names '../victim.txt', which is not a path inside {features}"
        assert code == 2 and len(err) == 1 and err[0].startswith(first), err
        assert victim.read_text() == "not a shard"

        shutil.copy(features / index["shards"][0]["file"], root / "outside.safetensors")
        outside = {**index["shards"][0], "file": "../outside.safetensors"}
        (features / "index.json").write_text(json.dumps({**index, "shards": [outside, *index["shards"][1:]]}))
        with pytest.raises(ValueError) as info:
            OfflineFeatureDataset(load_training_data(root / "captured"), features)
        assert str(info.value).startswith(first.removeprefix("error: ").replace("victim.txt", "outside.safetensors"))
    finally:
        (features / "index.json").write_text(index_text)


def test_a_target_cache_marker_cannot_name_files_outside_its_folder(tmp_path):
    """A marker listing a file outside the cache folder (its true size and hash) makes the cache invalid, unread."""
    folder, outside = tmp_path / "cache" / "tiny", tmp_path / "secret.txt"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    outside.write_text("a stand-in secret")
    files = {
        name: {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        for name, path in (("config.json", folder / "config.json"), ("../../secret.txt", outside))
    }
    marker = {"format": target_cache.CACHE_FORMAT, "target": "tiny", "files": files}
    (folder / target_cache.MARKER_FILE).write_text(json.dumps(marker))
    spec = target_cache.TargetSpec("tiny", "a stand-in", "no-such-distribution", load_source=None)
    assert target_cache.cache_problem(folder, spec) == "completion marker names '../../secret.txt', outside the folder"


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C during start-up: one line, exit code 130 (15)


def test_ctrl_c_while_the_commands_are_imported_is_one_line(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["generate", "the cat"])
    except KeyboardInterrupt:  # would stop the whole test session
        pytest.fail("Ctrl-C while the sub-commands were imported escaped dflash-hf's main (a traceback)")
    assert code == 130
    assert capsys.readouterr().err.splitlines() == ["error: interrupted"]


INTERRUPT_DURING_IMPORT = """
import sys
class Interrupt:  # Ctrl-C while torch is being imported
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
import dflash_hf_launcher
sys.argv = ["dflash-hf", "generate", "the cat"]
sys.exit(dflash_hf_launcher.main())
"""


def test_ctrl_c_while_torch_is_imported_is_one_line():
    """The console entry point imports nothing heavy itself, so an interrupt inside `import torch` ends like one
    later."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dflash-hf = "dflash_hf_launcher:main"' in pyproject
    probe = "import sys, dflash_hf_launcher; print(sorted({'torch', 'transformers', 'dflash_hf'} & set(sys.modules)))"
    light = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "[]"
    run = subprocess.run([sys.executable, "-c", INTERRUPT_DURING_IMPORT], capture_output=True, text=True)
    assert (run.returncode, run.stderr.splitlines()) == (130, ["error: interrupted"])
