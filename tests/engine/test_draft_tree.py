"""The draft tree (`candidates="tree"`): masks and greedy acceptance of a parent list, the best-first budget, the
calibration and the cost model as pure functions, children conditioned on their parent through a Markov head, and
greedy output identical to plain greedy on every family (past Gemma's sliding window, left-padded batches, EOS and
max_new_tokens inside a branch); a drafter whose right token is its second choice gets more accepted with the tree;
a tree held to one branch is the DFlash engine; sampling verifies the chain."""

from __future__ import annotations

import functools

import pytest
import torch
from testing_utils import (
    GEMMA_SLIDING_WINDOW,
    VOCAB,
    OracleDrafter,
    assert_rows_are_greedy,
    assert_short_runs_are_greedy,
    chi_square,
    chi_square_bound,
    corrupt_slots,
    exact_joint_of_tokens_2_and_3,
    greedy_reference,
    left_padded,
    make_drafter,
    make_target,
    tiny_sampling_models,
)

import dflash_hf
import dflash_hf.engine.token_choice as token_choice
from dflash_hf import DFlashConfig
from dflash_hf.engine import draft_tree
from dflash_hf.engine.draft_tree import (
    PRIOR_COST_PER_TOKEN,
    DepthCalibration,
    SlotCandidates,
    TreeBudget,
    corrected_logits,
    grow_tree,
    node_threshold,
)
from dflash_hf.engine.tree import accept_tree, ancestor_mask, tree_attention_mask, tree_path
from dflash_hf.target import row_exact

MAX_NEW = 32
EVERY_FIRST_SLOT = {(pos, 1) for pos in range(200)}  # the chain's first draft is always wrong


def _prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


class SecondChoiceOracle(OracleDrafter):
    """An oracle whose wrong proposals (`corrupt`) keep the right token as the runner-up (logit 8 against the wrong
    token's 10, the rest -10): the chain drafts the wrong token, a tree's second child at that slot is the right one."""

    def forward(self, noise_embeds, *args, position_ids=None, **kwargs):
        out = super().forward(noise_embeds, *args, position_ids=position_ids, **kwargs)
        block = noise_embeds.shape[1]
        hidden = out.last_hidden_state.double()
        logits = hidden @ self._head.T
        for b in range(hidden.shape[0]):
            anchor_pos = int(position_ids[b, -block])
            for slot in range(1, block):
                if (anchor_pos + slot, slot) in self._corrupt:
                    right = (int(logits[b, slot].argmax()) - 1) % self._vocab  # the oracle's wrong token is right + 1
                    hidden[b, slot] += 18.0 * self._inverse[:, right]
        out.last_hidden_state = hidden.to(out.last_hidden_state.dtype)
        return out


def second_choice_oracle(target, references: list[list[int]], corrupt=EVERY_FIRST_SLOT) -> SecondChoiceOracle:
    torch.manual_seed(1)
    config = DFlashConfig.from_target(target.config, num_hidden_layers=1, block_size=4, num_target_features=2)
    oracle = SecondChoiceOracle(config).eval().setup(target, references, corrupt)
    oracle._embed_table = target.get_input_embeddings()(torch.arange(VOCAB)).detach()
    oracle._head = target.get_output_embeddings().weight.detach().double()
    return oracle


def markov_drafter(target):
    """A drafter with a Markov head of trained-looking (random, non-zero) weights."""
    drafter = make_drafter(target, markov_rank=8)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in drafter.markov_head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 3.0)
    return drafter


# ---------------------------------------------------------------------------------------------- pure functions

PARENTS = [0, 0, 1, 0, 3, 1]  # root; a; a's child b; c; c's child d; a's child e
DEPTHS = [0, 1, 2, 1, 2, 2]


def test_tree_mask_for_a_parent_list():
    sees = ancestor_mask(torch.tensor([PARENTS]), max(DEPTHS))
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]
    assert sees[0].int().tolist() == expected
    padding = torch.tensor([[0, 1, 1, 1]])  # one padded context position, then positions 0, 1, 2
    positions = 3 + torch.tensor([DEPTHS])
    masks = tree_attention_mask(padding, sees, torch.float32, positions, sliding_window=2)
    full = (masks["full_attention"][0, 0] == 0).int()
    assert full[:, :4].tolist() == [[0, 1, 1, 1]] * 6 and full[:, 4:].tolist() == expected
    sliding = (masks["sliding_attention"][0, 0] == 0).int()
    # a window of 2: the root (position 3) sees context position 2; depth-2 nodes (position 5) see their parent only
    assert sliding[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert sliding[2].tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert sliding[4].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0]


