"""DFlash 2 drafters in the engine: the candidate selector's walk exact against plain greedy on every family, batch
and candidate source; its sampling proposal exact in distribution; the paths it cannot run refused clearly."""

from __future__ import annotations

import pytest
import torch
from testing_utils import (
    SAMPLING_VOCAB,
    assert_rows_are_greedy,
    chi_square,
    chi_square_bound,
    exact_joint_of_tokens_2_and_3,
    greedy_reference,
    left_padded,
    make_target,
    tiny_sampling_models,
)

import dflash_hf
import dflash_hf.engine.token_choice as token_choice
from dflash_hf import DFlashConfig, DFlashDraftModel

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
VOCAB = 12  # small enough that random drafters' blocks are often accepted
MAX_NEW = 20


def make_dflash2_drafter(target_config, seed: int = 1, block_size: int = 4, num_layers: int = 2, **kwargs):
    """A random DFlash 2 drafter whose convolutions and selector are far from their no-op start."""
    torch.manual_seed(seed)
    config = DFlashConfig.from_target(
        target_config,
        num_hidden_layers=num_layers,
        block_size=block_size,
        num_target_features=2,
        **{**DFLASH2, **kwargs},
    )
    drafter = DFlashDraftModel(config).eval()
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                parameter.normal_(0.0, 0.5)
    return drafter


def test_new_dflash2_drafter_starts_as_its_dflash_backbone():
    """Identity convolutions and a zero successor codebook: a new DFlash 2 drafter drafts what the same DFlash
    drafter drafts (a trained DFlash drafter is a valid starting point)."""
    target = make_target("qwen3", vocab_size=VOCAB)
    torch.manual_seed(4)
    plain = DFlashDraftModel(
        DFlashConfig.from_target(target.config, num_hidden_layers=2, block_size=4, num_target_features=2)
    ).eval()
    second = DFlashDraftModel(
        DFlashConfig.from_target(target.config, num_hidden_layers=2, block_size=4, num_target_features=2, **DFLASH2)
    )
    loaded = second.load_state_dict(plain.state_dict(), strict=False)
    assert loaded.missing_keys and not loaded.unexpected_keys
    assert all("conv" in name or "candidate_selector" in name for name in loaded.missing_keys)
    second.eval()
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    runs = [
        dflash_hf.generate(
            target, drafter, prompt, max_new_tokens=MAX_NEW, candidates="dflash", return_dict_in_generate=True
        )
        for drafter in (plain, second)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].accepted_lengths == runs[1].accepted_lengths


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup"])
@pytest.mark.parametrize("block_size", [2, 4, "adaptive"])
def test_dflash2_greedy_is_exact(family, candidates, block_size):
    """Exact against plain greedy for every family, in a left-padded batch of three rows with EOS on."""
    target = make_target(family, vocab_size=VOCAB)
    drafter = make_dflash2_drafter(target.config)
    prompts = [[5, 7, 3, 9, 4, 6, 8, 10], [6, 6, 4], [11, 3, 5, 7, 9]]
    input_ids, mask = left_padded(prompts)
    out = dflash_hf.generate(
        target,
        drafter,
        input_ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        candidates=candidates,
        block_size=block_size,
        return_dict_in_generate=True,
    )
    references = [greedy_reference(target, torch.tensor([prompt]), max_new_tokens=MAX_NEW)[0] for prompt in prompts]
    assert_rows_are_greedy(out.sequences, input_ids.shape[1], prompts, references, (family, candidates, block_size))
    assert max(n for row in out.accepted_lengths for n in row) > 1  # some drafts were accepted


def test_dflash2_greedy_is_exact_compiled():
    """`compile=True` (dynamo's full graph on a counting backend): the convolutions run inside the compiled drafter."""
    from torch._dynamo.testing import CompileCounter
    from transformers import CompileConfig

    class Counter(CompileCounter):
        def __deepcopy__(self, memo):
            return self

    target = make_target("qwen3", vocab_size=VOCAB)
    drafter = make_dflash2_drafter(target.config)
    prompt = torch.tensor([[5, 7, 3, 9, 4, 6, 8, 10]])
    torch._dynamo.reset()
    try:
        config = CompileConfig(backend=Counter(), mode=None, fullgraph=True)
        out = dflash_hf.generate(target, drafter, prompt, max_new_tokens=MAX_NEW, candidates="dflash", compile=config)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, greedy_reference(target, prompt, max_new_tokens=MAX_NEW))


