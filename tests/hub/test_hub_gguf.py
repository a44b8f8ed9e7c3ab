"""`export --format gguf`: the file llama.cpp's DFlash draft loader reads, checked key by key and tensor by tensor.

No llama.cpp build runs here: the expectations below are what llama.cpp build 11434 reads (`src/models/dflash.cpp`:
`load_arch_hparams` / `load_arch_tensors` and the draft graph; `common/speculative.cpp`: block size, taps, mask token),
written out independently of the exporter's own tables. Shapes are GGML's (`ne`, fastest dimension first), as
`GGUFReader` reports them.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from dflash_hf.modeling import DFlashDraftModel
from testing_utils import make_drafter, make_target

import dflash_hf
from dflash_hf.cli import main as cli_main
from dflash_hf.drafters import bundled_drafter_dir
from dflash_hf.targets import TARGETS, TargetSpec

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16
# our tensor name -> llama.cpp's (`LLM_TENSOR_*` of src/llama-arch.cpp)
ROOT = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight"}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
MARKOV = {"markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight"}


def llama_cpp_names(drafter: DFlashDraftModel) -> dict[str, str]:
    """Our tensor name -> llama.cpp's, for every tensor of `drafter`'s body."""
    names = dict(ROOT)
    for i in range(drafter.config.num_hidden_layers):
        names.update({f"layers.{i}.{ours}": f"blk.{i}.{theirs}" for ours, theirs in LAYER.items()})
    if drafter.config.markov_rank:
        names.update(MARKOV)
    return names


def loader_shapes(config, n_vocab: int) -> dict[str, list[int]]:
    """The `ne` of every tensor `load_arch_tensors` creates for a (non-DSV4, non-DFlash2) DFlash draft."""
    h, hd, ff = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = hd * config.num_attention_heads, hd * config.num_key_value_heads
    shapes = {
        "fc.weight": [len(config.target_layer_ids) * h, h],
        "enc.output_norm.weight": [h],
        "output_norm.weight": [h],
    }
    layer = {
        "attn_norm.weight": [h],
        "attn_q.weight": [h, q],
        "attn_k.weight": [h, kv],
        "attn_v.weight": [h, kv],
        "attn_output.weight": [q, h],
        "attn_q_norm.weight": [hd],
        "attn_k_norm.weight": [hd],
        "ffn_norm.weight": [h],
        "ffn_gate.weight": [h, ff],
        "ffn_up.weight": [h, ff],
        "ffn_down.weight": [ff, h],
    }
    for i in range(config.num_hidden_layers):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
    draft_vocab = config.draft_vocab_size or n_vocab
    if config.draft_vocab_size:
        shapes.update({"output.weight": [h, draft_vocab], "d2t": [draft_vocab]})
    if config.markov_rank:
        shapes.update(
            {"markov_w1.weight": [config.markov_rank, n_vocab], "markov_w2.weight": [config.markov_rank, draft_vocab]}
        )
    return shapes


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def tensors(reader: gguf.GGUFReader) -> dict:
    return {tensor.name: tensor for tensor in reader.tensors}


def values(tensor) -> np.ndarray:
    """A tensor's values as float32, in Transformers' (rows, columns) order."""
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(list(reversed(tensor.shape.tolist())))


def write_target_gguf(path, target, arch: str = "llama", softcapping: float | None = None, n_tokens=None):
    """A tiny target GGUF as llama.cpp's converter writes one: shape keys, a tokenizer, Q8_0 embedding and head."""
    config = target.config
    n_tokens = config.vocab_size if n_tokens is None else n_tokens
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_string("general.name", "Tiny Target")
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    if softcapping:
        writer.add_float32(f"{arch}.final_logit_softcapping", softcapping)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(n_tokens)])
    writer.add_array("tokenizer.ggml.token_type", [1] * n_tokens)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, module in (("token_embd.weight", target.get_input_embeddings()), ("output.weight", target.lm_head)):
        weight = module.weight.detach().float().numpy()
        writer.add_tensor(name, gguf.quants.quantize(weight, Q8_0), raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """`(target, reduced-vocabulary drafter, the target's GGUF)` of a tiny random LLaMA."""
    target = make_target("llama")
    drafter = make_drafter(target, draft_vocab_size=24)
    drafter.set_draft_vocabulary(torch.randperm(64, generator=torch.Generator().manual_seed(3))[:24])
    return target, drafter, write_target_gguf(tmp_path_factory.mktemp("target") / "target.gguf", target)


def check_written_file(path, drafter: DFlashDraftModel, target_path) -> gguf.GGUFReader:
    """Everything llama.cpp's loader and speculative driver read, against the drafter and its target's GGUF."""
    reader, target = gguf.GGUFReader(path), gguf.GGUFReader(target_path)
    config = drafter.config
    n_vocab = len(target.fields["tokenizer.ggml.tokens"].data)
    assert field(reader, "general.architecture") == "dflash"
    expected = {
        "dflash.embedding_length": config.hidden_size,
        "dflash.block_count": config.num_hidden_layers,
        "dflash.feed_forward_length": config.intermediate_size,
        "dflash.attention.head_count": config.num_attention_heads,
        "dflash.attention.head_count_kv": config.num_key_value_heads,
        "dflash.attention.key_length": config.head_dim,
        "dflash.attention.value_length": config.head_dim,
        "dflash.rope.dimension_count": config.head_dim,
        "dflash.context_length": config.max_position_embeddings,
        "dflash.hidden_activation": config.hidden_act,
        "dflash.block_size": config.block_size,
        # llama.cpp extracts the input of layer L: our output of layer i is the input of layer i + 1
        "dflash.target_layers": [i + 1 for i in config.target_layer_ids],
        "dflash.sample_from_anchor": False,  # slot 0 is the anchor; drafts (and the Markov chain) start at slot 1
        "dflash.has_confidence_head": False,
        "tokenizer.ggml.mask_token_id": config.mask_token_id,
    }
    assert {key: field(reader, key) for key in expected} == expected
    assert field(reader, "dflash.attention.layer_norm_rms_epsilon") == pytest.approx(config.rms_norm_eps, rel=1e-6)
    assert field(reader, "dflash.rope.freq_base") == pytest.approx(config.rope_parameters["rope_theta"])
    # types the loader's typed getters insist on
    assert reader.fields["dflash.block_size"].types == [gguf.GGUFValueType.UINT32]
    assert reader.fields["tokenizer.ggml.mask_token_id"].types == [gguf.GGUFValueType.UINT32]
    assert reader.fields["dflash.target_layers"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    # the target's tokenizer, unchanged: llama.cpp refuses a draft whose vocabulary differs from the target's
    tokenizer_keys = {key for key in target.fields if key.startswith("tokenizer.")}
    assert tokenizer_keys <= set(reader.fields)
    for key in tokenizer_keys:
        assert reader.fields[key].types == target.fields[key].types, key
        assert field(reader, key) == field(target, key), key

    written = tensors(reader)
    assert {name: t.shape.tolist() for name, t in written.items()} == loader_shapes(config, n_vocab)
    state = drafter.state_dict()
    for ours, theirs in llama_cpp_names(drafter).items():
        if written[theirs].tensor_type == F32:  # f32 exports: the drafter's weights exactly
            np.testing.assert_array_equal(values(written[theirs]), state[ours].float().numpy(), err_msg=theirs)
    assert all(written[name].tensor_type == F32 for name in written if len(written[name].shape) == 1 and name != "d2t")
    if config.draft_vocab_size:
        ids = drafter.draft_token_ids.numpy()
        d2t = written["d2t"]
        assert d2t.tensor_type == gguf.GGMLQuantizationType.I64
        np.testing.assert_array_equal(d2t.data, ids)  # absolute target ids, not our offsets
        head = tensors(target).get("output.weight", tensors(target)["token_embd.weight"])
        assert written["output.weight"].tensor_type == head.tensor_type
        np.testing.assert_array_equal(written["output.weight"].data, head.data[ids])  # the target's rows, bytes
    else:
        assert "output.weight" not in written and "token_embd.weight" not in written  # the target's are used
    return reader


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory):
    drafter = DFlashDraftModel.from_pretrained(bundled_drafter_dir("smollm2-135m"))
    path = dflash_hf.export(drafter, tmp_path_factory.mktemp("gguf") / "d.gguf", target="smollm2-135m", format="gguf")
    return drafter, path, TARGETS["smollm2-135m"].gguf_file(tmp_path_factory.mktemp("scratch"))


def test_bundled_smollm2_drafter_is_what_llama_cpp_reads(smollm2_export):
    drafter, path, target_path = smollm2_export
    reader = check_written_file(path, drafter, target_path)
    assert field(reader, "dflash.target_layers") == [2, 9, 15, 21, 28]  # trained taps [1, 8, 14, 20, 27]
    assert field(reader, "dflash.block_size") == 8 and field(reader, "tokenizer.ggml.mask_token_id") == 49151
    assert tensors(reader)["output.weight"].shape.tolist() == [576, 8192]  # the reduced head, not 49,152 rows
    assert "dflash.embedding_scale" not in reader.fields and "dflash.final_logit_softcapping" not in reader.fields


def test_bundled_gemma3_drafter_is_refused(tmp_path):
    """llama.cpp's Gemma 3 graph does not expose its layer inputs, so no DFlash draft can run on it."""
    drafter = DFlashDraftModel.from_pretrained(bundled_drafter_dir("gemma3-270m"))
    with pytest.raises(ValueError, match="'gemma3' target"):
        dflash_hf.export(drafter, tmp_path / "d.gguf", target="gemma3-270m", format="gguf")
    assert list(tmp_path.iterdir()) == []


def test_tiny_reduced_vocabulary_drafter(tiny, tmp_path):
    target, drafter, target_path = tiny
    check_written_file(
        dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf"), drafter, target_path
    )


def test_full_vocabulary_drafter_borrows_the_target_head(tiny, tmp_path):
    target, _, target_path = tiny
    drafter = make_drafter(target)
    check_written_file(
        dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf"), drafter, target_path
    )


def test_markov_head_tensors(tiny, tmp_path):
    """`markov_w1` over the target vocabulary, `markov_w2` over the draft one; rank 8 rows do not fill a q8_0 block,
    so q8_0 exports them f16."""
    target, _, target_path = tiny
    drafter = make_drafter(target, draft_vocab_size=24)
    drafter.add_markov_head(8)
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight)
    reader = check_written_file(
        dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf"), drafter, target_path
    )
    written = tensors(reader)
    assert written["markov_w1.weight"].shape.tolist() == [8, 64] and written["markov_w2.weight"].shape.tolist() == [
        8,
        24,
    ]
    quantized = gguf.GGUFReader(
        dflash_hf.export(drafter, tmp_path / "q.gguf", target=target_path, format="gguf", gguf_type="q8_0")
    )
    assert {tensors(quantized)[name].tensor_type for name in MARKOV.values()} == {F16}
    for ours, theirs in MARKOV.items():
        np.testing.assert_array_equal(
            values(tensors(quantized)[theirs]), drafter.state_dict()[ours].half().float().numpy()
        )


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_weight_types(tiny, tmp_path, gguf_type):
    target, drafter, target_path = tiny
    path = dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf", gguf_type=gguf_type)
    reader = check_written_file(path, drafter, target_path)
    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    state, written = drafter.state_dict(), tensors(reader)
    for ours, theirs in llama_cpp_names(drafter).items():
        weight = state[ours].float()
        if weight.dim() == 1:
            continue
        assert written[theirs].tensor_type == qtype, theirs
        got = values(written[theirs])
        if gguf_type == "q8_0":  # one f16 step max|block| / 127 per 32 values: half a step, plus the step's rounding
            step = weight.reshape(-1, 32).abs().amax(-1, keepdim=True).expand(-1, 32).reshape(weight.shape) / 127
            assert np.all(np.abs(got - weight.numpy()) <= 0.6 * step.numpy() + 1e-7), theirs
        else:
            rounded = weight.half() if gguf_type == "f16" else weight.bfloat16()
            np.testing.assert_array_equal(got, rounded.float().numpy(), err_msg=theirs)
    assert field(reader, "general.file_type") == {"f16": 1, "bf16": 32, "q8_0": 7}[gguf_type]


