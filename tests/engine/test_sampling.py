"""Sampling stays lossless: the drafted-and-verified tokens follow the target's own distribution exactly."""

from __future__ import annotations

import pytest
import torch
from testing_utils import (
    SAMPLING_VOCAB,
    chi_square,
    chi_square_bound,
    exact_joint_of_tokens_2_and_3,
    make_drafter,
    make_target,
    tiny_sampling_models,
)

import dflash_hf
import dflash_hf.engine.token_choice as token_choice
from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.target import adapter


@pytest.fixture(scope="module")
def setup():
    target, drafter = tiny_sampling_models()
    prompt = torch.tensor([[3, 5, 1, 6]])
    return target, drafter, prompt, exact_joint_of_tokens_2_and_3(target, prompt)


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_speculative_sampling_matches_target_distribution(setup, proposal):
    target, drafter, prompt, expected = setup
    statistic, cells = chi_square(target, drafter, prompt, expected, proposal)
    assert statistic < chi_square_bound(cells), statistic


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_reduced_draft_vocabulary_keeps_sampling_lossless(setup, proposal):
    """Tokens outside the draft vocabulary are never proposed, yet the output still follows the target."""
    target, drafter, prompt, expected = setup
    reduced = DFlashDraftModel(DFlashConfig(**{**drafter.config.to_dict(), "draft_vocab_size": 4})).eval()
    reduced.load_state_dict(drafter.state_dict(), strict=False)
    reduced.set_draft_vocabulary([1, 3, 4, 6])
    statistic, cells = chi_square(target, reduced, prompt, expected, proposal)
    assert statistic < chi_square_bound(cells), statistic


def test_argmax_proposal_drafts_point_masses_on_the_argmax(setup, monkeypatch):
    """The deterministic proposal: every drafted token is its slot's argmax and `q` is one-hot on it, while the
    sampled proposal gives full distributions."""
    target, drafter, prompt, _ = setup
    seen = []
    real = token_choice.TokenChoice.propose

    def recording(self, draft_logits, rows):
        tokens, probs = real(self, draft_logits, rows)
        seen.append((draft_logits.argmax(-1), tokens, probs))
        return tokens, probs

    monkeypatch.setattr(token_choice.TokenChoice, "propose", recording)
    rows = prompt.expand(64, -1).contiguous()
    for proposal in ("argmax", "sample"):
        seen.clear()
        torch.manual_seed(0)
        dflash_hf.generate(target, drafter, rows, max_new_tokens=6, do_sample=True, sampling_proposal=proposal)
        argmax, tokens, probs = seen[0]
        if proposal == "argmax":
            assert torch.equal(tokens, argmax)
            assert torch.equal(probs, torch.nn.functional.one_hot(tokens, SAMPLING_VOCAB).float())
        else:
            assert (probs > 0).sum(-1).min() > 1 and not torch.equal(tokens, argmax)
    with pytest.raises(ValueError, match="sampling_proposal must be one of"):
        dflash_hf.generate(target, drafter, prompt, max_new_tokens=4, do_sample=True, sampling_proposal="top")


def test_biased_sampler_is_caught(setup, monkeypatch):
    """Accepting every draft token samples from the drafter, not the target: the same bound must reject it."""
    target, drafter, prompt, expected = setup

    def accept_everything(draft_tokens, draft_probs, target_probs):
        accepted = torch.full((draft_tokens.shape[0],), draft_tokens.shape[1], dtype=torch.long)
        return accepted, torch.multinomial(target_probs[:, -1], 1).squeeze(1)

    monkeypatch.setattr(token_choice, "rejection_sample", accept_everything)
    statistic, cells = chi_square(target, drafter, prompt, expected)
    assert statistic > chi_square_bound(cells), statistic


def test_a_seeded_call_is_reproducible_from_the_first_call_on():
    """Nothing the engine sets up on a target's first call (the prepacked LM head of a float32 CPU target) draws from
    the global generator: the same seed gives the same tokens on the first call as on every later one."""
    adapter._PREPACKED.clear()
    target = make_target("llama", seed=11)
    drafter = make_drafter(target)
    prompt = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    outputs = []
    for _ in range(2):
        torch.manual_seed(7)
        outputs.append(dflash_hf.generate(target, drafter, prompt, max_new_tokens=24, do_sample=True, top_k=20))
    assert torch.equal(outputs[0], outputs[1])
