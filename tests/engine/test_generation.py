"""Losslessness of DFlash generation: exact token equality with plain greedy decoding in fp32, every family."""

from __future__ import annotations

import pytest
import torch
from testing_utils import (
    GEMMA_SLIDING_WINDOW,
    assert_rows_are_greedy,
    corrupt_slots,
    greedy_reference,
    left_padded,
    make_drafter,
    make_oracle,
    make_target,
    strip,
)
from transformers import TextStreamer

import dflash_hf

MAX_NEW = 24


def _prompt(seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (1, length), generator=generator)


def _native(target, drafter, input_ids, **kwargs):
    return target.generate(
        input_ids, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter, speculation_type="dflash", **kwargs
    )


def test_random_drafter_is_lossless(family):
    target = make_target(family)
    drafter = make_drafter(target)
    input_ids = _prompt(0, 11)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    ours = dflash_hf.generate(target, drafter, input_ids, max_new_tokens=MAX_NEW, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, reference)
    assert torch.equal(_native(target, drafter, input_ids), reference)
    assert 1.0 <= ours.tau < 2.0  # a random drafter gets (almost) nothing accepted


def test_oracle_drafter_accepts_everything(family):
    target = make_target(family)
    # Gemma: the prompt alone is longer than the sliding window, so rollback must respect the window
    input_ids = _prompt(1, 3 * GEMMA_SLIDING_WINDOW if family == "gemma3" else 9)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    oracle = make_oracle(target, [reference[0].tolist()], block_size=4)
    ours = dflash_hf.generate(target, oracle, input_ids, max_new_tokens=MAX_NEW, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, reference)
    generated = reference.shape[1] - input_ids.shape[1]
    if generated == MAX_NEW:  # no early EOS: every full cycle commits the whole block
        assert all(n == 4 for n in ours.accepted_lengths[0][:-1])
        assert ours.tau > 3.5
    assert torch.equal(_native(target, oracle, input_ids), reference)


def test_partially_wrong_oracle_long_gemma_context():
    """Rejections at varying slots while the context is several sliding windows long."""
    target = make_target("gemma3")
    input_ids = _prompt(2, 2 * GEMMA_SLIDING_WINDOW + 3)
    reference = greedy_reference(target, input_ids, max_new_tokens=40)
    corrupt = corrupt_slots(5, position_step=7)
    oracle = make_oracle(target, [reference[0].tolist()], corrupt=corrupt)
    ours = dflash_hf.generate(target, oracle, input_ids, max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, reference)
    assert len(set(ours.accepted_lengths[0])) > 1


def test_batch_rows_match_their_own_greedy_output(family):
    target = make_target(family)
    prompts = [_prompt(10 + i, n)[0] for i, n in enumerate([5, 13, 9])]
    references = [greedy_reference(target, p[None], max_new_tokens=MAX_NEW)[0] for p in prompts]
    input_ids, attention_mask = left_padded(prompts)
    width = input_ids.shape[1]
    corrupt = corrupt_slots(4, slot_step=2)
    for drafter in (make_drafter(target), make_oracle(target, [r.tolist() for r in references], corrupt=corrupt)):
        out = dflash_hf.generate(
            target,
            drafter,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW,
            return_dict_in_generate=True,
        )
        assert_rows_are_greedy(out.sequences, width, prompts, references)
        if isinstance(drafter, type(make_oracle(target, [[1]]))):
            lengths = {n for row in out.accepted_lengths for n in row}
            assert len(lengths) > 1  # rows accepted different prefixes


def test_eos_inside_accepted_block_and_eos_lists():
    target = make_target("llama")
    input_ids = _prompt(3, 8)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)[0].tolist()
    generated = reference[8:]
    stop = generated[5]  # a token the target emits mid-sequence: make it a stop token
    expected = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[99, stop])
    oracle = make_oracle(target, [reference], block_size=4)
    out = dflash_hf.generate(target, oracle, input_ids, max_new_tokens=MAX_NEW, eos_token_id=[99, stop])
    assert torch.equal(out, expected)
    assert out[0, -1].item() == stop and out.shape[1] <= 8 + 6


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7])
def test_max_new_tokens_is_exact(max_new_tokens):
    target = make_target("qwen3")
    input_ids = _prompt(4, 6)
    reference = greedy_reference(target, input_ids, max_new_tokens=40)[0].tolist()
    oracle = make_oracle(target, [reference], block_size=4)
    out = dflash_hf.generate(target, oracle, input_ids, max_new_tokens=max_new_tokens, eos_token_id=[99])
    assert out.shape[1] == 6 + max_new_tokens
    assert out[0].tolist() == reference[: 6 + max_new_tokens] or 2 in reference[6 : 6 + max_new_tokens]


def test_block_size_override_and_custom_generate_hook():
    target = make_target("llama")
    input_ids = _prompt(5, 7)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    oracle = make_oracle(target, [reference[0].tolist()], block_size=4)
    small = dflash_hf.generate(
        target, oracle, input_ids, max_new_tokens=MAX_NEW, block_size=2, return_dict_in_generate=True
    )
    assert torch.equal(small.sequences, reference)
    assert small.block_size == 2 and max(small.accepted_lengths[0]) <= 2
    hooked = target.generate(
        input_ids, max_new_tokens=MAX_NEW, do_sample=False, custom_generate=dflash_hf.custom_generate, drafter=oracle
    )
    assert torch.equal(hooked, reference)


