"""Loading bad checkpoints gives one clear `ValueError` naming the problem, never a silently broken drafter."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file
from testing_utils import make_drafter, make_target
from transformers import Qwen3Config

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A valid drafter folder for a tiny Qwen3 target; tests copy and break it."""
    folder = tmp_path_factory.mktemp("valid")
    make_drafter(make_target("qwen3")).save_pretrained(folder)
    return folder


def broken_copy(saved, tmp_path, edit_tensors=None, edit_config=None):
    """Copy of `saved` with its tensors and/or config.json edited."""
    tensors = load_file(saved / "model.safetensors")
    config = json.loads((saved / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_valid_checkpoint_loads(saved):
    assert DFlashDraftModel.from_pretrained(saved).config.target_layer_ids == [1, 3]


def test_missing_tensor(saved, tmp_path):
    folder = broken_copy(saved, tmp_path, edit_tensors=lambda t: t.pop("layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.mlp.down_proj.weight'\]"):
        DFlashDraftModel.from_pretrained(folder)


def test_wrong_shape(saved, tmp_path):
    folder = broken_copy(saved, tmp_path, edit_tensors=lambda t: t.update({"fc.weight": torch.zeros(64, 192)}))
    with pytest.raises(ValueError, match=r"`fc.weight` has shape \(64, 192\) in the checkpoint but \(64, 128\)"):
        DFlashDraftModel.from_pretrained(folder)


def test_prefixed_tensor_names(saved, tmp_path):
    def prefix(tensors):
        for name in list(tensors):
            tensors[f"model.{name}"] = tensors.pop(name)

    with pytest.raises(ValueError, match=r"unexpected tensors \['model.fc.weight'.*unprefixed names"):
        DFlashDraftModel.from_pretrained(broken_copy(saved, tmp_path, edit_tensors=prefix))


def test_unknown_model_type(saved, tmp_path):
    bert = {"model_type": "bert", "architectures": ["BertModel"]}
    folder = broken_copy(saved, tmp_path, edit_config=lambda config: config.update(bert))
    with pytest.raises(ValueError, match="model_type `bert`, which is not a DFlash drafter"):
        DFlashDraftModel.from_pretrained(folder)
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        DFlashConfig.from_dict(Qwen3Config().to_dict())


def test_config_without_target_layer_ids(saved, tmp_path):
    folder = broken_copy(saved, tmp_path, edit_config=lambda c: c.pop("target_layer_ids"))
    with pytest.raises(ValueError, match="no `target_layer_ids`.*cannot be guessed"):
        DFlashDraftModel.from_pretrained(folder)


class _Exploit:
    """Unpickling this object would create a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_weights_are_refused_unopened(saved, tmp_path):
    marker = tmp_path / "unpickled"
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    with open(tmp_path / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"fc.weight": _Exploit(marker)}, handle)
    with pytest.raises(ValueError, match=r"only pickled weights \(pytorch_model.bin\).*never unpickled"):
        DFlashDraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safetensors only"):
        DFlashDraftModel.from_pretrained(saved, use_safetensors=False)
    assert not marker.exists()


def test_hidden_size_mismatch_with_target(saved, tmp_path):
    drafter = DFlashDraftModel.from_pretrained(saved)  # built for a hidden size of 64
    other = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    target = make_target("qwen3")
    target_32 = type(target)(other).eval()
    with pytest.raises(ValueError, match="hidden size 64 does not match the target's 32"):
        dflash_hf.generate(target_32, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="hidden size 64 does not match the target's 32"):
        dflash_hf.export(drafter, tmp_path / "out", target=other, base_model="Qwen/Qwen3-8B")
    assert not (tmp_path / "out").exists()