def test_greedy_acceptance_follows_the_target_argmax_from_the_root():
    ids = torch.tensor([[10, 11, 12, 21, 22, 13]] * 3)
    parents, depths = torch.tensor([PARENTS] * 3), torch.tensor([DEPTHS] * 3)
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[2, 3] = False  # a padding node is never accepted, whatever the target says
    target = torch.tensor(
        [
            [21, 0, 0, 22, 40, 0],  # root -> c -> d, then 40
            [11, 13, 0, 0, 0, 41],  # root -> a -> e, then 41 (a's child b is not what the target says)
            [21, 0, 0, 22, 40, 0],  # as row 0, but c is padding: nothing is accepted
        ]
    )
    result = accept_tree(ids, parents, depths, valid, target, max(DEPTHS))
    assert result.accepted.tolist() == [2, 2, 0] and result.best.tolist() == [4, 5, 0]
    assert result.next_token.tolist() == [40, 41, 21]
    assert result.node_accepted.int().tolist() == [[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0]]
    assert tree_path(parents, result.best, result.accepted, 3).tolist() == [[0, 3, 4], [0, 1, 5], [0, 0, 0]]


SLOT_TABLE = {1: ([0.6, 0.3, 0.1], [5, 6, 7]), 2: ([0.5, 0.4, 0.1], [8, 9, 10])}


def _table_children(depth: int, token: int):
    return SLOT_TABLE[depth + 1]


def _added(tree) -> list[tuple[int, int]]:
    """`(parent token, token)` of the nodes beyond the chain, in the order they were added."""
    return [(tree.tokens[tree.parents[i]], tree.tokens[i]) for i in range(tree.chain + 1, len(tree))]


def test_best_first_budget_keeps_the_nodes_worth_their_cost():
    """The chain first (5 then 8), then the most likely candidates while their path probability is at least the
    marginal cost of a verified token times the call's rate, at most `max_nodes`."""
    threshold = node_threshold(marginal_cost=0.05, rate=4.0)  # 0.05 s per token at 4 tokens/s: worth it above 0.2
    tree = grow_tree(anchor=1, children=_table_children, slots=2, min_probability=threshold, max_nodes=16)
    assert tree.tokens[: tree.chain + 1] == [1, 5, 8] and tree.parents[:3] == [0, 0, 1]
    assert _added(tree) == [(1, 6), (5, 9)]  # 0.3 and 0.6 * 0.4 = 0.24; 6 -> 8 (0.15) is not worth it
    assert tree.scores == pytest.approx([1.0, 0.6, 0.3, 0.3, 0.24])
    cheap = grow_tree(1, _table_children, 2, min_probability=0.1, max_nodes=16)
    assert _added(cheap) == [(1, 6), (5, 9), (6, 8), (6, 9), (1, 7)]  # 0.3, 0.24, 0.15, 0.12, 0.1: best first
    assert _added(grow_tree(1, _table_children, 2, min_probability=0.1, max_nodes=2)) == [(1, 6), (5, 9)]
    chain = grow_tree(1, _table_children, 2, min_probability=0.0, max_nodes=0)  # one branch: the DFlash block
    assert chain.tokens == [1, 5, 8]
    calibrated = grow_tree(1, _table_children, 2, 0.1, 16, calibrate=lambda depth, p: p / 2 if depth == 2 else p)
    assert _added(calibrated) == [(1, 6), (5, 9), (1, 7)]  # depth 2 observed at half its prediction: 0.12, 0.075 out


