"""Block-size policies: the adaptive choice follows acceptance and cost, and stays lossless."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import make_oracle, make_target

import dflash_hf
from dflash_hf.engine.block_size import AdaptiveBlockSize, FixedBlockSize, make_block_size_policy


def _run(policy: AdaptiveBlockSize, accept_drafts, cost, cycles: int = 40) -> list[int]:
    """Simulate cycles: `accept_drafts(k)` drafts accepted with block k, `cost(k)` seconds per cycle."""
    chosen = []
    for _ in range(cycles):
        k = policy.next_block_size()
        chosen.append(k)
        policy.observe(k, [min(accept_drafts(k), k - 1) + 1], cost(k))
    return chosen


def test_explores_the_extremes_first_then_interpolates_costs():
    policy = AdaptiveBlockSize(16)
    assert _run(policy, lambda k: 0, lambda k: 1.0 + 0.1 * k, cycles=2) == [16, 2]
    assert policy.estimated_cost(8) == pytest.approx(1.8)


def test_perfect_drafter_with_flat_cost_uses_the_largest_block():
    chosen = _run(AdaptiveBlockSize(16), lambda k: k - 1, lambda k: 1.0)
    assert chosen[-10:] == [16] * 10


def test_useless_drafter_with_growing_cost_uses_the_smallest_block():
    chosen = _run(AdaptiveBlockSize(16), lambda k: 0, lambda k: 1.0 + 0.1 * k)
    assert chosen[-10:] == [2] * 10


def test_acceptance_limit_and_verify_cost_pick_a_middle_size():
    # drafts beyond slot 5 are always wrong; verifying costs grow with k -> blocks of ~6 are best
    chosen = _run(AdaptiveBlockSize(16), lambda k: 5, lambda k: 1.0 + 0.05 * k, cycles=60)
    # slots never verified drift back to the prior, so larger blocks are re-explored now and then
    assert Counter(chosen[-20:]).most_common(1)[0][0] == 6


def test_policy_arguments():
    assert isinstance(make_block_size_policy(None, 8), FixedBlockSize)
    assert isinstance(make_block_size_policy("adaptive", 8), AdaptiveBlockSize)
    with pytest.raises(ValueError, match="adaptive"):
        make_block_size_policy("fast", 8)
    with pytest.raises(ValueError, match="candidate"):
        AdaptiveBlockSize(8, candidates=[2, 12])


def test_adaptive_generation_is_lossless_and_varies_block_size():
    target = make_target("gemma3")
    input_ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(4))
    reference = target.generate(input_ids, max_new_tokens=48, do_sample=False, eos_token_id=[99])
    corrupt = {(pos, slot) for pos in range(120) for slot in range(1, 8) if (pos + slot) % 6 == 0}
    oracle = make_oracle(target, [reference[0].tolist()], corrupt=corrupt, block_size=8)
    out = dflash_hf.generate(
        target,
        oracle,
        input_ids,
        max_new_tokens=48,
        block_size="adaptive",
        eos_token_id=[99],
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference)
    assert len(set(out.block_sizes[0])) > 1
    assert out.block_size == 8 and len(out.acceptance_rate_by_slot) == 7
