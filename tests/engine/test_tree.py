"""Two candidates per verify (`candidates="dflash+lookup"`): the tree's parts, and exact greedy equality on every
family, for batches, with EOS or max_new_tokens inside a branch, and the single-branch fall-backs."""

from __future__ import annotations

import pytest
import torch
from testing_utils import (
    GEMMA_SLIDING_WINDOW,
    assert_rows_are_greedy,
    assert_short_runs_are_greedy,
    corrupt_slots,
    greedy_reference,
    left_padded,
    make_drafter,
    make_oracle,
    make_target,
)

import dflash_hf
from dflash_hf.engine import lookup as lookup_module
from dflash_hf.engine.lookup import LookupBranchChoice, lookup_branch_trees, lookup_continuation
from dflash_hf.engine.tree import accept_tree, ancestor_mask, tree_path
from dflash_hf.target import row_exact

MAX_NEW = 32


def _prompt(seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (1, length), generator=generator)


@pytest.fixture
def oracle_lookup(monkeypatch):
    """Tiny random targets do not repeat themselves, so the lookup branch would never be accepted: make the lookup
    source propose each row's true greedy continuation, with every third (or `wrong_every`-th) position wrong, so
    that either branch wins at varying depths (the n-gram search itself is tested on its own)."""

    def install(references: list[list[int]], wrong_every: int = 3) -> None:
        def lookup(sequence: list[int], max_tokens: int) -> list[int]:
            for reference in references:
                if reference[: len(sequence)] == sequence:
                    start = len(sequence)
                    continuation = reference[start : start + max_tokens]
                    return [(t + 1) % 64 if (start + i) % wrong_every == 0 else t for i, t in enumerate(continuation)]
            return []

        monkeypatch.setattr(lookup_module, "lookup_continuation", lookup)

    return install


def test_lookup_continuation_takes_the_latest_earlier_ngram():
    assert lookup_continuation([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3], 3) == [7, 8, 2]  # latest "2 3" before the tail
    assert lookup_continuation([5, 6, 7, 5, 6, 7], 2) == [5, 6]  # the 3-gram "5 6 7" recurs
    assert lookup_continuation([1, 2, 3, 4], 4) == []
    assert lookup_continuation([4, 4, 4], 5) == [4]  # "4 4" at the start, followed by one token


def test_lookup_branch_trees_mask_positions_and_acceptance():
    anchors, drafts = torch.tensor([10, 20]), torch.tensor([[11, 12], [21, 22]])
    trees = lookup_branch_trees(anchors, drafts, [[31, 32, 33], []])
    positions = torch.tensor([5, 7])[:, None] + trees.depths
    assert trees.ids.tolist() == [[10, 11, 12, 31, 32, 33], [20, 21, 22, 20, 20, 20]]
    assert positions.tolist() == [[5, 6, 7, 6, 7, 8], [7, 8, 9, 8, 9, 10]]
    assert trees.valid[:, 3:].tolist() == [[True, True, True], [False, False, False]]
    assert trees.from_lookup[0].tolist() == [False, False, False, True, True, True]
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 1, 1, 1],
    ]
    assert (trees.depth, trees.widths) == (3, [6, 3])
    assert ancestor_mask(trees.parents, trees.depth)[0].int().tolist() == expected
    # target argmax per node: row 0 accepts 1 draft but 2 lookup tokens; row 1 has no lookup and accepts 2 drafts
    target = torch.tensor([[11, 0, 0, 32, 40, 0], [21, 22, 23, 0, 0, 0]])
    target[0, 0] = 31  # the root predicts the lookup branch's first token
    result = accept_tree(trees.ids, trees.parents, trees.depths, trees.valid, target, trees.depth)
    won = trees.from_lookup.gather(1, result.best[:, None]).squeeze(1)
    assert result.accepted.tolist() == [2, 2] and won.tolist() == [True, False]
    assert result.next_token.tolist() == [40, 23]
    block_accepted = result.node_accepted[:, 1:3].sum(dim=1)
    assert block_accepted.tolist() == [0, 2]  # what the block alone got, which the block-size policy learns from
    assert tree_path(trees.parents, result.best, result.accepted, 3).tolist() == [[0, 3, 4], [0, 1, 2]]


