"""The Qwen2.5-Coder named targets: chunk assembly (pinned versions, size and sha256), and with the `qwen` extra
installed the real 0.5B model: its tokenizer's spare rows, a drafter built for its config, exact greedy decoding
against it, and llama.cpp's refusal of a qwen2 target."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from testing_utils import REPO
from transformers import AutoConfig, AutoTokenizer

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel, fileio, targets
from dflash_hf.gguf_chunks import ChunkedGGUF

QWEN = "qwen2.5-coder-0.5b"


def _install_chunks(site: Path, chunks: list[bytes], version: str = "1.0.0", skip: int | None = None) -> None:
    """Fake chunk packages `fakechunkN` (module `fakechunk_N`, file data/partNN.bin) installed in `site`."""
    for n, data in enumerate(chunks, start=1):
        if n == skip:
            continue
        package = site / f"fakechunk_{n}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{n:02d}.bin").write_bytes(data)
        info = site / f"fakechunk{n}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakechunk{n}\nVersion: {version}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def _spec(chunks: list[bytes]) -> ChunkedGGUF:
    whole = b"".join(chunks)
    digest = hashlib.sha256(whole).hexdigest()
    return ChunkedGGUF.numbered("model.gguf", "fakechunk", "fakechunk_", len(chunks), "1.0.0", len(whole), digest, "x")


CHUNKS = [b"GGUF" + bytes(range(200)), bytes(range(256)) * 3, b"tail"]


def test_chunks_assemble_into_the_checked_file(site, tmp_path):
    _install_chunks(site, CHUNKS)
    path = _spec(CHUNKS).assemble(tmp_path / "out", progress=False)
    assert path.read_bytes() == b"".join(CHUNKS)
    written = path.stat().st_mtime_ns, path.stat().st_ino
    assert _spec(CHUNKS).assemble(tmp_path / "out", progress=False) == path
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == written  # an intact file is reused, not rewritten


@pytest.mark.parametrize(
    ("install", "message"),
    [
        (dict(skip=2), r"Part 2 of 3 of model.gguf is missing \(package `fakechunk2`"),
        (dict(version="1.0.1"), r"Part 1 of model.gguf is `fakechunk1` 1.0.1, not the pinned 1.0.0"),
        (dict(chunks=[CHUNKS[0], CHUNKS[1][:-1], CHUNKS[2]]), "add up to"),
        (dict(chunks=[CHUNKS[0], CHUNKS[1][:-1] + b"!", CHUNKS[2]]), "assemble to sha256"),
    ],
    ids=["missing part", "other version", "short chunk", "altered chunk"],
)
def test_assembly_refuses_wrong_or_missing_parts(site, tmp_path, install, message):
    _install_chunks(site, install.pop("chunks", CHUNKS), **install)
    with pytest.raises(ValueError, match=message) as info:
        _spec(CHUNKS).assemble(tmp_path / "out", progress=False)
    assert "pip install" in str(info.value)
    assert not (tmp_path / "out" / "model.gguf").exists()


def test_qwen_targets_are_registered_with_pinned_chunks():
    for name, count in ((QWEN, 6), ("qwen2.5-coder-1.5b", 22)):
        spec = targets.TARGETS[name]
        chunks = targets.QWEN_CODER_GGUFS[name]
        assert len(chunks.parts) == count and spec.hub_id.startswith("Qwen/Qwen2.5-Coder-")
        assert spec.distribution == chunks.parts[0].distribution
    pyproject = (REPO / "pyproject.toml").read_text()
    for chunks in targets.QWEN_CODER_GGUFS.values():
        assert all(f'"{requirement}"' in pyproject for requirement in chunks.requirements())


# ----------------------------------------------------------------------------------------- the real 0.5B model


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory) -> Path:
    """The assembled Qwen2.5-Coder-0.5B-Instruct GGUF (the `qwen` extra)."""
    if targets.TARGETS[QWEN].source_version() is None:
        message = 'the `qwen` extra (`pip install "dflash-hf[qwen]"`) is not installed'
        if os.environ.get("DFLASH_HF_REQUIRE_REAL_TARGETS") == "1":  # CI: never skip silently
            pytest.fail(message)
        pytest.skip(message)
    return targets.TARGETS[QWEN].gguf_file(tmp_path_factory.mktemp("qwen"))


def test_real_tokenizer_puts_the_mask_token_on_the_first_spare_row(qwen_gguf):
    tokenizer = AutoTokenizer.from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name)
    config = AutoConfig.from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name)
    assert len(tokenizer) == config.vocab_size == 151936  # the GGUF lists every row, spare ones as [PADn]
    assert tokenizer.convert_ids_to_tokens([151664, 151665]) == ["<|file_sep|>", "[PAD151665]"]
    drafter_config = DFlashConfig.from_target(config, num_hidden_layers=1, block_size=4, tokenizer=tokenizer)
    assert drafter_config.mask_token_id == 151665
    assert drafter_config.target_model_type == "qwen2" and drafter_config.num_target_layers == 24
    assert (drafter_config.hidden_size, drafter_config.num_attention_heads, drafter_config.num_key_value_heads) == (
        896,
        14,
        2,
    )
    assert drafter_config.rope_parameters["rope_theta"] == 1e6


def test_llama_cpp_export_refuses_a_qwen2_target(qwen_gguf, tmp_path):
    config = AutoConfig.from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name)
    drafter = DFlashDraftModel(DFlashConfig.from_target(config, num_hidden_layers=1, block_size=4))
    with pytest.raises(ValueError, match="cannot run on a 'qwen2' target: its graph does not expose the layer inputs"):
        dflash_hf.export(drafter, tmp_path / "out" / "d.gguf", target=qwen_gguf, format="gguf")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_real_qwen_target_is_exact_with_every_candidate_shape(qwen_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(fileio.CACHE_ENV, str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        target, tokenizer = targets.load_target(QWEN)
        assert target.config.model_type == "qwen2" and not target.config.tie_word_embeddings
        torch.manual_seed(0)
        config = DFlashConfig.from_target(target.config, num_hidden_layers=1, block_size=4, tokenizer=tokenizer)
        drafter = DFlashDraftModel(config).eval()
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        plain = target.generate(**ids, max_new_tokens=12, do_sample=False)
        assert "reverse" in tokenizer.decode(plain[0, ids["input_ids"].shape[1] :])  # a sensible answer
        for candidates in ("dflash", "dflash+lookup", "tree"):
            ours = dflash_hf.generate(target, drafter, **ids, max_new_tokens=12, candidates=candidates)
            assert torch.equal(ours, plain), candidates
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("blocker", ["folder at the file's name", "file at the folder's name"])
def test_assembly_into_an_unwritable_destination_names_it_and_the_fix(site, tmp_path, blocker):
    """A destination that cannot be written is a `ValueError` naming it and the fix, not a bare `OSError`."""
    _install_chunks(site, CHUNKS)
    out = tmp_path / "out"
    if blocker == "folder at the file's name":
        (out / "model.gguf").mkdir(parents=True)
    else:
        out.write_bytes(b"not a folder")
    with pytest.raises(ValueError, match=r"Cannot write .*model.gguf .*must be a writable folder") as info:
        _spec(CHUNKS).assemble(out, progress=False)
    assert "DFLASH_HF_CACHE" in str(info.value)
    assert not any(path.name.startswith(".model.gguf.") for path in tmp_path.rglob("*"))  # no temporary left


def test_a_wrong_file_or_link_at_the_destination_is_replaced_never_written_through(site, tmp_path):
    _install_chunks(site, CHUNKS)
    whole = b"".join(CHUNKS)
    out, elsewhere = tmp_path / "out", tmp_path / "precious"
    out.mkdir()
    (out / "model.gguf").write_bytes(b"X" * len(whole))  # the right size, another content
    assert _spec(CHUNKS).assemble(out, progress=False).read_bytes() == whole
    elsewhere.write_bytes(b"keep me")
    (out / "model.gguf").unlink()
    (out / "model.gguf").symlink_to(elsewhere)
    path = _spec(CHUNKS).assemble(out, progress=False)
    assert path.read_bytes() == whole and not path.is_symlink() and elsewhere.read_bytes() == b"keep me"
