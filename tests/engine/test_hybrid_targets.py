"""Hybrid targets (Qwen3.5/3.6 `qwen3_5_text`, Qwen3.5-MoE `qwen3_5_moe_text`, Qwen3-Next `qwen3_next`: Gated
DeltaNet layers with a recurrent state), Gemma 4 (`gemma4_text`: per-layer head sizes, per-layer inputs, shared keys
and values), DeepSeek-V3 / Kimi K2 (`deepseek_v3`: latent attention) and Muse-Glimmer (`muse_glimmer_text`: logits
scaled before the cap), bare and in their multimodal wrappers: exact against plain greedy with partial acceptances in
left-padded batches, EOS inside blocks, sampling exact in distribution; what a recurrent state cannot verify refused."""

from __future__ import annotations

import pytest
import torch
from testing_utils import (
    COMMON,
    HYBRID_FAMILIES,
    WRAPPERS,
    CountingBackend,
    assert_rows_are_greedy,
    chi_square,
    chi_square_bound,
    corrupt_slots,
    exact_joint_of_tokens_2_and_3,
    greedy_reference,
    left_padded,
    make_drafter,
    make_oracle,
    make_target,
    make_wrapped_target,
    tiny_sampling_target,
)
from transformers import CompileConfig

import dflash_hf
from dflash_hf import DFlashConfig
from dflash_hf.target import TargetAdapter, linear_attention
from dflash_hf.target.linear_attention import new_target_cache
from dflash_hf.target.support import SUPPORTED_TARGET_TYPES

PROMPTS = [[5, 7, 3, 9, 4, 6, 8, 10, 3, 11, 13], [6, 6, 4, 12], [11, 3, 5, 7, 9, 4, 20, 21]]
MAX_NEW = 24
FAMILIES = [*HYBRID_FAMILIES, "gemma4_text", "deepseek_v3"]


def _prepared(target):
    target.generation_config.eos_token_id = None  # long continuations: every cycle verifies a full block
    references = [greedy_reference(target, torch.tensor([p]), max_new_tokens=MAX_NEW)[0] for p in PROMPTS]
    return target, references


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request):
    return (request.param, *_prepared(make_target(request.param)))


def _generate(target, references, **options):
    oracle = make_oracle(target, [r.tolist() for r in references], corrupt=options.pop("corrupt", corrupt_slots(3)))
    input_ids, mask = left_padded(PROMPTS)
    out = dflash_hf.generate(
        target, oracle, input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, return_dict_in_generate=True, **options
    )
    return out, input_ids


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup", "tree"])
@pytest.mark.parametrize("block_size", [2, 4, "adaptive"])
def test_hybrid_and_gemma4_targets_are_exact_with_partial_acceptances(hybrid, candidates, block_size):
    """Oracle drafts with corrupted slots: rows accept different lengths every cycle, every rollback path runs (a
    hybrid target's tree verifies run every root-to-leaf path on a state of its own)."""
    family, target, references = hybrid
    assert family in SUPPORTED_TARGET_TYPES
    out, input_ids = _generate(target, references, candidates=candidates, block_size=block_size)
    assert_rows_are_greedy(out.sequences, input_ids.shape[1], PROMPTS, references, (family, candidates, block_size))
    lengths = {n for row in out.accepted_lengths for n in row}
    if block_size != "adaptive":
        assert len(lengths) > 1  # partial acceptances


@pytest.mark.parametrize("corrupt", [None, corrupt_slots(2), corrupt_slots(5, slot_step=2)])
def test_hybrid_rows_accepting_whole_blocks_and_parts(corrupt):
    """Whole blocks (the verify's own state kept), and rows of one batch that accept different counts in a cycle."""
    target, references = _prepared(make_target("qwen3_5_text"))
    out, input_ids = _generate(target, references, candidates="dflash", block_size=4, corrupt=corrupt)
    assert_rows_are_greedy(out.sequences, input_ids.shape[1], PROMPTS, references, corrupt is None)
    if corrupt is None:
        assert max(n for row in out.accepted_lengths for n in row) == 4
    else:
        assert any(len({row[c] for row in out.accepted_lengths if c < len(row)}) > 1 for c in range(4))