@pytest.fixture(scope="module")
def sampling_setup():
    target, _ = tiny_sampling_models()
    drafter = make_dflash2_drafter(target.config, num_layers=1, conv_group_size=8)
    drafter.candidate_selector.top_k = 3  # fewer candidates than the vocabulary: q leaves tokens out
    prompt = torch.tensor([[1, 2, 3, 4]])
    return target, drafter, prompt, exact_joint_of_tokens_2_and_3(target, prompt)


@pytest.mark.parametrize("proposal", ["sample", "argmax"])
def test_dflash2_sampling_is_exact_in_distribution(sampling_setup, proposal):
    """Each slot drawn from `q = softmax(scores / T)` over its candidates (or the walk's argmax), `q` spread onto the
    candidates' ids verified: the tokens follow the target's own distribution (chi-square on tokens 2 and 3)."""
    target, drafter, prompt, expected = sampling_setup
    statistic, cells = chi_square(target, drafter, prompt, expected, proposal)
    assert statistic < chi_square_bound(cells), statistic


def test_dflash2_verified_against_the_unary_distribution_is_caught(sampling_setup, monkeypatch):
    """Drafts drawn through the selector but verified against the slots' own distributions are biased: the same
    bound rejects them (the distribution test can fail)."""
    target, drafter, prompt, expected = sampling_setup
    real = token_choice.TokenChoice.draft_selected

    def unary_probs(self, draft_logits, anchors, hidden_states):
        tokens, _ = real(self, draft_logits, anchors, hidden_states)
        return tokens, torch.softmax(draft_logits.float() / self.temperature, dim=-1)

    monkeypatch.setattr(token_choice.TokenChoice, "draft_selected", unary_probs)
    statistic, cells = chi_square(target, drafter, prompt, expected, "sample")
    assert statistic > chi_square_bound(cells), statistic
    assert SAMPLING_VOCAB > drafter.candidate_selector.top_k


def test_dflash2_refuses_what_it_cannot_run():
    """Draft trees and Transformers' native path grow or draft each slot's own argmax: refused, naming the fix."""
    target = make_target("qwen3", vocab_size=VOCAB)
    drafter = make_dflash2_drafter(target.config)
    prompt = torch.tensor([[5, 7, 3]])
    with pytest.raises(ValueError, match='candidates="dflash\\+lookup"'):
        dflash_hf.generate(target, drafter, prompt, max_new_tokens=4, candidates="tree")
    with pytest.raises(ValueError, match="custom_generate"):
        target.generate(prompt, assistant_model=drafter, speculation_type="dflash", max_new_tokens=4, do_sample=False)
    same = target.generate(prompt, custom_generate=dflash_hf.custom_generate, drafter=drafter, max_new_tokens=8)
    assert torch.equal(same, greedy_reference(target, prompt, max_new_tokens=8))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"conv_group_size": 24}, "does not divide hidden_size"),
        ({"selector_top_k": VOCAB + 1}, "more candidates than the draft vocabulary"),
        ({"selector_top_k": 0}, "selector_top_k must be an int between 1"),
        ({"selector_rank": 10**9}, "selector_rank must be an int between 1"),
        ({"conv_kernel_size": -2}, "conv_kernel_size must be an int between 1"),
        ({"selector_rank": None}, "lacks selector_rank"),
        ({"markov_rank": 4}, "not a Markov head"),
    ],
)
def test_hostile_dflash2_configs_are_refused(changes, message):
    target = make_target("qwen3", vocab_size=VOCAB)
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_target(
            target.config, num_hidden_layers=2, block_size=4, num_target_features=2, **{**DFLASH2, **changes}
        )