@pytest.mark.parametrize("oracle", [False, True], ids=["random drafter", "partly wrong oracle"])
def test_two_branch_verify_is_lossless(family, oracle, oracle_lookup):
    target = make_target(family)
    input_ids = _prompt(0, 23)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    oracle_lookup([reference[0].tolist()])
    if oracle:
        corrupt = corrupt_slots(3)
        drafter = make_oracle(target, [reference[0].tolist()], corrupt=corrupt)
    else:
        drafter = make_drafter(target)
    out = dflash_hf.generate(
        target, drafter, input_ids, max_new_tokens=MAX_NEW, candidates="dflash+lookup", return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, reference)
    assert out.lookup_wins[0] > 0 and out.tau > 1.5


def test_batch_rows_each_keep_their_own_branch(oracle_lookup):
    target = make_target("llama")
    prompts = [_prompt(10 + i, n)[0] for i, n in enumerate([7, 16, 11])]
    references = [  # no EOS (99 is never generated): every row runs its full length
        target.generate(p[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[99])[0] for p in prompts
    ]
    oracle_lookup([r.tolist() for r in references])
    input_ids, attention_mask = left_padded(prompts)
    width = input_ids.shape[1]
    corrupt = corrupt_slots(4, slot_step=2)
    oracle = make_oracle(target, [r.tolist() for r in references], corrupt=corrupt)
    for drafter in (make_drafter(target), oracle):
        out = dflash_hf.generate(
            target,
            drafter,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW,
            eos_token_id=[99],
            candidates="dflash+lookup",
            return_dict_in_generate=True,
        )
        assert_rows_are_greedy(out.sequences, width, prompts, references)
        if drafter is not oracle:  # a random drafter: every row's longer runs come from its own lookup branch
            assert all(wins > 0 for wins in out.lookup_wins)


def test_eos_and_max_new_tokens_inside_the_lookup_branch(oracle_lookup):
    target = make_target("llama")
    input_ids = _prompt(3, 20)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)[0].tolist()
    oracle_lookup([reference])
    drafter = make_drafter(target)  # random: accepted runs come from the lookup branch
    stop = reference[20 + 6]
    expected = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[99, stop])
    out = dflash_hf.generate(
        target, drafter, input_ids, max_new_tokens=MAX_NEW, eos_token_id=[99, stop], candidates="dflash+lookup"
    )
    assert torch.equal(out, expected)
    assert_short_runs_are_greedy(target, drafter, input_ids, "dflash+lookup")


def test_gemma_tree_past_the_sliding_window_is_exact(oracle_lookup):
    """Past Gemma's sliding window the sliding layers get their own tree mask (context keys a window or more before a
    node hidden), and the output stays exact."""
    target = make_target("gemma3")
    input_ids = _prompt(5, 2 * GEMMA_SLIDING_WINDOW + 3)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    oracle_lookup([reference[0].tolist()])
    out = dflash_hf.generate(
        target, make_drafter(target), input_ids, max_new_tokens=MAX_NEW, candidates="dflash+lookup",
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, reference) and out.lookup_wins[0] > 0


