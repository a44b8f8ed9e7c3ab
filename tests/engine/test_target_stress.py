"""Today's target types under many random calls: 64 per type, each a random batch of 1-3 left-padded prompts, a random
block size (or the adaptive policy), candidate source and pattern of wrong drafts; every row of every call must equal
plain greedy decoding of its prompt."""

from __future__ import annotations

import random

import pytest
import torch
from testing_utils import (
    HYBRID_FAMILIES,
    MOE_FAMILIES,
    corrupt_slots,
    greedy_reference,
    left_padded,
    make_oracle,
    make_target,
)

import dflash_hf

TYPES = [*MOE_FAMILIES, *HYBRID_FAMILIES, "gemma4_text", "deepseek_v3"]
CALLS = 64
MAX_NEW = 16


@pytest.mark.parametrize("family", TYPES)
def test_random_calls_are_plain_greedy(family):
    rng = random.Random(family)
    target = make_target(family)
    target.generation_config.eos_token_id = None
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(3, 13))] for _ in range(8)]
    references = [greedy_reference(target, torch.tensor([p]), max_new_tokens=MAX_NEW)[0] for p in prompts]
    compared = 0
    for call in range(CALLS):
        chosen = rng.sample(range(len(prompts)), rng.randint(1, 3))
        corrupt = corrupt_slots(rng.randint(2, 5), rng.randint(1, 3), rng.randint(1, 2))
        oracle = make_oracle(target, [references[i].tolist() for i in chosen], corrupt=corrupt)
        input_ids, mask = left_padded([prompts[i] for i in chosen])
        options = dict(
            block_size=rng.choice([2, 3, 4, "adaptive"]), candidates=rng.choice(["dflash", "dflash+lookup", "tree"])
        )
        out = dflash_hf.generate(target, oracle, input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, **options)
        for row, i in enumerate(chosen):
            generated = out[row, input_ids.shape[1] :]
            assert torch.equal(generated, references[i][len(prompts[i]) :]), (family, call, options, i)
            compared += 1
    assert compared >= CALLS
