"""The drafter as a Transformers model: config derivation, attention backends, cache contents, bad input."""

from __future__ import annotations

import pytest
import torch
from testing_utils import make_drafter, make_target, make_target_config
from transformers import (
    AutoConfig,
    AutoModel,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
)

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel, default_target_layer_ids


@pytest.mark.parametrize(
    "layers, features, expected",
    [(36, 5, [1, 9, 17, 25, 33]), (32, 5, [1, 8, 15, 22, 29]), (30, 5, [1, 8, 14, 20, 27]), (36, 1, [18])],
)
def test_default_target_layer_ids(layers, features, expected):
    assert default_target_layer_ids(layers, features) == expected


def test_from_target_derives_every_dimension(family):
    target_config = make_target_config(family)
    config = DFlashConfig.from_target(target_config, num_hidden_layers=3, block_size=8, num_target_features=2)
    assert config.hidden_size == target_config.hidden_size
    assert config.num_attention_heads == target_config.num_attention_heads
    assert config.num_key_value_heads == target_config.num_key_value_heads
    assert config.head_dim == target_config.head_dim
    assert config.intermediate_size == target_config.intermediate_size
    assert config.vocab_size == target_config.vocab_size
    assert config.num_target_layers == target_config.num_hidden_layers
    assert config.target_layer_ids == default_target_layer_ids(target_config.num_hidden_layers, 2)
    assert config.mask_token_id == target_config.vocab_size - 1
    assert config.to_dict()["target_layer_ids"] == config.target_layer_ids  # always written out


def test_qwen3_mask_token_is_first_spare_row():
    class FakeTokenizer:
        def __len__(self):
            return 151669

    target_config = make_target_config("qwen3")
    target_config.vocab_size = 151936
    config = DFlashConfig.from_target(target_config, num_target_features=2, tokenizer=FakeTokenizer())
    assert config.mask_token_id == 151669


def test_a_tokenizers_own_mask_token_is_the_mask():
    """A tokenizer that declares a mask token (Gemma's `<mask>`, 4, as z-lab's Gemma 4 drafters use) gives it."""

    class GemmaTokenizer:
        mask_token_id = 4

        def __len__(self):
            return 64

    config = DFlashConfig.from_target(make_target_config("gemma3"), num_target_features=2, tokenizer=GemmaTokenizer())
    assert config.mask_token_id == 4


def test_gguf_tokenizer_placeholders_are_spare_rows():
    """A tokenizer read from a GGUF lists every embedding row, the spare ones as `[PADn]`: those are not its tokens."""

    class GGUFTokenizer:
        def __len__(self):
            return 151936

        def convert_ids_to_tokens(self, index):
            return f"[PAD{index}]" if index >= 151665 else "<|file_sep|>" if index == 151664 else "x"

    target_config = make_target_config("qwen2")
    target_config.vocab_size = 151936
    config = DFlashConfig.from_target(target_config, num_target_features=2, tokenizer=GGUFTokenizer())
    assert config.mask_token_id == 151665


def test_save_pretrained_writes_auto_map_and_remote_files(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_dflash.py", "modeling_dflash.py"} <= files
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.auto_map["AutoModel"].endswith("modeling_dflash.DFlashDraftModel")
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, DFlashDraftModel)
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key])


@pytest.mark.parametrize("layout", ["dflash-hf", "official"])
def test_draft_vocabulary_survives_save_and_export(tmp_path, layout):
    target = make_target("llama")
    drafter = make_drafter(target, draft_vocab_size=6)
    drafter.set_draft_vocabulary([3, 9, 10, 20, 40, 63])
    folder = tmp_path / "drafter"
    if layout == "dflash-hf":
        drafter.save_pretrained(folder)
    else:
        dflash_hf.export(drafter, folder, target=target, format="official", base_model="org/tiny")
    loaded = DFlashDraftModel.from_pretrained(folder)
    assert loaded.config.draft_vocab_size == 6
    assert loaded.draft_token_ids.tolist() == [3, 9, 10, 20, 40, 63]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        loaded.set_draft_vocabulary([1, 2])


def _drafter_inputs(drafter, batch=2, n_ctx=7, block=4, padded=True):
    torch.manual_seed(3)
    hidden = drafter.config.hidden_size
    features = len(drafter.config.target_layer_ids) * hidden
    noise = torch.randn(batch, block, hidden)
    context = torch.randn(batch, n_ctx, features)
    positions = torch.arange(n_ctx + block)[None].expand(batch, -1)
    mask = torch.ones(batch, n_ctx + block, dtype=torch.long)
    if padded:
        mask[0, :3] = 0
    return noise, context, positions, mask


