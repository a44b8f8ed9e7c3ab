"""The candidate plan: which source a call draws from, and the widest verify that the row-exact set-up, `dflash-hf
generate` and the bench read from it."""

from __future__ import annotations

import pytest
import torch
from testing_utils import make_drafter, make_target

import dflash_hf
from dflash_hf.engine import generation_call
from dflash_hf.engine.candidates import (
    CANDIDATE_SOURCES,
    CandidatePlan,
    DFlashChain,
    DraftTreeCandidates,
    LookupBranch,
    candidate_source,
)
from dflash_hf.engine.draft_tree import DEFAULT_TREE_NODES
from dflash_hf.engine.lookup import DEFAULT_LOOKUP_TOKENS


@pytest.mark.parametrize(
    ("candidates", "block", "lookup_tokens", "width"),
    [
        ("dflash", 8, None, 8),
        ("dflash+lookup", 4, None, 4 + DEFAULT_LOOKUP_TOKENS),  # the default branch is longer than a small block's
        ("dflash+lookup", 16, None, 16 + 15),  # ... and block - 1 long for a large one
        ("dflash+lookup", 8, 3, 8 + 3),
        ("tree", 4, None, 4 + DEFAULT_TREE_NODES),  # the tree's extra nodes include its lookup tokens
    ],
)
def test_plan_verify_width(candidates, block, lookup_tokens, width):
    plan = CandidatePlan(candidates, block, lookup_tokens)
    assert plan.source == candidates and plan.verify_width == width
    assert plan.lookup_branch == (candidates != "dflash")


@pytest.mark.parametrize("candidates", CANDIDATE_SOURCES)
def test_a_call_that_cannot_verify_trees_verifies_the_chain(candidates):
    plan = CandidatePlan(candidates, 8, 5, tree_verify=False)
    assert plan.source == "dflash" and not plan.lookup_branch and plan.verify_width == 8


def test_each_source_is_the_plans():
    kinds = {"dflash": DFlashChain, "dflash+lookup": LookupBranch, "tree": DraftTreeCandidates}
    chain = DFlashChain.__new__(DFlashChain)  # the source's own parts are not used to choose it
    for candidates, kind in kinds.items():
        assert type(candidate_source(CandidatePlan(candidates, 4), chain, lookups=None)) is kind
    assert candidate_source(CandidatePlan("tree", 4, tree_verify=False), chain, lookups=None) is chain


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_the_call_sets_up_row_exact_verification_for_its_plans_width(monkeypatch, sampling):
    target = make_target("llama")
    drafter = make_drafter(target)
    widths = []
    real = generation_call.Verifier.__init__

    def recording(self, adapter, cache, choice, verify_width, *args):
        widths.append(verify_width)
        real(self, adapter, cache, choice, verify_width, *args)

    monkeypatch.setattr(generation_call.Verifier, "__init__", recording)
    prompt = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    for candidates in CANDIDATE_SOURCES:
        dflash_hf.generate(target, drafter, prompt, max_new_tokens=2, do_sample=sampling, candidates=candidates)
    block = int(drafter.config.block_size)
    expected = [CandidatePlan(c, block, tree_verify=not sampling).verify_width for c in CANDIDATE_SOURCES]
    assert widths == expected
    assert len(set(widths)) == (1 if sampling else 3)
