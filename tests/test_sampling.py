"""Sampling stays lossless: the drafted-and-verified tokens follow the target's own distribution exactly."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import dflash_hf
import dflash_hf.engine.generation_call as generation_call
from dflash_hf import DFlashConfig, DFlashDraftModel

VOCAB = 8
TEMPERATURE, TOP_K = 1.3, 6
SAMPLES = 6000


def _tiny_models():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        initializer_range=0.5,
        pad_token_id=0,
        eos_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    torch.manual_seed(1)
    drafter = DFlashDraftModel(
        DFlashConfig.from_target(config, num_hidden_layers=1, block_size=4, num_target_features=2)
    ).eval()
    return target, drafter


def _processed_probs(target, sequences: torch.Tensor) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    with torch.no_grad():
        logits = target(sequences).logits[:, -1].float()
    return torch.softmax(warpers(sequences, logits), dim=-1)


def _exact_joint_of_tokens_2_and_3(target, prompt: torch.Tensor) -> torch.Tensor:
    """P(t2, t3) of plain sampling, summing out t1 (exact enumeration over the vocabulary)."""
    p1 = _processed_probs(target, prompt)[0]
    firsts = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
    p2 = _processed_probs(target, firsts)  # (t1, t2)
    pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
    seconds = torch.cat([prompt.expand(len(pairs), -1), pairs], dim=1)
    p3 = _processed_probs(target, seconds).view(VOCAB, VOCAB, VOCAB)  # (t1, t2, t3)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def _chi_square(target, drafter, prompt, expected: torch.Tensor, proposal: str = "argmax") -> float:
    torch.manual_seed(1234)
    out = dflash_hf.generate(
        target,
        drafter,
        prompt.expand(SAMPLES, -1).contiguous(),
        max_new_tokens=3,
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=1.0,
        sampling_proposal=proposal,
    )
    t2, t3 = out[:, -2], out[:, -1]
    counts = torch.bincount(t2 * VOCAB + t3, minlength=VOCAB * VOCAB).double()
    expected_counts = expected.reshape(-1).double() * SAMPLES
    keep = expected_counts > 5  # standard chi-square validity; the rare cells are pooled
    pooled = torch.cat([counts[keep], counts[~keep].sum()[None]])
    pooled_expected = torch.cat([expected_counts[keep], expected_counts[~keep].sum()[None]])
    return float(((pooled - pooled_expected) ** 2 / pooled_expected.clamp_min(1e-9)).sum()), int(keep.sum())


def _bound(cells: int) -> float:
    dof = cells  # pooled cell included, minus one constraint
    return dof + 5 * (2 * dof) ** 0.5


@pytest.fixture(scope="module")
def setup():
    target, drafter = _tiny_models()
    prompt = torch.tensor([[3, 5, 1, 6]])
    return target, drafter, prompt, _exact_joint_of_tokens_2_and_3(target, prompt)


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_speculative_sampling_matches_target_distribution(setup, proposal):
    target, drafter, prompt, expected = setup
    statistic, cells = _chi_square(target, drafter, prompt, expected, proposal)
    assert statistic < _bound(cells), statistic


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_reduced_draft_vocabulary_keeps_sampling_lossless(setup, proposal):
    """Tokens outside the draft vocabulary are never proposed, yet the output still follows the target."""
    target, drafter, prompt, expected = setup
    reduced = DFlashDraftModel(DFlashConfig(**{**drafter.config.to_dict(), "draft_vocab_size": 4})).eval()
    reduced.load_state_dict(drafter.state_dict(), strict=False)
    reduced.set_draft_vocabulary([1, 3, 4, 6])
    statistic, cells = _chi_square(target, reduced, prompt, expected, proposal)
    assert statistic < _bound(cells), statistic


def test_argmax_proposal_drafts_point_masses_on_the_argmax(setup, monkeypatch):
    """The deterministic proposal: every drafted token is its slot's argmax and `q` is one-hot on it, while the
    sampled proposal gives full distributions."""
    target, drafter, prompt, _ = setup
    seen = []
    real = generation_call.GenerationCall._propose

    def recording(self, draft_logits, rows):
        tokens, probs = real(self, draft_logits, rows)
        seen.append((draft_logits.argmax(-1), tokens, probs))
        return tokens, probs

    monkeypatch.setattr(generation_call.GenerationCall, "_propose", recording)
    rows = prompt.expand(64, -1).contiguous()
    for proposal in ("argmax", "sample"):
        seen.clear()
        torch.manual_seed(0)
        dflash_hf.generate(target, drafter, rows, max_new_tokens=6, do_sample=True, sampling_proposal=proposal)
        argmax, tokens, probs = seen[0]
        if proposal == "argmax":
            assert torch.equal(tokens, argmax)
            assert torch.equal(probs, torch.nn.functional.one_hot(tokens, VOCAB).float())
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

    monkeypatch.setattr(generation_call, "rejection_sample", accept_everything)
    statistic, cells = _chi_square(target, drafter, prompt, expected)
    assert statistic > _bound(cells), statistic