def test_streamer_receives_exactly_the_generated_tokens():
    target = make_target("qwen3")
    input_ids = _prompt(6, 7)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)

    class Recorder(TextStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    recorder = Recorder()
    oracle = make_oracle(target, [reference[0].tolist()])
    dflash_hf.generate(target, oracle, input_ids, max_new_tokens=MAX_NEW, streamer=recorder)
    assert recorder.ended
    assert recorder.chunks[0] == input_ids[0].tolist()  # the prompt first, as with model.generate
    assert sum(recorder.chunks[1:], []) == reference[0, 7:].tolist()
    assert all(len(chunk) == 1 for chunk in recorder.chunks[1:])  # one token per step, as with model.generate
    # through `target.generate(custom_generate=...)`, which does not hand the callable its streamer
    through_generate = Recorder()
    target.generate(
        input_ids,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        custom_generate=dflash_hf.custom_generate,
        drafter=oracle,
        streamer=through_generate,
    )
    assert through_generate.ended and through_generate.chunks == recorder.chunks


def test_generated_token_equal_to_mask_id_comes_through():
    target = make_target("llama")
    input_ids = _prompt(7, 9)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    mask_id = reference[0, 12].item()  # a token the target really generates
    drafter = make_drafter(target, mask_token_id=mask_id)
    assert drafter.config.mask_token_id == mask_id
    out = dflash_hf.generate(target, drafter, input_ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, reference)
    assert torch.equal(_native(target, drafter, input_ids), reference)


def test_spec_generate_is_the_native_path_called_the_official_way():
    """`drafter.spec_generate`, the official checkpoints' call, runs Transformers' native path: plain greedy decoding's
    tokens, stopping at `stop_token_ids`."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    input_ids = _prompt(8, 5)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    assert torch.equal(drafter.spec_generate(target, input_ids, max_new_tokens=MAX_NEW), reference)
    assert torch.equal(_native(target, drafter, input_ids), reference)

    stop = int(reference[0, input_ids.shape[1] + 5])
    end = input_ids.shape[1] + reference[0, input_ids.shape[1] :].tolist().index(stop) + 1
    official = drafter.spec_generate(
        input_ids=input_ids, max_new_tokens=MAX_NEW, temperature=0.0, target=target, stop_token_ids=[stop]
    )
    assert official[0].tolist() == reference[0, :end].tolist()
    with pytest.raises(ValueError, match="temperature"):
        drafter.spec_generate(target, input_ids, temperature=-1.0)


def test_mistral_targets_are_lossless():
    from testing_utils import COMMON
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    target = MistralForCausalLM(MistralConfig(**COMMON, tie_word_embeddings=False)).eval()
    input_ids = _prompt(9, 10)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    for drafter in (make_drafter(target), make_oracle(target, [reference[0].tolist()])):
        assert torch.equal(dflash_hf.generate(target, drafter, input_ids, max_new_tokens=MAX_NEW), reference)
        assert torch.equal(_native(target, drafter, input_ids), reference)


@pytest.mark.parametrize("tied", [False, True], ids=["untied head", "tied head"])
@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup", "tree"])
def test_qwen2_shaped_targets_are_exact_on_every_candidate_shape(tied, candidates):
    """Qwen2.5's shape (q/k/v biases, a separate or a tied LM head) in a padded batch, fixed and adaptive blocks:
    every candidate shape's greedy output is plain greedy's (and the native path's, for one row)."""
    target = make_target("qwen2", tie_word_embeddings=tied)
    assert target.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert (target.lm_head.weight is target.model.embed_tokens.weight) == tied
    ids = torch.cat([_prompt(3, 11), _prompt(4, 11)])
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    reference = greedy_reference(target, ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    drafters = [make_drafter(target)]
    if not tied:  # the oracle inverts the LM head; a tied one is the embedding, whose padding row is zero
        drafters.append(make_oracle(target, [strip(row) for row in reference]))
    for drafter in drafters:
        for block_size in (None, "adaptive"):
            ours = dflash_hf.generate(
                target,
                drafter,
                ids,
                attention_mask=mask,
                max_new_tokens=MAX_NEW,
                candidates=candidates,
                block_size=block_size,
            )
            assert torch.equal(ours, reference)
        native = _native(target, drafter, ids[:1])  # Transformers' assisted decoding takes one row
        assert strip(native[0]) == strip(reference[0])


def test_reduced_draft_vocabulary_is_lossless_and_drafts_inside_it():
    target = make_target("llama")
    input_ids = _prompt(11, 9)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    vocabulary = sorted(set(reference[0].tolist()) | {5, 6, 7})
    drafter = make_drafter(target, draft_vocab_size=len(vocabulary))
    drafter.set_draft_vocabulary(vocabulary)
    assert drafter.draft_token_ids.tolist() == vocabulary
    proposals = []
    original = dflash_hf.engine.token_choice.TokenChoice.propose

    def recording_propose(self, logits, rows):
        tokens, probs = original(self, logits, rows)
        proposals.extend(tokens.reshape(-1).tolist())
        return tokens, probs

    dflash_hf.engine.token_choice.TokenChoice.propose = recording_propose
    try:
        out = dflash_hf.generate(target, drafter, input_ids, max_new_tokens=MAX_NEW)
    finally:
        dflash_hf.engine.token_choice.TokenChoice.propose = original
    assert torch.equal(out, reference)
    assert proposals and set(proposals) <= set(vocabulary)
    assert torch.equal(_native(target, drafter, input_ids), reference)