def test_lookup_branch_leaves_the_chain_where_it_differs_and_is_scored_by_its_acceptance():
    tree = grow_tree(1, _table_children, 2, 0.2, 16, lookup=[5, 9, 4], lookup_score=lambda depth: 0.9)
    # it shares the chain's 5, then 9 and 4 hang under it, scored min(0.6, 0.9); the draft candidate 5 -> 9 is the
    # lookup's node already and is not added twice
    assert _added(tree) == [(5, 9), (9, 4), (1, 6)]
    assert [tree.from_lookup[i] for i in range(3, 6)] == [True, True, False]
    assert tree.depths[4] == 3  # a lookup branch may run past the block
    unlikely = grow_tree(1, _table_children, 2, 0.2, 16, lookup=[6, 2], lookup_score=lambda depth: 0.1)
    assert _added(unlikely) == [(1, 6), (5, 9)]  # the lookup's 6 is the draft candidate's; its 2 is not worth it


def test_depth_calibration_is_observed_over_predicted():
    calibration = DepthCalibration(decay=0.5)
    assert calibration(1, 0.4) == 0.4  # nothing observed: the prediction
    calibration.observe([(1, 0.9, False), (1, 0.1, True), (2, 0.5, False)])
    assert calibration.ratio(1) == pytest.approx((1 + 1) / (1 + 1)) and calibration.ratio(2) == pytest.approx(1 / 1.5)
    assert calibration(2, 0.6) == pytest.approx(0.4) and calibration(1, 1.0) == 1.0
    calibration.observe([])  # depth 2 not verified: it drifts back to the prediction
    assert calibration.ratio(2) == pytest.approx(1 / 1.25)


def test_budget_threshold_from_the_measured_costs():
    assert node_threshold(0.05, 4.0) == pytest.approx(0.2)
    assert node_threshold(0.0, 4.0) == draft_tree.MIN_NODE_PROBABILITY and node_threshold(1.0, 4.0) == 1.0
    budget = TreeBudget()
    assert budget.threshold() == budget.floor  # before any cycle: the widest tree, so that its cost is measured
    budget.observe(width=6, committed=2.0, seconds=1.0)
    assert budget.marginal_cost() == pytest.approx(PRIOR_COST_PER_TOKEN)  # one width: the prior share of a cycle
    assert budget.threshold() == pytest.approx(PRIOR_COST_PER_TOKEN * 2.0)
    linear = TreeBudget()
    for width in (4, 12, 8, 4, 12):
        linear.observe(width, committed=2.0, seconds=0.2 + 0.01 * width)
    assert linear.marginal_cost() == pytest.approx(0.01)
    assert linear.threshold() == pytest.approx(node_threshold(0.01, linear.rate()))
    flat = TreeBudget()  # the tests' clock: every cycle one second, whatever it verifies
    for width in (4, 12, 8):
        flat.observe(width, committed=2.0, seconds=1.0)
    assert flat.marginal_cost() == 0.0 and flat.threshold() == flat.floor


def test_markov_children_are_conditioned_on_their_parent_token():
    """With a Markov head, a node's children are the top tokens of the next slot's logits corrected for the node's
    own token; without one, every node at a depth has the same children."""
    target = make_target("llama")
    drafter = markov_drafter(target)
    generator = torch.Generator().manual_seed(3)
    logits, hidden = torch.randn(1, 3, VOCAB, generator=generator), torch.randn(1, 3, 64, generator=generator)

    def probabilities(x):
        return torch.softmax(x, dim=-1)

    candidates = SlotCandidates(logits, probabilities, None, drafter.markov_head, hidden).for_row(0)
    with torch.no_grad():
        for depth, token in [(0, 5), (1, 5), (1, 9), (2, 40)]:
            corrected = corrected_logits(
                drafter.markov_head, logits[0, depth][None], torch.tensor([token]), hidden[0, depth][None]
            )
            expected = torch.softmax(corrected[0], dim=-1).topk(draft_tree.TREE_CHILDREN)
            probs, tokens = candidates(depth, token)
            assert tokens == expected.indices.tolist() and probs == pytest.approx(expected.values.tolist())
        assert candidates(1, 5)[1] != candidates(1, 9)[1]  # the head tells the two parents' children apart
    plain = SlotCandidates(logits, probabilities).for_row(0)
    assert plain(1, 5) == plain(1, 9) and plain(1, 5)[1] == torch.softmax(logits[0, 1], -1).topk(4).indices.tolist()


