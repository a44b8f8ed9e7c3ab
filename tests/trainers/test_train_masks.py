"""Training conventions of docs/design.md §3: anchors, the sparse mask, same-position labels, loss weights."""

from __future__ import annotations

import math

import pytest
import torch
from dflash_hf.trainers import (
    DFlashTrainer,
    DFlashTrainingConfig,
    block_attention_mask,
    build_blocks,
    decoding_walk,
    default_loss_decay_gamma,
    implied_acceptance_length,
    sample_anchors,
    slot_loss_weights,
)
from testing_utils import make_tiny_target, make_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


def naive_mask(anchors, valid, seq_len, block):
    b, a = anchors.shape
    out = torch.zeros(b, 1, a * block, seq_len + a * block, dtype=torch.bool)
    for r in range(b):
        for j in range(a):
            for i in range(block):
                q = j * block + i
                for kv in range(seq_len + a * block):
                    if kv < seq_len:
                        out[r, 0, q, kv] = bool(valid[r, j]) and kv < int(anchors[r, j])
                    else:
                        out[r, 0, q, kv] = (kv - seq_len) // block == j
    return out


def test_mask_equals_naive_reference():
    torch.manual_seed(0)
    seq, block = 23, 4
    loss_mask = torch.zeros(3, seq, dtype=torch.long)
    loss_mask[:, 6:] = 1
    lengths = torch.tensor([23, 17, 12])
    anchors, valid = sample_anchors(loss_mask, lengths, block, num_anchors=5)
    assert not valid.all()  # the short row has fewer anchors: invalid slots exercised too
    mask = block_attention_mask(anchors, valid, seq, block)
    assert torch.equal(mask, naive_mask(anchors, valid, seq, block))
    # the anchor's own position is never visible to its block (context strictly before the anchor)
    for r in range(3):
        for j in range(anchors.shape[1]):
            if valid[r, j]:
                assert not mask[r, 0, j * block : (j + 1) * block, int(anchors[r, j]) : seq].any()


def test_anchors_only_in_response_and_room_for_a_block():
    torch.manual_seed(1)
    seq, block = 40, 8
    loss_mask = torch.zeros(4, seq, dtype=torch.long)
    prompt = [5, 12, 30, 33]
    lengths = torch.tensor([40, 35, 38, 40])
    for r, p in enumerate(prompt):
        loss_mask[r, p : lengths[r]] = 1
    for _ in range(20):
        anchors, valid = sample_anchors(loss_mask, lengths, block, num_anchors=16)
        for r in range(4):
            chosen = anchors[r][valid[r]].tolist()
            assert len(set(chosen)) == len(chosen)
            assert all(a >= prompt[r] for a in chosen), "anchor inside the prompt"
            assert all(a + block <= int(lengths[r]) for a in chosen), "block would pass the end"
            expected = max(0, int(lengths[r]) - block - prompt[r] + 1)
            assert len(chosen) == min(16, expected)
    # row 3 has no room for a whole block: no anchor at all
    assert not valid[3].any()


def test_loss_weights_follow_formula_and_gamma_defaults():
    assert default_loss_decay_gamma(16) == 7
    assert default_loss_decay_gamma(10) == 5
    assert default_loss_decay_gamma(8) == 4
    assert default_loss_decay_gamma(4) == 2 and default_loss_decay_gamma(22) == 9
    assert DFlashTrainingConfig(output_dir="x", block_size=10, use_cpu=True).loss_decay_gamma == 5
    w = slot_loss_weights(16, 7.0)
    assert w[0] == 0
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