def test_gemma_family_target_scales_the_embedding_and_softcaps(tiny, tmp_path):
    """llama.cpp's Gemma graphs scale the shared embedding table by sqrt(hidden) in the graph: the draft must too."""
    target, drafter, _ = tiny
    target_path = write_target_gguf(tmp_path / "gemma4.gguf", target, arch="gemma4", softcapping=30.0)
    reader = gguf.GGUFReader(dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf"))
    assert field(reader, "dflash.embedding_scale") == pytest.approx(math.sqrt(64))
    assert field(reader, "dflash.final_logit_softcapping") == pytest.approx(30.0)
    drafter = make_drafter(target)
    drafter.add_markov_head(8)
    with pytest.raises(ValueError, match="softcapping"):  # llama.cpp adds the Markov correction before softcapping
        dflash_hf.export(drafter, tmp_path / "m.gguf", target=target_path, format="gguf")


def refusal(drafter, target_path, tmp_path, match, **kwargs):
    with pytest.raises(ValueError, match=match):
        dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf", **kwargs)
    assert not list(tmp_path.glob("*d.gguf*"))  # nothing half-written


def test_refusals(tiny, tmp_path):
    target, drafter, target_path = tiny
    refusal(drafter, write_target_gguf(tmp_path / "g3.gguf", target, arch="gemma3"), tmp_path, "'gemma3' target")
    refusal(drafter, write_target_gguf(tmp_path / "v.gguf", target, n_tokens=60), tmp_path, "60 tokens")
    refusal(drafter, tmp_path / "missing.gguf", tmp_path, "target's .gguf file")
    refusal(drafter, target, tmp_path, "not a LlamaForCausalLM")
    refusal(drafter, target_path, tmp_path, "Unknown GGUF weight type", gguf_type="q4_0")
    last = make_drafter(target, target_layer_ids=[1, 5])
    refusal(last, target_path, tmp_path, "last layer")
    gated = make_drafter(target)
    gated.add_markov_head(8, gated=True)
    refusal(gated, target_path, tmp_path, "gated")
    for change, match in (
        ({"attention_bias": True}, "attention biases"),
        ({"hidden_act": "relu"}, "activations"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "RoPE type 'yarn'"),
    ):
        odd = make_drafter(target)
        for key, value in change.items():
            setattr(odd.config, key, value)
        refusal(odd, target_path, tmp_path, match)
    other = make_drafter(make_target("qwen3", vocab_size=32))
    refusal(other, target_path, tmp_path, "pass the GGUF of the drafter's target")


def test_named_target_without_a_gguf_file(tiny, tmp_path, monkeypatch):
    _, drafter, _ = tiny
    spec = TargetSpec("tiny-llama", description="tiny", distribution="pytest", load_source=lambda scratch: None)
    monkeypatch.setitem(TARGETS, "tiny-llama", spec)
    refusal(drafter, "tiny-llama", tmp_path, "ships no GGUF file")


def test_overwrite_replaces_only_an_earlier_drafter_export(tiny, tmp_path):
    _, drafter, target_path = tiny
    path = dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf")
    with pytest.raises(ValueError, match="already exists"):
        dflash_hf.export(drafter, path, target=target_path, format="gguf")
    dflash_hf.export(drafter, path, target=target_path, format="gguf", overwrite=True, gguf_type="q8_0")
    assert field(gguf.GGUFReader(path), "general.file_type") == 7
    other = tmp_path / "other.gguf"
    other.write_bytes(target_path.read_bytes())
    with pytest.raises(ValueError, match="not an earlier GGUF export"):
        dflash_hf.export(drafter, other, target=target_path, format="gguf", overwrite=True)
    assert other.read_bytes() == target_path.read_bytes()
    with pytest.raises(ValueError, match="NAME.gguf"):
        dflash_hf.export(drafter, tmp_path / "folder", target=target_path, format="gguf")


def test_cli_export_gguf(tiny, tmp_path, capsys):
    _, drafter, target_path = tiny
    drafter.save_pretrained(tmp_path / "drafter")
    argv = ["export", str(tmp_path / "drafter"), str(tmp_path / "d.gguf"), "--target", str(target_path)]
    argv += ["--format", "gguf", "--gguf-type", "q8_0"]
    assert cli_main(argv) == 0
    assert field(gguf.GGUFReader(tmp_path / "d.gguf"), "general.file_type") == 7
    capsys.readouterr()
    assert cli_main(argv) == 2  # exists: one error line, no traceback
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {tmp_path / 'd.gguf'} already exists; choose another file name or pass overwrite=True (`--overwrite`)."
    ]