# ---------------------------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("drafter_kind", ["random", "second choice", "markov head"])
def test_tree_greedy_equals_plain_greedy(family, drafter_kind):
    target = make_target(family)
    input_ids = _prompt(0, 2 * GEMMA_SLIDING_WINDOW + 3)  # past Gemma's sliding window from the first cycle on
    # no EOS (99 is never generated): every family runs its full length
    reference = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[99])
    if drafter_kind == "second choice":
        drafter = second_choice_oracle(target, [reference[0].tolist()])
    else:
        drafter = make_drafter(target) if drafter_kind == "random" else markov_drafter(target)
    out = dflash_hf.generate(
        target, drafter, input_ids, max_new_tokens=MAX_NEW, eos_token_id=[99], candidates="tree",
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, reference)
    if drafter_kind == "second choice":
        assert max(out.verify_widths[0]) > 4 and out.tau > 2.0  # side branches were verified and accepted


def test_second_choice_drafter_gets_more_accepted_with_the_tree():
    target = make_target("llama")
    input_ids = _prompt(1, 20)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    oracle = second_choice_oracle(target, [reference[0].tolist()])
    runs = {
        candidates: dflash_hf.generate(
            target, oracle, input_ids, max_new_tokens=MAX_NEW, candidates=candidates, return_dict_in_generate=True
        )
        for candidates in ("dflash", "tree")
    }
    assert all(torch.equal(out.sequences, reference) for out in runs.values())
    assert runs["dflash"].tau == 1.0  # the chain's first draft is always wrong
    assert runs["tree"].tau > 2.5


def test_left_padded_batch_rows_each_follow_their_own_tree():
    target = make_target("llama")
    prompts = [_prompt(10 + i, n)[0] for i, n in enumerate([7, 16, 11])]
    references = [  # no EOS (99 is never generated): every row runs its full length
        target.generate(p[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[99])[0] for p in prompts
    ]
    input_ids, attention_mask = left_padded(prompts)
    corrupt = corrupt_slots(4, slot_step=2)
    for drafter in (make_drafter(target), second_choice_oracle(target, [r.tolist() for r in references], corrupt)):
        out = dflash_hf.generate(
            target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW, eos_token_id=[99],
            candidates="tree", return_dict_in_generate=True,
        )  # fmt: skip
        assert_rows_are_greedy(out.sequences, input_ids.shape[1], prompts, references)
    assert len({tuple(widths) for widths in out.verify_widths}) > 1  # the rows verified trees of their own


def test_eos_and_max_new_tokens_inside_a_side_branch():
    """Every accepted draft comes through a side branch (the chain's first draft is always wrong), so the stop token
    and the last allowed token are committed from one."""
    target = make_target("llama")
    input_ids = _prompt(3, 20)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)[0].tolist()
    oracle = second_choice_oracle(target, [reference])
    stop = reference[20 + 6]
    expected = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[99, stop])
    out = dflash_hf.generate(
        target, oracle, input_ids, max_new_tokens=MAX_NEW, eos_token_id=[99, stop], candidates="tree",
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, expected) and max(out.accepted_lengths[0]) > 1
    assert_short_runs_are_greedy(target, oracle, input_ids, "tree")


def test_a_tree_held_to_one_branch_is_the_dflash_engine(monkeypatch):
    target = make_target("qwen3")
    input_ids = _prompt(4, 20)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    oracle = second_choice_oracle(target, [reference[0].tolist()], corrupt={(p, 2) for p in range(200)})
    monkeypatch.setattr(draft_tree.TreeBudget, "threshold", lambda self: float("inf"))  # no node is worth verifying
    tree = dflash_hf.generate(
        target, oracle, input_ids, max_new_tokens=MAX_NEW, candidates="tree", return_dict_in_generate=True
    )
    block = dflash_hf.generate(
        target, oracle, input_ids, max_new_tokens=MAX_NEW, candidates="dflash", return_dict_in_generate=True
    )
    assert torch.equal(tree.sequences, reference) and torch.equal(block.sequences, reference)
    assert tree.accepted_lengths == block.accepted_lengths and tree.verify_widths == block.verify_widths


