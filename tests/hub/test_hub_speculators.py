"""The speculators layout (vLLM): what its DFlash model reads, reduced draft vocabulary included.

The run against speculators itself (its `DFlashDraftModel` giving our block logits) is `examples/interop/`, which needs
a separate environment; these tests check the written folder against the format it reads.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from testing_utils import make_drafter, make_target

import dflash_hf
from dflash_hf.hub.speculators import config_from_speculators
from dflash_hf.target.adapter import TargetAdapter

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def reduced_pair():
    target = make_target("llama")
    drafter = make_drafter(target, draft_vocab_size=24)
    drafter.set_draft_vocabulary(
        torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(3))[:24]
    )
    return target, drafter


def export(drafter, folder, target):
    return dflash_hf.export(drafter, folder, target=target, base_model=BASE_MODEL, format="speculators")


def test_speculators_config_is_what_its_dflash_model_reads(reduced_pair, tmp_path):
    target, drafter = reduced_pair
    folder = export(drafter, tmp_path / "spec", target)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["draft_vocab_size"] == 24
    assert config["transformer_layer_config"]["vocab_size"] == target.config.vocab_size  # the target's, not the draft
    assert config["transformer_layer_config"]["num_hidden_layers"] == drafter.config.num_hidden_layers
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.config.target_layer_ids]
    assert config["block_size"] == drafter.config.block_size
    assert config["mask_token_id"] == drafter.config.mask_token_id
    assert config["speculators_config"]["verifier"]["name_or_path"] == BASE_MODEL
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.config.block_size - 1
    back = config_from_speculators(config)
    for key in ("target_layer_ids", "block_size", "mask_token_id", "draft_vocab_size", "vocab_size", "hidden_size"):
        assert getattr(back, key) == getattr(drafter.config, key), key
    assert "speculators" in (folder / "README.md").read_text()
    dflash_hf.validate_hub_folder(folder)


def test_reduced_vocabulary_drafts_the_same_target_tokens(reduced_pair, tmp_path):
    """`lm_head` rows, `d2t` offsets and the `t2d` mask as speculators/vLLM read them: projecting a draft hidden state
    with the stored head and mapping the argmax through `d2t` gives the token our engine drafts."""
    target, drafter = reduced_pair
    tensors = load_file(export(drafter, tmp_path / "spec", target) / "model.safetensors")
    ids = drafter.draft_token_ids
    assert torch.equal(tensors["d2t"] + torch.arange(24), ids)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    assert torch.equal(tensors["lm_head.weight"], target.get_output_embeddings().weight.detach()[ids])
    body = {k: v for k, v in drafter.state_dict().items() if k != "d2t"}
    assert all(torch.equal(tensors[k], v) for k, v in body.items())
    hidden = torch.randn(7, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    served = (hidden @ tensors["lm_head.weight"].T).argmax(-1)
    served_tokens = served + tensors["d2t"][served]
    ours = ids[TargetAdapter.for_drafter(target, drafter).logits(hidden, ids).argmax(-1)]
    assert torch.equal(served_tokens, ours)


def test_full_vocabulary_drafter_stores_only_the_body(tmp_path):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    folder = export(drafter, tmp_path / "spec", target)
    config = json.loads((folder / "config.json").read_text())
    assert config["draft_vocab_size"] == target.config.vocab_size
    assert set(load_file(folder / "model.safetensors")) == set(drafter.state_dict())
    dflash_hf.validate_hub_folder(folder)


def test_inconsistent_vocabulary_mapping_is_refused(reduced_pair, tmp_path):
    target, drafter = reduced_pair
    folder = export(drafter, tmp_path / "spec", target)
    tensors = load_file(folder / "model.safetensors")
    t2d = tensors["t2d"].clone()
    t2d[t2d.nonzero()[0]] = False
    t2d[(~tensors["t2d"]).nonzero()[0]] = True
    save_file({**tensors, "t2d": t2d}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="t2d"):
        dflash_hf.validate_hub_folder(folder)
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="missing lm_head.weight"):
        dflash_hf.validate_hub_folder(folder)


def test_targets_speculators_cannot_express_are_refused(tmp_path):
    gemma = make_target("gemma3")
    with pytest.raises(ValueError, match="scaled input embedding"):
        export(make_drafter(gemma), tmp_path / "gemma", gemma)
    llama = make_target("llama")
    last = llama.config.num_hidden_layers - 1
    with pytest.raises(ValueError, match="last layer"):
        export(make_drafter(llama, target_layer_ids=[1, last]), tmp_path / "last", llama)
    with pytest.raises(ValueError, match="target's weights"):
        export(make_drafter(llama), tmp_path / "config-only", llama.config)
    dflash2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    with pytest.raises(ValueError, match="no DFlash 2"):
        export(make_drafter(llama, **dflash2), tmp_path / "dflash2", llama)
    for layout in (
        dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
        dict(is_causal=True),
        dict(output_multiplier=0.5),
        dict(input_embedding_scale=2.0),
        dict(final_logit_softcapping=10.0),
    ):
        with pytest.raises(ValueError, match="no sliding-window or block-causal draft layers"):
            export(make_drafter(llama, **layout), tmp_path / "layout", llama)
    assert not any(tmp_path.iterdir())
