"""Mixture-of-experts targets (`qwen3_moe`: Qwen3-Coder-30B-A3B; `gpt_oss`, with sinks and sliding layers;
`minimax_m2`): exact against plain greedy on every candidate source and block size, in left-padded batches with
partial acceptances and EOS inside blocks; sampling exact in distribution; their routers untouched."""

from __future__ import annotations

import pytest
import torch
from testing_utils import (
    MOE_FAMILIES,
    assert_rows_are_greedy,
    chi_square,
    chi_square_bound,
    corrupt_slots,
    exact_joint_of_tokens_2_and_3,
    greedy_reference,
    left_padded,
    make_drafter,
    make_oracle,
    make_target,
    tiny_sampling_target,
)

import dflash_hf
from dflash_hf import DFlashDraftModel
from dflash_hf.random_targets import random_config
from dflash_hf.target.support import SUPPORTED_TARGET_TYPES

PROMPTS = [[5, 7, 3, 9, 4, 6, 8, 10, 3, 11, 13], [6, 6, 4, 12], [11, 3, 5, 7, 9, 4, 20, 21]]
MAX_NEW = 24


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def moe(request):
    target = make_target(request.param)
    references = [greedy_reference(target, torch.tensor([p]), max_new_tokens=MAX_NEW)[0] for p in PROMPTS]
    return request.param, target, references


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup", "tree"])
@pytest.mark.parametrize("block_size", [2, 4, "adaptive"])
def test_moe_targets_are_exact_with_partial_acceptances(moe, candidates, block_size):
    """Oracle drafts with corrupted slots: rows accept different lengths every cycle, every rollback path runs."""
    family, target, references = moe
    assert family in SUPPORTED_TARGET_TYPES
    oracle = make_oracle(target, [r.tolist() for r in references], corrupt=corrupt_slots(3))
    input_ids, mask = left_padded(PROMPTS)
    out = dflash_hf.generate(
        target,
        oracle,
        input_ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        candidates=candidates,
        block_size=block_size,
        return_dict_in_generate=True,
    )
    assert_rows_are_greedy(out.sequences, input_ids.shape[1], PROMPTS, references, (family, candidates, block_size))
    lengths = {n for row in out.accepted_lengths for n in row}
    if block_size != "adaptive":
        assert len(lengths) > 1  # partial acceptances


def test_moe_targets_stop_at_eos_inside_a_block(moe):
    family, target, references = moe
    eos = int(references[0][len(PROMPTS[0]) + 5])  # a token the first row generates mid-answer
    oracle = make_oracle(target, [r.tolist() for r in references])
    input_ids, mask = left_padded(PROMPTS)
    out = dflash_hf.generate(target, oracle, input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    expected = [
        target.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)[0]
        for p in PROMPTS
    ]
    for i, reference in enumerate(expected):
        generated = reference[len(PROMPTS[i]) :]
        assert torch.equal(out[i, input_ids.shape[1] : input_ids.shape[1] + len(generated)], generated), i


def test_moe_drafter_taps_and_routers_untouched(moe):
    """`from_target` reads the MoE config; a call leaves every router and expert weight bit-identical."""
    family, target, _ = moe
    drafter = make_drafter(target)
    assert drafter.config.target_model_type == family and drafter.config.hidden_size == target.config.hidden_size
    before = {name: p.detach().clone() for name, p in target.named_parameters()}
    dflash_hf.generate(target, drafter, torch.tensor([PROMPTS[0]]), max_new_tokens=8)
    assert all(torch.equal(p, before[name]) for name, p in target.named_parameters())


def test_sampling_on_a_moe_target_is_exact_in_distribution():
    """A tiny Qwen3-MoE over 8 ids: tokens 2 and 3 of speculative samples follow plain sampling's joint."""
    target, drafter = tiny_sampling_target("qwen3_moe", moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    prompt = torch.tensor([[1, 2, 3, 4]])
    statistic, cells = chi_square(target, drafter, prompt, exact_joint_of_tokens_2_and_3(target, prompt), "sample")
    assert statistic < chi_square_bound(cells), statistic


@pytest.mark.parametrize(("shape", "model_type"), [("qwen3-coder-30b-a3b", "qwen3_moe"), ("gpt-oss-20b", "gpt_oss")])
def test_real_moe_shapes_and_their_scaled_down_twins(shape, model_type):
    """The public shapes (configs only, nothing built) and their scaled-down twins, which build and run here."""
    config = random_config(f"random:{shape}")
    assert config.model_type == model_type and config.num_hidden_layers in (24, 48)
    twin, _ = dflash_hf.targets.load_target(f"random:tiny-{model_type.replace('_', '-')}", dtype="float32")
    assert twin.config.model_type == model_type
    drafter = make_drafter(twin)
    prompt = torch.tensor([[5, 7, 3, 9]])
    assert torch.equal(
        dflash_hf.generate(twin, drafter, prompt, max_new_tokens=8), greedy_reference(twin, prompt, max_new_tokens=8)
    )


def test_training_and_exports_on_moe_targets(moe, tiny_data, tmp_path):
    """`DFlashTrainer` trains a drafter on a MoE target (its features online), and the drafter exports in the
    dflash-hf and official layouts and loads back."""
    from dflash_hf.trainers import DFlashTrainer
    from testing_utils import tiny_train_config

    family, target, _ = moe
    _, tokenizer, data = tiny_data
    args = tiny_train_config(tmp_path / "run", max_steps=2)
    trainer = DFlashTrainer(args=args, target=target, train_dataset=data, processing_class=tokenizer)
    assert trainer.train().global_step == 2
    for layout in ("dflash-hf", "official"):
        folder = dflash_hf.export(trainer.model, tmp_path / layout, target=target, base_model="org/tiny", format=layout)
        again = DFlashDraftModel.from_pretrained(folder)
        assert again.config.target_model_type == family or layout == "official"
        assert all(torch.equal(again.state_dict()[k], v) for k, v in trainer.model.state_dict().items())