@pytest.mark.parametrize("candidates", ["dflash", "tree"])
def test_the_recurrent_rollback_is_what_makes_it_exact(monkeypatch, candidates):
    """States not advanced over the accepted prefix (left where the verify started) diverge from plain greedy."""
    target, references = _prepared(make_target("qwen3_next"))
    monkeypatch.setattr(
        linear_attention.LinearAttentionStates,
        "_advanced",
        staticmethod(lambda module, recorded, inputs, start, count, window: start),
    )
    out, input_ids = _generate(target, references, candidates=candidates, block_size=4)
    with pytest.raises(AssertionError):
        assert_rows_are_greedy(out.sequences, input_ids.shape[1], PROMPTS, references)


def test_hybrid_and_gemma4_targets_stop_at_eos_inside_a_block(hybrid):
    family, target, references = hybrid
    eos = int(references[0][len(PROMPTS[0]) + 5])  # a token the first row generates mid-answer
    oracle = make_oracle(target, [r.tolist() for r in references])
    input_ids, mask = left_padded(PROMPTS)
    out = dflash_hf.generate(target, oracle, input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    for i, prompt in enumerate(PROMPTS):
        reference = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
        generated = reference[0, len(prompt) :]
        assert torch.equal(out[i, input_ids.shape[1] : input_ids.shape[1] + len(generated)], generated), (family, i)


@pytest.mark.parametrize(
    ("family", "candidates"),
    [
        ("qwen3_5_text", "dflash"),
        ("qwen3_5_text", "dflash+lookup"),
        ("qwen3_5_moe_text", "dflash+lookup"),
        ("qwen3_next", "dflash"),
    ],
)
def test_compiled_hybrid_targets_are_exact_with_one_graph_per_width(family, candidates):
    """`compile=True` on a hybrid target: static keys and values, fixed-size linear-attention states, the recurrent
    rollback after each compiled verify; traced whole (`fullgraph`) with a random drafter, and exact with partial
    acceptances in a padded batch (the test oracle's lookups run outside the graph), where a second call compiles
    nothing new (its cache from the pool, its states zeroed)."""
    torch._dynamo.reset()
    target, references = _prepared(make_target(family))
    prompt = torch.tensor([PROMPTS[0]])
    whole = CompileConfig(backend=CountingBackend(), mode=None, fullgraph=True)
    out = dflash_hf.generate(
        target, make_drafter(target), prompt, max_new_tokens=MAX_NEW, candidates=candidates, compile=whole
    )
    assert torch.equal(out, greedy_reference(target, prompt, max_new_tokens=MAX_NEW))
    torch._dynamo.reset()
    backend = CountingBackend()
    config = CompileConfig(backend=backend, mode=None, fullgraph=False)
    graphs = []
    for call in range(2):
        out, input_ids = _generate(target, references, candidates=candidates, block_size=4, compile=config)
        assert_rows_are_greedy(out.sequences, input_ids.shape[1], PROMPTS, references, (family, candidates, call))
        graphs.append(backend.frame_count)
    assert graphs[0] > 0 and graphs[1] == graphs[0]  # compiled, then nothing recompiled
    torch._dynamo.reset()


def test_compiled_draft_trees_are_refused_on_a_recurrent_state():
    target = make_target("qwen3_5_text")
    with pytest.raises(ValueError, match='candidates="tree" with compile=True.*compile=False'):
        dflash_hf.generate(target, make_drafter(target), torch.tensor([PROMPTS[0]]), candidates="tree", compile=True)


def test_drafters_from_hybrid_and_gemma4_configs():
    """`from_target` reads per-layer configs (Gemma 4's head sizes) and gives the drafter a RoPE over its whole head
    at the target's full-attention base (Qwen3.5's partial multimodal RoPE and Gemma 4's proportional one dropped)."""
    qwen = DFlashConfig.from_target(make_target("qwen3_5_text").config, num_target_features=2)
    assert "partial_rotary_factor" not in qwen.rope_parameters and "mrope_section" not in qwen.rope_parameters
    gemma = make_target("gemma4_text")
    config = DFlashConfig.from_target(gemma.config, num_target_features=2)
    assert config.head_dim == COMMON["head_dim"] and config.target_model_type == "gemma4_text"
    assert config.rope_parameters["rope_type"] == "default"
    assert config.rope_parameters["rope_theta"] == gemma.config.rope_parameters["full_attention"]["rope_theta"]
    assert not getattr(gemma.config, "allow_global_per_layer_attribute_access", False)  # the target's config untouched


def test_the_adapter_gives_the_targets_own_logits():
    """Muse-Glimmer multiplies its logits before the softcap: the engine's logits are the model's, bit for bit."""
    target = make_wrapped_target("muse_glimmer")
    adapter = TargetAdapter(target, [1, 3])
    ids = torch.tensor([PROMPTS[0]])
    step = adapter.forward(ids, None, torch.arange(ids.shape[1])[None], new_target_cache(target))
    expected = target(ids).logits.float()
    torch.testing.assert_close(adapter.logits(step.last_hidden_state), expected, rtol=0, atol=1e-5)
    assert make_drafter(target).config.output_multiplier == target.config.text_config.output_multiplier


@pytest.mark.parametrize("model_type", list(WRAPPERS))
def test_multimodal_wrappers_generate_text_exactly(model_type):
    target, references = _prepared(make_wrapped_target(model_type))
    out, input_ids = _generate(target, references, candidates="dflash+lookup", block_size=4)
    assert_rows_are_greedy(out.sequences, input_ids.shape[1], PROMPTS, references, model_type)
    drafter = make_drafter(target)
    assert drafter.config.target_model_type == target.config.get_text_config(decoder=True).model_type


def test_sampling_on_a_hybrid_target_is_exact_in_distribution():
    """A tiny Qwen3.5 over 8 ids: tokens 2 and 3 of speculative samples (a batch whose rows accept different counts,
    so rows roll back in groups) follow plain sampling's joint."""
    target, drafter = tiny_sampling_target(
        "qwen3_5_text", linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8
    )
    prompt = torch.tensor([[1, 2, 3, 4]])
    statistic, cells = chi_square(target, drafter, prompt, exact_joint_of_tokens_2_and_3(target, prompt), "sample")
    assert statistic < chi_square_bound(cells), statistic


@pytest.mark.parametrize(
    ("shape", "model_type", "layers"),
    [("qwen3.5-9b", "qwen3_5_text", 32), ("qwen3.6-27b", "qwen3_5_text", 64), ("gemma-4-31b", "gemma4_text", 60)],
)
def test_real_shapes_and_their_scaled_down_twins(shape, model_type, layers):
    """The public shapes (configs only, nothing built) and their scaled-down twins, which build and run here."""
    from dflash_hf.random_targets import random_config

    config = random_config(f"random:{shape}")
    assert config.model_type == model_type and config.num_hidden_layers == layers
    assert DFlashConfig.from_target(config).hidden_size == config.hidden_size
    twin_name = {"qwen3_5_text": "random:tiny-qwen3.5", "gemma4_text": "random:tiny-gemma4"}[model_type]
    twin, _ = dflash_hf.targets.load_target(twin_name, dtype="float32")
    assert twin.config.model_type == model_type
    drafter = make_drafter(twin)
    prompt = torch.tensor([[5, 7, 3, 9]])
    for candidates in ("dflash", "tree"):
        out = dflash_hf.generate(twin, drafter, prompt, max_new_tokens=8, candidates=candidates)
        assert torch.equal(out, greedy_reference(twin, prompt, max_new_tokens=8))


def test_compiled_hybrid_rows_that_stop_early_leave_the_batch_exactly():
    """Compiled on a hybrid target, rows that reach EOS leave the batch (their keys, values and linear-attention
    states with them) and the others go on exactly."""
    torch._dynamo.reset()
    target, references = _prepared(make_target("qwen3_5_text"))
    eos = int(references[1][len(PROMPTS[1]) + 3])  # the second row stops early
    oracle = make_oracle(target, [r.tolist() for r in references], corrupt=corrupt_slots(3))
    input_ids, mask = left_padded(PROMPTS)
    config = CompileConfig(backend=CountingBackend(), mode=None, fullgraph=False)
    out = dflash_hf.generate(
        target, oracle, input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, compile=config
    )
    for i, prompt in enumerate(PROMPTS):
        reference = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
        generated = reference[0, len(prompt) :]
        assert torch.equal(out[i, input_ids.shape[1] : input_ids.shape[1] + len(generated)], generated), i
    torch._dynamo.reset()