@pytest.mark.parametrize("padded", [False, True])
def test_eager_and_sdpa_agree(padded):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    eager = make_drafter(target)
    eager.load_state_dict(drafter.state_dict())
    eager.config._attn_implementation = "eager"
    noise, context, positions, mask = _drafter_inputs(drafter, padded=padded)
    a = drafter(noise, context, positions, mask).last_hidden_state
    b = eager(noise, context, positions, mask).last_hidden_state
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_hidden_states_and_attentions_as_every_transformers_model():
    """`output_hidden_states` gives the first layer's input and every layer's output (the last one the normed
    `last_hidden_state`), `output_attentions` every layer's attention weights (eager), `return_dict=False` a tuple;
    the output itself stays the same."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.config._attn_implementation = "eager"
    noise, context, positions, mask = _drafter_inputs(drafter, padded=True)
    plain = drafter(noise, context, positions, mask)
    out = drafter(noise, context, positions, mask, output_hidden_states=True, output_attentions=True)
    assert plain.hidden_states is None and plain.attentions is None
    assert torch.equal(out.last_hidden_state, plain.last_hidden_state)

    layers, (batch, block, _), n_ctx = drafter.config.num_hidden_layers, noise.shape, context.shape[1]
    assert len(out.hidden_states) == layers + 1 and len(out.attentions) == layers
    assert torch.equal(out.hidden_states[0], noise)
    with torch.no_grad():
        first_layer = drafter.layers[0](
            noise,
            context_hidden_states=drafter.fuse_context(context),
            position_embeddings=drafter.rotary_emb(noise, positions),
            attention_mask=drafter._attention_mask_for_backend(mask, block, n_ctx + block),
        )
    assert torch.equal(out.hidden_states[1], first_layer)
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    for weights in out.attentions:
        assert weights.shape == (batch, drafter.config.num_attention_heads, block, n_ctx + block)
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
        assert not weights[0, :, :, :3].any()  # the padded context keys of row 0

    as_tuple = drafter(noise, context, positions, mask, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], plain.last_hidden_state)


def test_padding_mask_hides_padded_context():
    target = make_target("llama")
    drafter = make_drafter(target)
    noise, context, positions, mask = _drafter_inputs(drafter, padded=True)
    changed = context.clone()
    changed[0, :3] = 100.0  # masked positions: must not matter
    a = drafter(noise, context, positions, mask).last_hidden_state
    b = drafter(noise, changed, positions, mask).last_hidden_state
    torch.testing.assert_close(a, b)


def test_gradient_checkpointing_gives_same_gradients():
    target = make_target("llama")
    drafter = make_drafter(target).train()
    noise, context, positions, mask = _drafter_inputs(drafter, padded=False)
    drafter(noise, context, positions).last_hidden_state.pow(2).sum().backward()
    reference = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    enable = getattr(drafter, "activation_checkpointing_enable", None) or drafter.gradient_checkpointing_enable
    enable()
    drafter(noise, context, positions).last_hidden_state.pow(2).sum().backward()
    for name, param in drafter.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], atol=1e-5, rtol=1e-5)


def test_draft_cache_holds_exactly_the_committed_context(family):
    """After every cycle the draft cache equals a from-scratch encoding of the committed tokens, nothing more."""
    target = make_target(family)
    drafter = make_drafter(target)
    calls = []
    original = drafter.forward

    def recording_forward(
        noise_embeds, context_hidden_states=None, position_ids=None, attention_mask=None, cache=None, **kwargs
    ):
        snapshot = [
            (layer.keys.clone(), layer.values.clone())
            for layer in cache.layers
            if getattr(layer, "keys", None) is not None
        ]
        calls.append((snapshot, cache.get_seq_length(), context_hidden_states.shape[1]))
        return original(noise_embeds, context_hidden_states, position_ids, attention_mask, cache=cache, **kwargs)

    drafter.forward = recording_forward
    input_ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    out = dflash_hf.generate(
        target, drafter, input_ids, max_new_tokens=12, eos_token_id=[99], return_dict_in_generate=True
    )
    # cycle i starts with the context committed before its anchor: the prompt, then each cycle's anchor + accepted
    committed = input_ids.shape[1]
    assert len(calls) == len(out.accepted_lengths[0])
    for (_, before, n_ctx), emitted in zip(calls, out.accepted_lengths[0]):
        assert before + n_ctx == committed
        committed += emitted
    # what the cache held when the last cycle started, against a from-scratch encoding of the same tokens
    snapshot, final_length, _ = calls[-1]
    assert final_length > input_ids.shape[1]
    with torch.no_grad():
        hidden = target(out.sequences[:, :final_length], output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
    fresh = DynamicCache()
    block = torch.zeros(1, 2, drafter.config.hidden_size)
    original(block, features, torch.arange(final_length + 2)[None], cache=fresh)
    assert len(snapshot) == len(fresh.layers)
    for (keys, values), layer_fresh in zip(snapshot, fresh.layers):
        assert keys.shape[2] == final_length  # no block K/V left behind
        torch.testing.assert_close(keys, layer_fresh.keys[:, :, :final_length], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(values, layer_fresh.values[:, :, :final_length], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# bad input: each a ValueError that names the problem


def test_hidden_size_mismatch():
    target = make_target("llama")
    other = make_target_config("llama")
    other.hidden_size, other.head_dim = 32, 8
    drafter = DFlashDraftModel(DFlashConfig.from_target(other, num_hidden_layers=1, num_target_features=2))
    with pytest.raises(ValueError, match="hidden size"):
        dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=3)


def test_vocab_mismatch():
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.config.vocab_size = 1000
    with pytest.raises(ValueError, match="vocab"):
        dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=3)


def test_target_layer_ids_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        DFlashConfig.from_target(make_target_config("llama"), target_layer_ids=[1, 6])
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.config.target_layer_ids = [1, 9]
    drafter.config.num_target_layers = None
    with pytest.raises(ValueError, match="out of range"):
        dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=3)


def test_block_size_below_two():
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig.from_target(make_target_config("qwen3"), block_size=1, num_target_features=2)
    target = make_target("qwen3")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="block_size"):
        dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=3, block_size=1)
    with pytest.raises(ValueError, match="trained block size"):
        dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=3, block_size=8)


def test_negative_max_new_tokens_and_empty_prompt():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=-1)
    with pytest.raises(ValueError, match="empty"):
        dflash_hf.generate(target, drafter, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        target.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=-1, assistant_model=drafter, speculation_type="dflash"
        )


def test_missing_target_layer_ids_is_refused():
    config = DFlashConfig(hidden_size=64, num_attention_heads=4, mask_token_id=3)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashDraftModel(config)


def test_native_path_batch_is_refused():
    target = make_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="batch"):
        target.generate(
            torch.tensor([[5, 6, 7], [7, 8, 9]]), max_new_tokens=3, assistant_model=drafter, speculation_type="dflash"
        )
    # if a batch ever reaches the drafter through the native cache, the drafter names the batched engine
    from transformers.cache_utils import DFlashCache

    noise, context, positions, _ = _drafter_inputs(drafter, padded=False)
    with pytest.raises(ValueError, match="dflash_hf.generate"):
        drafter(noise, context, positions, cache=DFlashCache(config=drafter.config))


def test_the_cache_is_taken_by_either_name():
    """`cache`, and `past_key_values` (the name Transformers 5.23's native path passes it by), never both."""
    drafter = make_drafter(make_target("llama"))
    noise, context, positions, _ = _drafter_inputs(drafter, batch=1, padded=False)
    by_name = {}
    for name in ("cache", "past_key_values"):
        by_name[name] = DynamicCache()
        drafter(noise, context, positions, **{name: by_name[name]})
    assert by_name["cache"].get_seq_length() == by_name["past_key_values"].get_seq_length() == positions.shape[1]
    with pytest.raises(ValueError, match="both `cache` and `past_key_values`"):
        drafter(noise, context, positions, cache=DynamicCache(), past_key_values=DynamicCache())


def test_assistant_model_without_speculation_type():
    target = make_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match='speculation_type="dflash"'):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, assistant_model=drafter)
    assert not hasattr(drafter, "generation_config")