def test_sampling_uses_the_dflash_block_alone_and_bad_values_are_refused(oracle_lookup):
    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids = _prompt(6, 20)
    oracle_lookup([greedy_reference(target, input_ids, max_new_tokens=12)[0].tolist()])
    torch.manual_seed(0)
    out = dflash_hf.generate(
        target, drafter, input_ids, max_new_tokens=12, do_sample=True, eos_token_id=[99], candidates="dflash+lookup",
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.lookup_wins == [] and out.sequences.shape[1] == 32
    with pytest.raises(ValueError, match="candidates must be one of"):
        dflash_hf.generate(target, drafter, input_ids, max_new_tokens=4, candidates="lookup")


def test_lookup_branch_choice_follows_the_measured_rates():
    """The tree is tried first, kept while its committed tokens per second beat the block's, dropped when they do
    not, and the other choice is re-measured every `explore_every`-th eligible cycle."""
    choice = LookupBranchChoice(explore_every=4)
    decisions = []
    for _ in range(12):
        tree = choice.use_tree()
        decisions.append(tree)
        choice.observe(tree, committed=3.0 if tree else 1.0, seconds=0.10 if tree else 0.08)  # tree: 30 vs 12.5 tok/s
    assert decisions == [True, True, True, False] * 3
    assert choice.rate(True) == pytest.approx(30.0) and choice.rate(False) == pytest.approx(12.5)
    slow = LookupBranchChoice(explore_every=4)
    decisions = []
    for _ in range(12):
        tree = slow.use_tree()
        decisions.append(tree)
        slow.observe(tree, committed=1.0, seconds=0.2 if tree else 0.1)  # the branch is never accepted and costs more
    assert decisions[:4] == [True, True, True, False] and decisions[4:] == [False, False, False, True] * 2
    with pytest.raises(ValueError, match="explore_every"):
        LookupBranchChoice(explore_every=1)


def test_adaptive_block_size_learns_the_block_not_the_lookup_wins(oracle_lookup, monkeypatch):
    """In tree cycles the block-size policy observes what the DFlash block alone got accepted: a random drafter with an
    accurate lookup branch must not look like a drafter whose late slots are accepted."""
    from dflash_hf.engine.block_size import AdaptiveBlockSize

    target = make_target("llama")
    input_ids = _prompt(7, 15)
    reference = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[99])
    oracle_lookup([reference[0].tolist()])
    observed: list[int] = []
    real_observe = AdaptiveBlockSize.observe

    def spy(self, block_size, committed, seconds):
        observed.extend(committed)
        return real_observe(self, block_size, committed, seconds)

    monkeypatch.setattr(AdaptiveBlockSize, "observe", spy)
    out = dflash_hf.generate(
        target,
        make_drafter(target, block_size=8),
        input_ids,
        max_new_tokens=MAX_NEW,
        block_size="adaptive",
        eos_token_id=[99],
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference)
    assert sum(out.lookup_wins) > 0 and max(out.accepted_lengths[0]) >= 3  # the lookup branch committed runs
    assert max(observed) <= 2  # a random block gets at most one token accepted here, whatever the lookup got


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_row_exact_bf16_tree_verify_equals_plain_bf16_greedy(family, oracle_lookup):
    """In bf16 on CPU verification runs row-exact (`target.row_exact`); the tree's nodes are attended one by one over
    the cache and their own ancestors, so the lookup branch stays on and the output is stock bf16 greedy's, past
    Gemma's sliding window too."""
    reference_target = make_target(family).to(torch.bfloat16)
    target = make_target(family).to(torch.bfloat16)
    input_ids = _prompt(7, 2 * GEMMA_SLIDING_WINDOW + 3)
    reference = greedy_reference(reference_target, input_ids, max_new_tokens=MAX_NEW)
    oracle_lookup([reference[0].tolist()])
    corrupt = corrupt_slots(3)
    for drafter in (make_drafter(target), make_oracle(target, [reference[0].tolist()], corrupt=corrupt)):
        out = dflash_hf.generate(
            target, drafter.to(torch.bfloat16), input_ids, max_new_tokens=MAX_NEW, candidates="dflash+lookup",
            return_dict_in_generate=True,
        )  # fmt: skip
        if not row_exact.install(target, 4):
            pytest.skip("this CPU's bf16 kernels cannot be made row-exact for this target (install says so)")
        assert torch.equal(out.sequences, reference)
        assert out.lookup_wins[0] > 0  # the tree was verified (and won) in row-exact bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 row-exact"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_lookup_branch_longer_than_the_block_is_lossless(family, dtype, oracle_lookup):
    """`lookup_tokens` verifies a lookup branch longer than the DFlash block; a cycle can then commit more tokens than
    the block holds, and the output is still plain greedy's (in bf16 too, row-exact over the wider tree)."""
    reference_target, target = make_target(family).to(dtype), make_target(family).to(dtype)
    input_ids = _prompt(8, 2 * GEMMA_SLIDING_WINDOW + 3)
    reference = greedy_reference(reference_target, input_ids, max_new_tokens=MAX_NEW)
    oracle_lookup([reference[0].tolist()], wrong_every=8)
    out = dflash_hf.generate(
        target, make_drafter(target).to(dtype), input_ids, max_new_tokens=MAX_NEW, block_size=2, lookup_tokens=7,
        candidates="dflash+lookup", return_dict_in_generate=True,
    )  # fmt: skip
    if dtype != torch.float32 and not row_exact.install(target, 9):
        pytest.skip("this CPU's bf16 kernels cannot be made row-exact for this target (install says so)")
    assert torch.equal(out.sequences, reference)
    assert max(out.accepted_lengths[0]) > 2  # more than a 2-token block can commit: the long branch won
    with pytest.raises(ValueError, match="lookup_tokens must be an int between 1 and 256"):
        dflash_hf.generate(target, make_drafter(target), input_ids, max_new_tokens=4, lookup_tokens=0)
