"""`dflash-hf push`: dry runs validate and list files without network; offline / unauthenticated runs fail cleanly."""

from __future__ import annotations

import os
import shutil
import sys

import huggingface_hub
import pytest
from safetensors.torch import load_file, save_file
from testing_utils import make_drafter, make_target

import dflash_hf
from dflash_hf.cli import main as cli_main


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One export per format of a tiny Qwen3 drafter."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    root = tmp_path_factory.mktemp("exports")
    return {
        fmt: dflash_hf.export(drafter, root / fmt, target=target, base_model="Qwen/Qwen3-8B", format=fmt)
        for fmt in ("dflash-hf", "official")
    }


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("fmt", ["dflash-hf", "official"])
def test_dry_run_lists_files_and_sizes(exported, fmt, capsys, monkeypatch):
    folder = exported[fmt]
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda *a, **k: pytest.fail("network used"))
    assert cli_main(["push", str(folder), "me/tiny-dflash", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = [line.split() for line in out[:-1]]
    on_disk = sorted(path for path in os.listdir(folder))
    assert [name for _, name in listed] == on_disk
    assert all(int(size.replace(",", "")) == (folder / name).stat().st_size for size, name in listed)
    total = sum((folder / name).stat().st_size for name in on_disk)
    assert out[-1] == (
        f"{len(on_disk)} files, {total:,d} bytes: a valid DFlash drafter folder. Dry run: nothing uploaded to "
        "me/tiny-dflash."
    )


BREAKAGES = {
    "README.md lacks YAML front matter keys base_model, library_name, pipeline_tag, tags": lambda folder: (
        folder / "README.md"
    ).write_text("# a card without front matter\n"),
    "contains pickled weights (pytorch_model.bin)": lambda folder: (folder / "pytorch_model.bin").write_bytes(b"x"),
    "`auto_map` points at modeling_dflash.py, which is missing": lambda folder: (
        folder / "modeling_dflash.py"
    ).unlink(),
    "model.safetensors is not a readable safetensors file": lambda folder: (folder / "model.safetensors").write_bytes(
        b"truncated"
    ),
    "missing tensors ['norm.weight']": lambda folder: save_file(
        {k: v for k, v in load_file(folder / "model.safetensors").items() if k != "norm.weight"},
        folder / "model.safetensors",
    ),
    "has no config.json": lambda folder: (folder / "config.json").unlink(),
}


@pytest.mark.parametrize("message", list(BREAKAGES))
def test_dry_run_rejects_broken_folders(exported, tmp_path, capsys, message):
    folder = tmp_path / "broken"
    shutil.copytree(exported["dflash-hf"], folder)
    BREAKAGES[message](folder)
    assert cli_main(["push", str(folder), "me/tiny-dflash", "--dry-run"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and message in lines[0], lines


def test_dry_run_argument_errors(exported, tmp_path, capsys):
    assert cli_main(["push", str(tmp_path / "missing"), "me/tiny-dflash", "--dry-run"]) == 2
    assert cli_main(["push", str(exported["dflash-hf"]), "not a repo id", "--dry-run"]) == 2
    assert len(error_lines(capsys.readouterr().err)) == 2


def test_push_offline_is_one_error_line(exported, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda *a, **k: pytest.fail("network used"))
    assert cli_main(["push", str(exported["dflash-hf"]), "me/tiny-dflash"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: cannot push: Hugging Face offline mode is on (HF_HUB_OFFLINE=1); unset it, or use --dry-run to check."
    ]


def test_push_unauthenticated_is_one_error_line(exported, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(sys.modules["dflash_hf.hub.push"], "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda *a, **k: pytest.fail("network used"))
    assert cli_main(["push", str(exported["official"]), "me/tiny-dflash", "--private"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: cannot push: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN."
    ]


def test_network_failure_is_one_error_line(exported, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sys.modules["dflash_hf.hub.push"], "get_token", lambda: "hf_fake")

    def unreachable(*args, **kwargs):
        raise ConnectionError("could not reach huggingface.co\nmore details")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", unreachable)
    assert cli_main(["push", str(exported["dflash-hf"]), "me/tiny-dflash"]) == 1
    assert error_lines(capsys.readouterr().err) == [
        "error: push to me/tiny-dflash failed (ConnectionError): could not reach huggingface.co"
    ]
