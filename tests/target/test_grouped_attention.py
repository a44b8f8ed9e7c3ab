"""Grouped-query attention without key/value copies (`target.grouped_attention`): the same bits as `sdpa` for every
family and precision (causal blocks over a cache, left-padded batches, tree masks), switched on only inside the
engine's blocks, and what the engine's calls run in."""

from __future__ import annotations

import threading

import pytest
import torch
from testing_utils import FAMILIES, GEMMA_SLIDING_WINDOW, VOCAB, make_drafter, make_target
from transformers.cache_utils import DynamicCache

from dflash_hf import generate
from dflash_hf.engine.cache_ops import truncate_cache
from dflash_hf.engine.tree import tree_attention_mask
from dflash_hf.target import row_exact
from dflash_hf.target.grouped_attention import ATTENTION_NAME, grouped_attention


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every `scaled_dot_product_attention` call: (query heads, key heads, query rows, masked, enable_gqa)."""
    calls: list[tuple[int, int, int, bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append(
            (query.shape[1], key.shape[1], query.shape[2], attn_mask is not None, kwargs.get("enable_gqa", False))
        )
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def _assert_same_bits_both_ways(target, cache: DynamicCache, context: int, block: torch.Tensor, **kwargs) -> None:
    """A forward of `block` on the cached context (rolled back after) gives the same logits in `sdpa` and grouped."""

    def forward() -> torch.Tensor:
        logits = target(block, cache=cache, use_cache=True, **kwargs).logits
        truncate_cache(cache, context)
        return logits

    stock = forward()
    with grouped_attention(target):
        grouped = forward()
    assert torch.equal(stock, grouped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_same_bits_as_sdpa_for_blocks_padded_batches_and_trees(family, dtype, sdpa_calls):
    target = make_target(family).to(dtype)
    generator = torch.Generator().manual_seed(0)
    context = 2 * GEMMA_SLIDING_WINDOW + 3  # past Gemma's sliding window
    ids = torch.randint(3, VOCAB, (2, context), generator=generator)
    padding = torch.ones_like(ids)
    padding[0, :4] = 0  # a left-padded row
    cache = DynamicCache()
    with torch.no_grad():
        target(ids, attention_mask=padding, cache=cache, use_cache=True)
        block = torch.randint(3, VOCAB, (2, 5), generator=generator)
        block_mask = torch.cat([padding, torch.ones_like(block)], dim=1)
        _assert_same_bits_both_ways(target, cache, context, block, attention_mask=block_mask)
        # a tree: node 0 the anchor, nodes 1-2 one branch, nodes 3-4 another, both from the anchor
        sees = torch.eye(5, dtype=torch.bool)
        sees[:, 0] = True
        sees[2, 1] = sees[4, 3] = True
        positions = padding.sum(-1, keepdim=True) + torch.tensor([0, 1, 2, 1, 2])
        window = GEMMA_SLIDING_WINDOW if family == "gemma3" else None
        mask = tree_attention_mask(padding, sees[None].expand(2, -1, -1), dtype, positions, window)
        _assert_same_bits_both_ways(target, cache, context, block, attention_mask=mask, position_ids=positions)
    heads, kv_heads = target.config.num_attention_heads, target.config.num_key_value_heads
    masked_blocks = [call for call in sdpa_calls if call[2] == 5 and call[3]]
    # stock sdpa attends masked blocks over key/value heads copied per query head; grouped attention over the groups
    assert {call[1:] for call in masked_blocks} == {(heads, 5, True, False), (kv_heads, 5, True, True)}


def test_switch_is_scoped_shared_across_threads_and_leaves_other_attention_alone():
    target = make_target("llama")
    with grouped_attention(target):
        assert target.config._attn_implementation == ATTENTION_NAME
        inside, release = threading.Event(), threading.Event()

        def other_call() -> None:
            with grouped_attention(target):
                inside.set()
                release.wait()

        thread = threading.Thread(target=other_call)
        thread.start()
        inside.wait()
    assert target.config._attn_implementation == ATTENTION_NAME  # the other call's block is still open
    release.set()
    thread.join()
    assert target.config._attn_implementation == "sdpa"
    eager = make_target("llama", attn_implementation="eager")
    with grouped_attention(eager):
        assert eager.config._attn_implementation == "eager"
    exact = make_target("llama").to(torch.bfloat16)
    row_exact.install(exact, 4)
    with row_exact.attention(exact), grouped_attention(exact):  # an engine call's row-exact attention: left alone
        assert exact.config._attn_implementation == row_exact.ATTENTION_NAME
    with grouped_attention(target):
        target.set_attn_implementation("eager")  # switched by someone else meanwhile: kept
    assert target.config._attn_implementation == "eager"


def test_engine_calls_run_in_grouped_attention_and_stay_exact(sdpa_calls):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    seen: list[str] = []
    target.model.register_forward_hook(lambda module, args, out: seen.append(target.config._attn_implementation))
    prompt = torch.tensor([[1, 5, 9, 12, 5, 9, 3, 3, 7, 7]])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    seen.clear()
    output = generate(target, drafter, prompt, max_new_tokens=24, min_new_tokens=24)
    assert torch.equal(output, expected)
    assert seen and set(seen) == {ATTENTION_NAME} and target.config._attn_implementation == "sdpa"
    assert any(call[3] and call[4] and call[2] > 1 for call in sdpa_calls)  # masked blocks read the groups directly


def test_padded_batches_draft_in_grouped_attention_too(sdpa_calls):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    seen: list[str] = []
    drafter.register_forward_hook(lambda module, args, out: seen.append(drafter.config._attn_implementation))
    prompts = torch.tensor([[0, 0, 0, 1, 5, 9, 12, 5, 9], [1, 7, 7, 3, 30, 31, 7, 7, 40]])
    mask = (prompts != 0).long()
    mask[1, 0] = 1
    expected = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    output = generate(target, drafter, prompts, attention_mask=mask, max_new_tokens=16, min_new_tokens=16)
    assert torch.equal(output, expected)
    assert seen and set(seen) == {ATTENTION_NAME} and drafter.config._attn_implementation == "sdpa"


def test_an_sdpa_variant_runs_under_its_name_with_a_flag_scoped_to_its_block_and_thread():
    """`target.attention_registry.SdpaVariant`, which grouped and row-exact attention are registered with."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash_hf.target.attention_registry import SdpaVariant

    seen: list[bool] = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        seen.append(variant.is_flagged())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    variant = SdpaVariant("test_variant_sdpa", attention)
    target = make_target("qwen3")
    ids = torch.tensor([[1, 5, 9, 12]])
    expected = target(ids).logits
    target.set_attn_implementation(variant.name)
    layers = target.config.num_hidden_layers
    elsewhere: list[bool] = []
    with variant.flagged():
        assert torch.equal(target(ids).logits, expected)
        with variant.flagged(False):
            assert not variant.is_flagged()
        thread = threading.Thread(target=lambda: elsewhere.append(variant.is_flagged()))
        thread.start()
        thread.join()
    target(ids)
    assert seen == [True] * layers + [False] * layers and elsewhere == [False]
    with pytest.raises(ValueError, match="'flash' in it"):
        SdpaVariant("flash_test_sdpa", attention)
