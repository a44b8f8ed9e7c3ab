"""Block-size policies: the adaptive choice follows acceptance and cost, and stays lossless."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from testing_utils import corrupt_slots, make_oracle, make_target

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
    assert _run(policy, lambda k: 0, lambda k: 1.0 + 0.1 * k, cycles=2) == [16, 1]
    assert policy.estimated_cost(8) == pytest.approx(1.8)


def test_perfect_drafter_with_flat_cost_uses_the_largest_block():
    chosen = _run(AdaptiveBlockSize(16), lambda k: k - 1, lambda k: 1.0)
    assert chosen[-10:] == [16] * 10


def test_useless_drafter_with_growing_cost_uses_the_smallest_block():
    chosen = _run(AdaptiveBlockSize(16, candidates=[2, 4, 8, 16]), lambda k: 0, lambda k: 1.0 + 0.1 * k)
    assert chosen[-10:] == [2] * 10


def test_falls_back_to_plain_steps_where_speculation_loses_and_returns_when_it_pays():
    """A plain step (block 1) commits one token for the cost of one step: with a useless drafter and verifies that cost
    more than a step, decoding falls back to it; once the drafter is right, it speculates again."""
    policy = AdaptiveBlockSize(8)
    cost = lambda k: 1.0 if k == 1 else 1.3 + 0.05 * k  # noqa: E731
    losing = _run(policy, lambda k: 0, cost, cycles=80)
    assert 36 <= Counter(losing[-40:])[1] < 40  # plain steps, a block re-tried every twenty-odd steps
    assert 1 in policy.candidates and policy.expected_tokens(1) == 1.0
    winning = _run(policy, lambda k: k - 1, cost, cycles=60)
    assert winning[-20:] == [8] * 20


class _Scripted:
    """A block-size policy that plays a fixed sequence of sizes (1: a plain step), cyclically."""

    def __init__(self, sizes: list[int], max_block_size: int = 8) -> None:
        self.sizes, self.max_block_size, self.calls = sizes, max_block_size, 0

    def next_block_size(self) -> int:
        self.calls += 1
        return self.sizes[(self.calls - 1) % len(self.sizes)]

    def observe(self, block_size: int, committed: list[int], seconds: float) -> None:
        assert block_size != 1 or committed == [1] * len(committed)  # a plain step commits one token per row


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_plain_steps_between_blocks_are_lossless(family):
    """Plain steps (the drafter reads the context, nothing is drafted) mixed with blocks of every size give plain
    greedy's tokens, on a left-padded batch and past Gemma's sliding window."""
    target = make_target(family)
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, 64, (2, 14), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[1, :5] = 0
    reference = target.generate(input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=[99])
    oracle = make_oracle(target, reference.tolist(), corrupt={(p, 3) for p in range(80)}, block_size=8)
    for sizes in ([1], [1, 8, 1, 1, 4, 2, 1]):
        out = dflash_hf.generate(
            target, oracle, input_ids, attention_mask=mask, max_new_tokens=30, block_size=_Scripted(sizes),
            eos_token_id=[99], candidates="dflash", return_dict_in_generate=True,
        )  # fmt: skip
        assert torch.equal(out.sequences, reference)
        assert 1 in out.block_sizes[0]
        if sizes == [1]:
            assert out.tau == 1.0 and set(out.block_sizes[0]) == {1}
        else:
            assert max(out.accepted_lengths[0]) > 1


def test_plain_steps_when_sampling():
    target = make_target("llama")
    oracle = make_oracle(target, [[1, 5, 9]], block_size=4)
    out = dflash_hf.generate(
        target, oracle, torch.tensor([[1, 5, 9, 12]]), max_new_tokens=12, do_sample=True, block_size=_Scripted([1, 4], 4),
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.shape[1] == 4 + 12 and 1 in out.block_sizes[0]


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
    corrupt = corrupt_slots(6, positions=120, block_size=8)
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
