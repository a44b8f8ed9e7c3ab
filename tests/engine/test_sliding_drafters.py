"""Drafters with sliding-window and block-causal layers in the engine: exact against plain greedy, and a drafter whose
every layer slides keeps only its window of context in its cache, drafting exactly as with the whole context."""

from __future__ import annotations

import pytest
import torch
from testing_utils import assert_rows_are_greedy, greedy_reference, left_padded, make_drafter, make_target

import dflash_hf
from dflash_hf.engine.candidates import DFlashChain

VOCAB = 12
MAX_NEW = 90
PROMPTS = [[5, 7, 3, 9, 4, 6, 8, 10, 3, 5, 7], [6, 6, 4], [11, 3, 5, 7, 9, 4]]
LAYOUTS = {
    "sliding": dict(layer_types=["sliding_attention"] * 2, sliding_window=6),
    "sliding-non-causal": dict(layer_types=["sliding_attention"] * 2, sliding_window=6, is_causal=False),
    "mixed": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    "full-causal": dict(is_causal=True),
}


def record_drafts(monkeypatch) -> tuple[list, list]:
    """Every draft's rows and logits, and the drafter cache's length after each draft."""
    drafts, lengths = [], []
    slots = DFlashChain.slots

    def recorded(self, state, block, block_pos):
        logits, hidden = slots(self, state, block, block_pos)
        drafts.append((list(state.rows), logits.clone()))
        lengths.append(self.cache.get_seq_length())
        return logits, hidden

    monkeypatch.setattr(DFlashChain, "slots", recorded)
    return drafts, lengths


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_restricted_drafters_are_exact(family, layout, candidates):
    target = make_target(family, vocab_size=VOCAB)
    drafter = make_drafter(target, **LAYOUTS[layout])
    input_ids, mask = left_padded(PROMPTS)
    out = dflash_hf.generate(
        target,
        drafter,
        input_ids,
        attention_mask=mask,
        max_new_tokens=30,
        candidates=candidates,
        return_dict_in_generate=True,
    )
    references = [greedy_reference(target, torch.tensor([p]), max_new_tokens=30)[0] for p in PROMPTS]
    assert_rows_are_greedy(out.sequences, input_ids.shape[1], PROMPTS, references, (family, layout, candidates))


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup"])
def test_a_sliding_drafter_keeps_only_its_window(monkeypatch, candidates):
    """Its cache stops growing with the context, and every draft is the one it makes with the whole context cached
    (rows that accept different lengths re-align within what it keeps)."""
    target = make_target("qwen3", vocab_size=VOCAB)
    drafter = make_drafter(target, **LAYOUTS["sliding"])
    input_ids, mask = left_padded(PROMPTS)
    runs = []
    drafts, lengths = record_drafts(monkeypatch)
    for trim in (True, False):
        if not trim:
            monkeypatch.setattr(DFlashChain, "_forget_past_the_window", lambda self, state: None)
        out = dflash_hf.generate(
            target,
            drafter,
            input_ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW,
            candidates=candidates,
            eos_token_id=[],
            return_dict_in_generate=True,
        )
        runs.append((out, list(drafts), list(lengths)))
        drafts.clear(), lengths.clear()
    (trimmed, drafts, lengths), (whole, whole_drafts, whole_lengths) = runs
    assert torch.equal(trimmed.sequences, whole.sequences)
    assert trimmed.accepted_lengths == whole.accepted_lengths
    assert len(drafts) == len(whole_drafts)
    for (_, got), (_, expected) in zip(drafts, whole_drafts):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    half = len(lengths) // 2
    # the window (5 positions) and twice the widest verify (kept), held up to twice that before it is cut again
    kept = 5 + 2 * max(max(row) for row in trimmed.verify_widths)
    assert max(lengths[half:]) <= 2 * kept + max(max(row) for row in trimmed.verify_widths)
    assert max(lengths[half:]) < min(whole_lengths[half:])  # the whole context grows past it
