"""Loading paths that run the checks the CLI runs: bounded drafter configs, weight files inside the folder and of
the dtypes the model holds, bounded lookup branches, EOS ids in any shape, stop strings through `custom_generate`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from testing_utils import make_drafter, make_target, make_tokenizer
from tokenizers import decoders
from transformers import StopStringCriteria

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.cli import main as cli_main


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture
def saved(target, tmp_path):
    folder = tmp_path / "drafter"
    make_drafter(target).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_hidden_layers", 10**6),
        ("intermediate_size", 10**9),
        ("block_size", 10**5),
        ("hidden_size", 2**40),
        ("num_hidden_layers", "5"),
        ("block_size", True),
        ("markov_rank", 10**6),
    ],
)
def test_a_config_json_of_unbounded_sizes_is_refused_on_every_loading_path(saved, key, value):
    config = json.loads((saved / "config.json").read_text())
    config[key] = value
    (saved / "config.json").write_text(json.dumps(config))
    for load in (DFlashConfig.from_pretrained, DFlashDraftModel.from_pretrained):
        with pytest.raises(ValueError, match=key):
            load(saved)


def test_a_config_json_nested_too_deeply_is_a_value_error_on_every_loading_path(saved):
    (saved / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    for load in (DFlashConfig.from_pretrained, DFlashDraftModel.from_pretrained):
        with pytest.raises(ValueError, match=r"config.json is nested too deeply to be a drafter's config"):
            load(saved)


def test_a_shard_index_naming_files_outside_the_folder_is_refused(saved, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    (saved / "model.safetensors").rename(outside)
    for name in ("../elsewhere.safetensors", str(outside)):
        weight_map = {key: name for key in load_file(outside)}
        (saved / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (saved / "placeholder.safetensors").write_bytes(b"")  # the folder still looks like a safetensors checkpoint
        with pytest.raises(ValueError, match="outside its folder"):
            DFlashDraftModel.from_pretrained(saved)
    (saved / "model.safetensors.index.json").unlink()
    (saved / "placeholder.safetensors").unlink()
    (saved / "model.safetensors").symlink_to(outside)  # a link, as in a Hub cache snapshot, is read through
    assert DFlashDraftModel.from_pretrained(saved).config.block_size == 4


def test_integer_weights_are_refused_not_cast(saved):
    tensors = load_file(saved / "model.safetensors")
    name = next(key for key, value in tensors.items() if value.is_floating_point())
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"`{name}` .* has dtype I32, not a floating type"):
        DFlashDraftModel.from_pretrained(saved)


def test_a_trainer_checkpoint_folder_loads_as_a_drafter(saved):
    """Only the weights are checked: a checkpoint's other safetensors files (RNG and optimizer states, with integer
    tensors) stay beside them, as `--drafter runs/x/checkpoint-N` continues training from one."""
    save_file({"rng_state.numpy.1": torch.zeros(4, dtype=torch.int32)}, saved / "rng_state.safetensors")
    save_file({"state.0.step": torch.zeros(1, dtype=torch.int64)}, saved / "optimizer.safetensors")
    assert DFlashDraftModel.from_pretrained(saved).config.block_size == 4


def test_lookup_tokens_are_bounded_before_any_allocation(target, capsys):
    drafter = make_drafter(target)
    ids = torch.randint(3, 64, (1, 6))
    for bad in (10**6, 257, 0):
        with pytest.raises(ValueError, match="lookup_tokens must be an int between 1 and 256"):
            dflash_hf.generate(target, drafter, ids, max_new_tokens=4, lookup_tokens=bad)
    assert cli_main(["generate", "hi", "--lookup-tokens", "1000000", "--max-new-tokens", "2"]) != 0
    assert "--lookup-tokens must be between 1 and 256" in capsys.readouterr().err


@pytest.mark.parametrize("eos", [torch.tensor([2, 5]), torch.tensor([[2], [5]]), torch.tensor(2), [2, 5]])
def test_eos_ids_in_any_shape_plain_generate_takes(target, eos):
    drafter = make_drafter(target)
    ids = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    plain = target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    assert torch.equal(dflash_hf.generate(target, drafter, ids, max_new_tokens=16, eos_token_id=eos), plain)


def test_stop_strings_through_custom_generate_as_a_criterion(target):
    """The documented way through `target.generate(custom_generate=...)`, where Transformers drops the tokenizer."""
    tokenizer = make_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()
    drafter = make_drafter(target)
    ids = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    free = target.generate(ids, max_new_tokens=16, do_sample=False)
    stop = tokenizer.decode(free[0, 9 + 4 : 9 + 6])
    plain = target.generate(ids, max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert plain.shape[1] < free.shape[1]
    ours = target.generate(
        ids,
        max_new_tokens=16,
        do_sample=False,
        stopping_criteria=[StopStringCriteria(tokenizer, [stop])],
        custom_generate=dflash_hf.custom_generate,
        drafter=drafter,
    )
    assert torch.equal(ours, plain)