def test_markov_tree_chain_is_the_drafters_sequential_argmax(monkeypatch):
    """The tree's chain is what the DFlash engine drafts through the Markov head (`TokenChoice.draft_chain`): each slot's top
    token after the chain's token before it."""
    target = make_target("llama")
    drafter = markov_drafter(target)
    input_ids = _prompt(5, 20)
    chains, drafts = [], []
    real_grow, real_propose = draft_tree.DraftTreeSearch.grow, token_choice.TokenChoice.propose

    def grow(self, anchors, candidates, slots, lookups):
        trees = real_grow(self, anchors, candidates, slots, lookups)
        chains.append(trees[0].tokens[1 : slots + 1])
        return trees

    def propose(self, draft_logits, rows, markov_inputs=None):
        tokens, probs = real_propose(self, draft_logits, rows, markov_inputs)
        drafts.append(tokens[0].tolist())
        return tokens, probs

    monkeypatch.setattr(draft_tree.DraftTreeSearch, "grow", grow)
    monkeypatch.setattr(token_choice.TokenChoice, "propose", propose)
    for candidates in ("tree", "dflash"):
        dflash_hf.generate(target, drafter, input_ids, max_new_tokens=5, candidates=candidates)
    assert len(chains[0]) == 3 and chains[0] == drafts[0]


def test_sampling_with_the_tree_verifies_the_chain(monkeypatch):
    """Sampling verifies the DFlash block alone (the chain) with the exact rejection sampler: the same draws as
    `candidates="dflash"`, and the target's distribution."""
    target, drafter = tiny_sampling_models()
    prompt = torch.tensor([[1, 2, 3]])
    dflash_hf.generate(target, drafter, prompt, max_new_tokens=2, do_sample=True)  # draws of a first call's set-up
    runs = []
    for candidates in ("dflash", "tree"):
        torch.manual_seed(0)
        runs.append(
            dflash_hf.generate(
                target,
                drafter,
                prompt.expand(8, -1),
                max_new_tokens=6,
                do_sample=True,
                candidates=candidates,
                return_dict_in_generate=True,
            )  # fmt: skip
        )
    assert torch.equal(runs[0].sequences, runs[1].sequences) and runs[1].verify_widths == runs[0].verify_widths
    monkeypatch.setattr(dflash_hf, "generate", functools.partial(dflash_hf.generate, candidates="tree"))
    statistic, cells = chi_square(target, drafter, prompt, exact_joint_of_tokens_2_and_3(target, prompt))
    assert statistic < chi_square_bound(cells), statistic


def test_row_exact_attention_gives_each_sequence_its_own_tree():
    """Row-exact attention (bf16 verification on CPU) attends each node over its decode step's keys; with a draft tree
    per row the sequences of a batch see different nodes, and each gets its own tree's keys."""
    module = torch.nn.Module()
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 2, 4, 8, generator=generator)
    key, value = torch.randn(2, 2, 7, 8, generator=generator), torch.randn(2, 2, 7, 8, generator=generator)
    sees = ancestor_mask(torch.tensor([[0, 0, 0, 0], [0, 0, 1, 2]]), 3)  # three children of the root; a chain
    mask = tree_attention_mask(torch.ones(2, 3, dtype=torch.long), sees, torch.float32)
    with row_exact.verification():
        together = row_exact._row_exact_sdpa(module, query, key, value, mask)[0]
        for i in range(2):
            alone = row_exact._row_exact_sdpa(
                module, query[i : i + 1], key[i : i + 1], value[i : i + 1], mask[i : i + 1]
            )[0]
            assert torch.equal(together[i], alone[0]), i
    masked = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask).transpose(1, 2)
    assert torch.allclose(together, masked, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_row_exact_bf16_draft_tree_equals_plain_bf16_greedy(family):
    reference_target, target = make_target(family).to(torch.bfloat16), make_target(family).to(torch.bfloat16)
    input_ids = _prompt(7, 2 * GEMMA_SLIDING_WINDOW + 3)
    reference = reference_target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[99])
    oracle = second_choice_oracle(target, [reference[0].tolist()]).to(torch.bfloat16)
    out = dflash_hf.generate(
        target, oracle, input_ids, max_new_tokens=MAX_NEW, eos_token_id=[99], candidates="tree",
        return_dict_in_generate=True,
    )  # fmt: skip
    if not row_exact.install(target, 4 + draft_tree.DEFAULT_TREE_NODES):
        pytest.skip("this CPU's bf16 kernels cannot be made row-exact for this target (install says so)")
    assert torch.equal(out.sequences, reference) and max(out.verify_widths[0]) > 4