# DFlash 2 (llama.cpp's `load_arch_tensors`, the `selector_hidden.weight` branch): the loader's own names and shapes
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def test_dflash2_drafter_keys_and_tensors(tiny, tmp_path):
    """The four DFlash 2 sizes as u32 keys; the convolutions' bases (F32, `{hidden, K, 2}`) and projections
    (`{hidden, 2 * K * hidden / g}`) per layer; the selector's `{r, vocab}` codebooks and `{hidden, r}` projection."""
    target, _, target_path = tiny
    drafter = make_drafter(target, **DFLASH2)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                parameter.normal_(0.0, 0.5)
    path = dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf", gguf_type="q8_0")
    reader, written, state = gguf.GGUFReader(path), tensors(gguf.GGUFReader(path)), drafter.state_dict()
    for key, value in DFLASH2.items():
        assert field(reader, f"dflash.{key}") == value
        assert reader.fields[f"dflash.{key}"].types == [gguf.GGUFValueType.UINT32]
    projected = 2 * 2 * (64 // 16)
    expected = {
        "selector_predecessor.weight": ([8, 64], "candidate_selector.predecessor_codebook.weight"),
        "selector_successor.weight": ([8, 64], "candidate_selector.successor_codebook.weight"),
        "selector_hidden.weight": ([64, 8], "candidate_selector.hidden_projection.weight"),
    }
    for i in range(drafter.config.num_hidden_layers):
        for theirs, ours in (("attn", "attention_conv"), ("ffn", "mlp_conv")):
            expected[f"blk.{i}.{theirs}_conv_base"] = ([64, 2, 2], f"layers.{i}.{ours}.base_kernel")
            expected[f"blk.{i}.{theirs}_conv_proj.weight"] = (
                [64, projected],
                f"layers.{i}.{ours}.kernel_projection.weight",
            )
    for theirs, (shape, ours) in expected.items():
        assert written[theirs].shape.tolist() == shape, theirs
        if theirs.endswith("_conv_base"):  # the bases stay F32: the drafter's values exactly
            assert written[theirs].tensor_type == F32
            np.testing.assert_array_equal(values(written[theirs]), state[ours].numpy())
    assert len(written) == len(loader_shapes(drafter.config, 64)) + len(expected)


def test_todays_layout_keys(tiny, tmp_path):
    """Sliding layers: the window and one bool per layer (llama.cpp's `is_swa_impl`); the drafter's own embedding
    scale, logit multiplier and softcap."""
    target, _, target_path = tiny
    drafter = make_drafter(
        target,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        is_causal=False,
        input_embedding_scale=2.0,
        output_multiplier=0.5,
        final_logit_softcapping=20.0,
    )
    reader = gguf.GGUFReader(dflash_hf.export(drafter, tmp_path / "d.gguf", target=target_path, format="gguf"))
    assert field(reader, "dflash.attention.sliding_window") == 16
    assert field(reader, "dflash.attention.sliding_window_pattern") == [True, False]
    assert reader.fields["dflash.attention.sliding_window_pattern"].types == [
        gguf.GGUFValueType.ARRAY,
        gguf.GGUFValueType.BOOL,
    ]
    assert field(reader, "dflash.embedding_scale") == pytest.approx(2.0)
    assert field(reader, "dflash.logit_scale") == pytest.approx(0.5)
    assert field(reader, "dflash.final_logit_softcapping") == pytest.approx(20.0)
    gemma_path = write_target_gguf(tmp_path / "gemma4.gguf", target, arch="gemma4", softcapping=30.0)
    uncapped = make_drafter(target, final_logit_softcapping=0.0)  # the drafter's own: none, whatever the target's
    reader = gguf.GGUFReader(dflash_hf.export(uncapped, tmp_path / "u.gguf", target=gemma_path, format="gguf"))
    assert "dflash.final_logit_softcapping" not in reader.fields


def test_layouts_llama_cpp_cannot_run_are_refused(tiny, tmp_path):
    target, _, target_path = tiny
    causal = make_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    refusal(causal, target_path, tmp_path, "causal inside the block")
    wide = make_drafter(target, **{**DFLASH2, "selector_top_k": 8})  # 8 * 9 > 64
    refusal(wide, target_path, tmp_path, "selector_top_k \\* \\(selector_top_k \\+ 1\\)")