def test_labels_are_same_position_tokens():
    seq, block = 20, 4
    input_ids = torch.arange(100, 100 + seq)[None]  # every token distinct: any shift is visible
    loss_mask = torch.zeros(1, seq, dtype=torch.long)
    loss_mask[0, 5:18] = 1  # response ends at 17 (a second turn's prompt follows)
    anchors = torch.tensor([[5, 9, 15]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    out = build_blocks(input_ids, loss_mask, anchors, valid, block, mask_token_id=7, gamma=2.0)
    for j, a in enumerate([5, 9, 15]):
        assert out.block_ids[0, j * block] == 100 + a
        assert (out.block_ids[0, j * block + 1 : (j + 1) * block] == 7).all()
        assert out.labels[0, j, 0] == -100  # the anchor slot is given, not predicted
        for k in range(1, block):
            expect = 100 + a + k if a + k < 18 else -100
            assert out.labels[0, j, k] == expect
            assert out.position_ids[0, seq + j * block + k] == a + k
    assert torch.equal(out.position_ids[0, :seq], torch.arange(seq))
    assert out.weights[0, 2, 3] == 0 and out.weights[0, 2, 2] > 0  # position 18 is not a response token


def test_decoding_walk_anchors_where_the_previous_block_stopped():
    # row 0: anchors 5..10; accepted drafts 2 at 5 -> 3 tokens, next block at 8: 0 -> 1 token, at 9: 1 -> 2 tokens
    prefix = torch.tensor([[2, 3, 3, 0, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    anchors = torch.tensor([[5, 6, 7, 8, 9, 10], [3, 4, 5, 0, 0, 0], [2, 4, 6, 8, 0, 0]])
    valid = torch.tensor([[True] * 6, [True, True, True, False, False, False], [True] * 4 + [False, False]])
    # row 1: three 1-token cycles; row 2 (random, not consecutive anchors) is skipped
    assert decoding_walk(prefix, anchors, valid) == (3 + 1 + 2 + 3, 3 + 3)
    # a mean over every anchor would say (2+3+3+0+1+1)/6 + 1 = 2.67 for row 0; decoding gets 6 tokens in 3 cycles
    assert decoding_walk(prefix[:1], anchors[:1], valid[:1]) == (6, 3)


def test_implied_acceptance_length():
    assert implied_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert implied_acceptance_length([0.0, 1.0]) == 1.0
    assert math.isclose(implied_acceptance_length([0.5, 0.5]), 1.75)


class _PositionOracle(torch.nn.Module):
    """Returns hidden states that the LM head maps onto the token at position `position_ids + shift`."""

    def __init__(self, sequence, lm_weight, shift=0):
        super().__init__()
        self.sequence, self.shift = sequence, shift
        self.inverse = torch.linalg.inv(lm_weight.double())

    def forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask=None, **kw):
        q = noise_embeds.shape[1]
        pos = position_ids[:, -q:] + self.shift
        tokens = self.sequence[0, pos.clamp(max=self.sequence.shape[1] - 1)]
        logits = torch.full((*tokens.shape, self.inverse.shape[0]), -20.0, dtype=torch.float64)
        logits.scatter_(-1, tokens[..., None], 20.0)
        hidden = (logits @ self.inverse.T).float()
        return type("Out", (), {"last_hidden_state": hidden})()


def test_shifted_by_one_labels_bug_is_caught(tmp_path):
    """End to end through the trainer's loss: a same-position predictor scores ~0 loss and accuracy 1, a predictor
    shifted by one (the published bug) does not."""
    target = make_tiny_target("llama")
    tok = make_tokenizer()
    args = DFlashTrainingConfig(
        output_dir=str(tmp_path),
        block_size=4,
        num_anchors=8,
        num_draft_layers=1,
        num_target_features=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = DFlashTrainer(args=args, target=target, processing_class=tok)
    seq = torch.randint(4, 64, (1, 30))
    inputs = {
        "input_ids": seq,
        "loss_mask": (torch.arange(30) >= 8).long()[None],
        "attention_mask": torch.ones_like(seq),
    }
    lm = target.get_output_embeddings().weight.detach()
    good_loss, good = trainer.dflash_loss(_PositionOracle(seq, lm, 0), inputs)
    bad_loss, bad = trainer.dflash_loss(_PositionOracle(seq, lm, 1), inputs)
    assert good_loss.item() < 1e-3
    assert good["correct"][good["selected"]].all()
    assert bad_loss.item() > 5.0
    assert bad["correct"][bad["selected"]].float().mean() < 0.2


def test_block_cannot_see_its_anchor_hidden_state(tmp_path):
    """Changing the target feature at an anchor's position (or later) leaves that block's output unchanged; the
    position just before it does change it."""
    target = make_tiny_target("llama")
    args = DFlashTrainingConfig(
        output_dir=str(tmp_path),
        block_size=4,
        num_draft_layers=2,
        num_target_features=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = DFlashTrainer(args=args, target=target, processing_class=make_tokenizer())
    drafter = trainer.model.eval()
    seq_len, block = 24, 4
    anchors = torch.tensor([[10, 16]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    ids = torch.randint(4, 64, (1, seq_len))
    blocks = build_blocks(ids, torch.ones_like(ids), anchors, valid, block, drafter.config.mask_token_id, 2.0)
    noise = trainer.adapter.embed(blocks.block_ids)
    ctx = torch.randn(1, seq_len, drafter.fc.in_features)
    mask = block_attention_mask(anchors, valid, seq_len, block)

    def run(c):
        with torch.no_grad():
            return drafter(noise, c, blocks.position_ids, attention_mask=mask).last_hidden_state[0, :block]

    base = run(ctx)
    later = ctx.clone()
    later[0, 10:] += 5.0
    assert torch.allclose(run(later), base, atol=1e-6)
    before = ctx.clone()
    before[0, 9] += 5.0
    assert not torch.allclose(run(before), base, atol=1e-3)
