"""The linear-attention states of a hybrid target (`target.linear_attention`): a tree verify's path batch, and the
states a verify leaves once a path is kept, against plain decoding's one-token steps."""

from __future__ import annotations

import pytest
import torch
from testing_utils import HYBRID_FAMILIES, make_target

from dflash_hf.engine.cache_ops import keep_path
from dflash_hf.engine.tree import ancestor_mask, tree_attention_mask
from dflash_hf.target import TargetAdapter, linear_attention
from dflash_hf.target.linear_attention import new_target_cache

PROMPT = [5, 7, 3, 9, 4, 6, 8, 10, 3, 11, 13]


def test_tree_paths_of_a_batch():
    """A row's root-to-leaf paths, short ones padded with their leaf, missing ones with the row's first path; every
    node takes the output of the first path through it, padding nodes the root's."""
    trees = [[0, 0, 1, 1, 0], [0, 0]]  # row 0: 0 -> 1 -> {2, 3}, 0 -> 4; row 1: 0 -> 1 (and two padding nodes)
    paths = linear_attention.path_batch(trees, width=5, device=torch.device("cpu"))
    assert (paths.paths, paths.length) == (3, 3)
    chains = paths.nodes.view(2, 3, 3).tolist()
    assert chains[0] == [[0, 1, 2], [0, 1, 3], [0, 4, 4]]
    assert chains[1] == [[5, 6, 6]] * 3
    assert paths.node_path.tolist() == [[0, 0, 0, 1, 2], [0, 0, 0, 0, 0]]
    row_1 = [(position // 3 - 3, position % 3) for position in paths.outputs.view(2, 5)[1].tolist()]
    assert row_1 == [(0, 0), (0, 1), (0, 0), (0, 0), (0, 0)]


def _stepped(adapter: TargetAdapter, prompt: torch.Tensor, tokens: torch.Tensor):
    """Plain decoding's way: the prompt prefilled, then `tokens` one step each; the cache and the last step's logits."""
    cache = new_target_cache(adapter.target)
    step = adapter.forward(prompt, None, torch.arange(prompt.shape[1])[None], cache)
    for j in range(tokens.shape[1]):
        position = torch.tensor([[prompt.shape[1] + j]])
        step = adapter.forward(tokens[:, j : j + 1], None, position, cache)
    return cache, adapter.logits(step.last_hidden_state)[0, -1]


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
@pytest.mark.parametrize("path", [[0, 1, 3], [0, 4, 5], [0, 1, 2], [0]])
def test_a_tree_verify_on_a_recurrent_state_is_each_paths_own(family, path):
    """Every node of a branching tree gets the logits plain decoding gives after its path, and once a path is kept
    the states are those plain decoding has after it, and the next step continues exactly from it."""
    target = make_target(family)
    adapter = TargetAdapter(target, [1, 3])
    prompt = torch.tensor([PROMPT])
    parents, ids = [0, 0, 1, 1, 0, 4], torch.tensor([[13, 5, 9, 20, 31, 7]])
    cache = new_target_cache(target)
    states = linear_attention.LinearAttentionStates(target, adapter.base_model, cache)
    context = prompt.shape[1]
    adapter.forward(prompt, None, torch.arange(context)[None], cache)
    depths = torch.tensor([[0, 1, 2, 2, 1, 2]])
    sees = ancestor_mask(torch.tensor([parents]), 2)
    mask = tree_attention_mask(torch.ones(1, context, dtype=torch.long), sees, torch.float32)
    with states.verifying(linear_attention.path_batch([parents], 6, torch.device("cpu"))):
        step = adapter.forward(ids, mask, context + depths, cache)
    logits = adapter.logits(step.last_hidden_state)[0]
    for node in range(6):
        route = [node]
        while route[-1] != 0:
            route.append(parents[route[-1]])
        _, expected = _stepped(adapter, prompt, ids[:, route[::-1]])
        torch.testing.assert_close(logits[node], expected, rtol=0, atol=1e-4)
    order = torch.tensor([path])
    keep_path(cache, context, order)
    states.keep([len(path)], order)
    stepped, _ = _stepped(adapter, prompt, ids[:, path])
    for i in states.modules:
        for kind in ("conv_states", "recurrent_states"):
            mine, plain = getattr(cache.layers[i], kind)[0], getattr(stepped.layers[i], kind)[0]
            torch.testing.assert_close(mine, plain, rtol=0, atol=1e-4)
    following = torch.tensor([[42]])
    step = adapter.forward(following, None, torch.tensor([[context + len(path)]]), cache)
    _, expected = _stepped(adapter, prompt, torch.cat([ids[:, path], following], dim=1))
    # float32 rounding of a tree forward against one-token steps, grown through one more step of a random model
    torch.testing.assert_close(adapter.logits(step.last_hidden_state)[0, -1], expected, rtol=0, atol=5e-4)


def test_the_state_alone_is_transformers_recurrences_state():
    """Without `flash-linear-attention` the rollback advances the state alone: the state Transformers' recurrence
    ends in (grouped keys: 2 key heads for 4 value heads)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    generator = torch.Generator().manual_seed(0)
    rows, tokens = 3, 5
    query, key = (torch.randn(rows, tokens, 2, 16, generator=generator) for _ in range(2))
    value = torch.randn(rows, tokens, 4, 16, generator=generator)
    g, beta = -torch.rand(rows, tokens, 4, generator=generator), torch.rand(rows, tokens, 4, generator=generator)
    start = torch.randn(rows, 4, 16, 16, generator=generator)
    _, expected = qwen.torch_recurrent_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    got = linear_attention._state_after(qwen.l2norm(key, dim=-1, eps=1e-6), value, g, beta, start)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_with_recurrence_kernels_the_layers_own_recurrence_rolls_back(monkeypatch):
    """Where Transformers has `flash-linear-attention`, the rollback calls the layer's own recurrence (here its
    PyTorch one, which that path dispatches to without the package): the same exact outputs."""
    monkeypatch.setattr(linear_attention, "_RECURRENCE_KERNELS", True)
    test_a_tree_verify_on_a_recurrent_state_is_each_paths_own("qwen3_next", [0, 4, 5])
    test_a_tree_verify_on_a_recurrent_state_is_each_paths_own("qwen3_5_text", [0, 1, 2])