def test_unsupported_target_architecture():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=64, n_layer=6, n_head=4)).eval()
    drafter = make_drafter(make_target("llama"))
    with pytest.raises(ValueError, match="Supported targets: .*Qwen3.*LLaMA.*Gemma 3"):
        dflash_hf.generate(gpt2, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=3)


def test_prepacked_lm_head_matches_the_stock_head():
    target = make_target("gemma3")  # softcapping on
    adapter = dflash_hf.TargetAdapter(target, [1, 3])
    hidden = torch.randn(2, 5, 64)
    with torch.no_grad():
        fast = adapter.logits(hidden)
        stock = target.get_output_embeddings()(hidden)
        stock = torch.tanh(stock / 30.0) * 30.0
        rows = torch.tensor([2, 7, 11])
        torch.testing.assert_close(adapter.logits(hidden, rows), fast[..., rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, stock, atol=1e-5, rtol=1e-5)
    # with gradients required (training) the stock differentiable path is used
    trainable = hidden.clone().requires_grad_(True)
    adapter.logits(trainable).sum().backward()
    assert trainable.grad is not None


def test_head_projection_of_a_strided_slice_never_copies_the_head():
    """The drafter's logits come from its block minus the anchor, a strided 3-D slice; projecting it must not run a
    batched matmul on a transposed copy of the head (in bf16 that copy was half of a draft's time on CPU)."""
    from dflash_hf.target.adapter import head_projection

    weight = torch.randn(4096, 64, dtype=torch.bfloat16)
    block = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    with torch.profiler.profile(record_shapes=True) as prof:
        logits = head_projection(block[:, 1:], weight, None)
    copied = [e.input_shapes for e in prof.events() if e.name in ("aten::copy_", "aten::bmm")]
    assert not [shapes for shapes in copied if any(s and torch.Size(s).numel() >= weight.numel() for s in shapes)]
    assert torch.equal(logits, torch.nn.functional.linear(block[0, 1:], weight)[None])
