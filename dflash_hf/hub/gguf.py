"""Write a DFlash drafter as a GGUF file that llama.cpp's DFlash draft loader runs.

    >>> dflash_hf.export(drafter, "drafter.gguf", target="smollm2-135m", format="gguf", gguf_type="q8_0")
    $ llama-server -m target.gguf -md drafter.gguf --spec-type draft-dflash --spec-draft-n-max 7

What llama.cpp reads, checked against its build 11434 (`src/models/dflash.cpp`, `src/llama-arch.cpp`,
`common/speculative.cpp`). PyPI's `gguf` has no `dflash` constants, so the key names are spelled here.

- `general.architecture = "dflash"`; the draft body's shape under `dflash.*` (`context_length`, `embedding_length`,
  `block_count`, `feed_forward_length`, `attention.head_count[_kv]`, `attention.key_length`,
  `attention.value_length`, `attention.layer_norm_rms_epsilon`, `rope.freq_base`, `rope.dimension_count`,
  `hidden_activation`).
- `dflash.block_size`; `dflash.target_layers`: llama.cpp taps the *input* of a target layer, so our output-of-layer
  id `i` is written as `i + 1` (and the target's last layer, whose output is no layer's input, cannot be tapped);
  `dflash.sample_from_anchor = false` (slot 0 holds the anchor, slots 1.. are drafted; it decides where the Markov
  head starts) and `dflash.has_confidence_head = false`.
- The target's tokenizer: every `tokenizer.*` key copied from the target's GGUF (llama.cpp requires the draft's
  vocabulary to match the target's and sizes the draft logits by it), plus `tokenizer.ggml.mask_token_id`.
- Gemma targets: `dflash.embedding_scale = sqrt(hidden)` (llama.cpp's Gemma graphs scale the embedding table in the
  graph, and the draft borrows the table) and the target's `final_logit_softcapping`.
- Tensors in llama.cpp's names: `fc`, `enc.output_norm` (our `hidden_norm`), `output_norm` (our `norm`),
  `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up,
  ffn_down}`. Q and K keep Transformers' rotate-half layout: llama.cpp ropes DFlash drafts NeoX-style.
- No embedding and, for a full vocabulary, no LM head: llama.cpp takes the target's. A reduced draft vocabulary
  stores `output.weight` (the target GGUF's own head rows of the draft tokens, their bytes copied in the target's
  type, so drafts use exactly the weights the target verifies with) and `d2t` (int64 *absolute* target ids, where our
  checkpoints store EAGLE-3 offsets: llama.cpp scatters draft logit `j` to target token `d2t[j]`).
- A Markov head (`markov_rank > 0`, the vanilla one): `markov_w1.weight` (one row of `rank` per target token,
  looked up by the previous token) and `markov_w2.weight` (one row per draft-vocabulary token); llama.cpp adds
  `w2 @ w1[previous]` to each drafted slot's logits (from slot 1, whose previous token is the anchor), chaining the
  argmax through the block, with `--spec-type draft-dflash` and `draft-dspark` alike.

- Today's layouts: `dflash.attention.sliding_window` and `dflash.attention.sliding_window_pattern` (one bool per
  layer) for sliding layers, `dflash.embedding_scale` (`input_embedding_scale`), `dflash.logit_scale`
  (`output_multiplier`) and `dflash.final_logit_softcapping` (the drafter's own where it has one).
- DFlash 2: `dflash.conv_kernel_size`, `dflash.conv_group_size`, `dflash.selector_rank`, `dflash.selector_top_k`,
  tensors `blk.N.{attn,ffn}_conv_base` (F32, llama.cpp's shape `{hidden, K, 2}`), `blk.N.{attn,ffn}_conv_proj.weight`,
  `selector_hidden.weight`, `selector_predecessor.weight` and `selector_successor.weight`.

Refused with a `ValueError`: targets whose llama.cpp graph does not expose its layer inputs (Gemma 3 among them),
draft layers causal inside the block (llama.cpp attends over the whole block), a DFlash 2 selector whose lattice
does not fit llama.cpp's buffer (`hidden_size < K * (K + 1)`),
attention biases, activations and RoPE types the loader has no key for, a tap of the target's last layer, the gated
Markov head (llama.cpp has no gate tensor) and a Markov head on a softcapping target (llama.cpp adds the correction
to the logits before softcapping, our drafters after it).
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..fileio import atomic_write
from ..modeling import DFlashConfig, DFlashDraftModel
from ..modeling.configuration_dflash import DFLASH2_KEYS
from ..targets import TARGETS

ARCH = "dflash"
# `--gguf-type`: the GGML type of the draft body's matrices and the matching `general.file_type`
_TYPE_NAMES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}
GGUF_TYPES = tuple(_TYPE_NAMES)
"""Weight types of the draft body's matrices (`--gguf-type`); norms stay f32, the copied head rows keep the
target's type."""

# llama.cpp target architectures whose graph records every layer's input (`res->t_layer_inp`), which its DFlash
# drafting reads; any other target aborts at the first draft.
LLAMA_CPP_DFLASH_TARGETS = ("llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "gemma4", "gpt-oss")
# activations llama.cpp's DFlash loader accepts for `dflash.hidden_activation`
_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")

_ROOT_TENSORS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "candidate_selector.predecessor_codebook.weight": "selector_predecessor.weight",
    "candidate_selector.successor_codebook.weight": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
_LAYER_TENSORS = {
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
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}


def _gguf() -> Any:
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(
            "Writing GGUF files needs the `gguf` package: `pip install gguf` (part of `dflash-hf[models]`)."
        )
    import gguf

    return gguf


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name of the drafter tensor `name` (`layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight`)."""
    if name in _ROOT_TENSORS:
        return _ROOT_TENSORS[name]
    prefix, _, rest = name.partition(".")
    index, _, suffix = rest.partition(".")
    if prefix == "layers" and index.isdigit() and suffix in _LAYER_TENSORS:
        return f"blk.{index}.{_LAYER_TENSORS[suffix]}"
    raise ValueError(f"llama.cpp's DFlash loader has no tensor for the drafter's {name!r}; it cannot run this drafter.")


@contextmanager
def target_gguf_file(target: str | os.PathLike) -> Iterator[Path]:
    """The target's GGUF file: a named target's packaged one (assembled in a temporary folder when it ships in
    parts), or the path given."""
    if not isinstance(target, (str, os.PathLike)):
        raise ValueError(
            f"For a GGUF export the target is a named target or the target's .gguf file, not a {type(target).__name__}."
        )
    name = os.fspath(target)
    spec = TARGETS.get(name)
    if spec is None:
        path = Path(name)
        if path.suffix != ".gguf" or not path.is_file():
            raise ValueError(
                f"For a GGUF export the target is a named target ({', '.join(TARGETS)}) or the target's .gguf file "
                f"(the one llama.cpp serves, e.g. from llama.cpp's convert_hf_to_gguf.py); got {name!r}."
            )
        yield path
        return
    if spec.gguf_file is None:
        raise ValueError(f"The named target {name!r} ships no GGUF file: pass the target's .gguf file as the target.")
    with tempfile.TemporaryDirectory(prefix="dflash-hf-target-gguf-") as scratch:
        yield spec.gguf_file(Path(scratch))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _architecture(path: Path) -> str | None:
    """`general.architecture` of the GGUF file `path`, `None` when it is no readable GGUF file."""
    try:
        return _field(_gguf().GGUFReader(path), "general.architecture")
    except (OSError, ValueError):
        return None


def check_llama_cpp_drafter(config: DFlashConfig) -> None:
    """Raise a `ValueError` for a drafter that llama.cpp's DFlash loader cannot express."""
    if config.attention_bias:
        raise ValueError("llama.cpp's DFlash drafts have no attention biases; this drafter uses attention_bias=True.")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(
            f"llama.cpp's DFlash loader supports the activations {', '.join(_ACTIVATIONS)}, not {config.hidden_act!r}."
        )
    if config.markov_gated:
        raise ValueError(
            "llama.cpp's DFlash loader runs the vanilla Markov head only (no gate tensor); this drafter's is gated."
        )
    causal = [i for i in range(config.num_hidden_layers) if config.layer_is_causal(i)]
    if causal:
        raise ValueError(
            f"llama.cpp's DFlash drafts attend over the whole block in every layer, and this drafter's layers {causal} "
            "are causal inside the block: llama.cpp would draft differently than it was trained. Export in the "
            "official or dflash-hf layout instead."
        )
    if config.is_dflash2 and config.hidden_size < config.selector_top_k * (config.selector_top_k + 1):
        raise ValueError(
            f"llama.cpp scores a DFlash 2 selector's lattice in a hidden-size buffer: hidden size {config.hidden_size} "
            f"is below selector_top_k * (selector_top_k + 1) = {config.selector_top_k * (config.selector_top_k + 1)}."
        )
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in ("default", "linear"):
        raise ValueError(
            f"Exporting RoPE type {rope_type!r} to GGUF is not supported (default and linear are); export in the "
            "dflash-hf or official layout instead."
        )


def check_llama_cpp_target(config: DFlashConfig, reader: Any) -> None:
    """Raise a `ValueError` unless llama.cpp can run `config`'s drafter on the target GGUF `reader` reads."""
    arch = _field(reader, "general.architecture")
    if arch not in LLAMA_CPP_DFLASH_TARGETS:
        raise ValueError(
            f"llama.cpp's DFlash drafting cannot run on a {arch!r} target: its graph does not expose the layer inputs "
            f"the draft reads (supported target architectures: {', '.join(LLAMA_CPP_DFLASH_TARGETS)})."
        )
    hidden = _field(reader, f"{arch}.embedding_length")
    if hidden != config.hidden_size:
        raise ValueError(
            f"The target GGUF has hidden size {hidden}, the drafter {config.hidden_size}: pass the drafter's target."
        )
    layers = int(_field(reader, f"{arch}.block_count"))
    if config.num_target_layers is not None and layers != config.num_target_layers:
        raise ValueError(
            f"The target GGUF has {layers} layers, the drafter was built for {config.num_target_layers}: pass the "
            "drafter's target."
        )
    if max(config.target_layer_ids) >= layers - 1:
        raise ValueError(
            f"This drafter taps the target's last layer ({layers - 1}); llama.cpp captures a layer's input, so the "
            "last layer's output has no id there. Train with taps below the last layer to serve it with llama.cpp."
        )
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    if config.vocab_size is not None and vocab != config.vocab_size:
        raise ValueError(
            f"The target GGUF's tokenizer has {vocab} tokens, the drafter's target vocabulary {config.vocab_size} "
            "rows: pass the GGUF of the drafter's target (with its tokenizer)."
        )
    if not 0 <= int(config.mask_token_id) < vocab:
        raise ValueError(f"mask_token_id {config.mask_token_id} is not a token of the target GGUF ({vocab} tokens).")
    if config.markov_rank and _field(reader, f"{arch}.final_logit_softcapping"):
        raise ValueError(
            "llama.cpp adds the Markov head's correction to the draft logits before the target's final-logit "
            "softcapping, this drafter after it: llama.cpp would draft differently than it was trained."
        )


def _add_metadata(writer: Any, config: DFlashConfig, reader: Any) -> None:
    gguf = _gguf()
    arch = _field(reader, "general.architecture")
    writer.add_string("general.name", f"DFlash drafter for {_field(reader, 'general.name', arch)}")
    writer.add_uint32(f"{ARCH}.context_length", int(config.max_position_embeddings))
    writer.add_uint32(f"{ARCH}.embedding_length", int(config.hidden_size))
    writer.add_uint32(f"{ARCH}.block_count", int(config.num_hidden_layers))
    writer.add_uint32(f"{ARCH}.feed_forward_length", int(config.intermediate_size))
    writer.add_uint32(f"{ARCH}.attention.head_count", int(config.num_attention_heads))
    writer.add_uint32(f"{ARCH}.attention.head_count_kv", int(config.num_key_value_heads))
    writer.add_uint32(f"{ARCH}.attention.key_length", int(config.head_dim))
    writer.add_uint32(f"{ARCH}.attention.value_length", int(config.head_dim))
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    writer.add_string(f"{ARCH}.hidden_activation", config.hidden_act)
    rope = config.rope_parameters or {}
    writer.add_float32(f"{ARCH}.rope.freq_base", float(rope.get("rope_theta", 10000.0)))
    writer.add_uint32(f"{ARCH}.rope.dimension_count", int(config.head_dim))
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{ARCH}.rope.scaling.type", "linear")
        writer.add_float32(f"{ARCH}.rope.scaling.factor", float(rope["factor"]))
    writer.add_uint32(f"{ARCH}.block_size", int(config.block_size))
    writer.add_array(f"{ARCH}.target_layers", [int(i) + 1 for i in config.target_layer_ids])
    writer.add_bool(f"{ARCH}.sample_from_anchor", False)
    writer.add_bool(f"{ARCH}.has_confidence_head", False)
    embedding_scale = config.input_embedding_scale
    if embedding_scale is None and arch.startswith("gemma"):
        embedding_scale = math.sqrt(int(config.hidden_size))
    if embedding_scale is not None and float(embedding_scale) != 1.0:
        writer.add_float32(f"{ARCH}.embedding_scale", float(embedding_scale))
    if float(config.output_multiplier) != 1.0:
        writer.add_float32(f"{ARCH}.logit_scale", float(config.output_multiplier))
    softcap = config.final_logit_softcapping
    if softcap is None:
        softcap = _field(reader, f"{arch}.final_logit_softcapping")
    if softcap:
        writer.add_float32(f"{ARCH}.final_logit_softcapping", float(softcap))
    sliding = [kind == "sliding_attention" for kind in config.layer_types]
    if config.sliding_window is not None and any(sliding):
        writer.add_uint32(f"{ARCH}.attention.sliding_window", int(config.sliding_window))
        writer.add_array(f"{ARCH}.attention.sliding_window_pattern", sliding)
    if config.is_dflash2:
        for key in DFLASH2_KEYS:
            writer.add_uint32(f"{ARCH}.{key}", int(getattr(config, key)))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id":
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_uint32("tokenizer.ggml.mask_token_id", int(config.mask_token_id))


def _add_body(writer: Any, drafter: DFlashDraftModel, gguf_type: str) -> None:
    """The draft body's tensors: matrices in `gguf_type` (f16 where a row does not fill whole q8_0 blocks), the rest
    f32."""
    gguf = _gguf()
    matrix_type = gguf.GGMLQuantizationType[_TYPE_NAMES[gguf_type][0]]
    block_size = gguf.GGML_QUANT_SIZES[matrix_type][0]
    for name, tensor in drafter.state_dict().items():
        if name == "d2t":
            continue
        data = tensor.detach().float().cpu().numpy()
        qtype = gguf.GGMLQuantizationType.F32
        if data.ndim == 2:
            qtype = matrix_type if data.shape[1] % block_size == 0 else gguf.GGMLQuantizationType.F16
        writer.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _add_draft_vocabulary(writer: Any, drafter: DFlashDraftModel, reader: Any) -> None:
    """`output.weight` (the target's head rows of the draft tokens, bytes copied) and `d2t` (absolute target ids)."""
    gguf = _gguf()
    ids = drafter.draft_token_ids
    if ids is None:
        return
    ids = ids.cpu().numpy().astype(np.int64)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(
            f"The drafter's d2t does not map to distinct target ids below {vocab}; set it with set_draft_vocabulary()."
        )
    heads = {tensor.name: tensor for tensor in reader.tensors}
    head = heads.get("output.weight", heads.get("token_embd.weight"))  # tied targets store only the embedding
    if head is None:
        raise ValueError("The target GGUF has neither output.weight nor token_embd.weight to take the draft head from.")
    writer.add_tensor("output.weight", np.ascontiguousarray(head.data[ids]), raw_dtype=head.tensor_type)
    writer.add_tensor("d2t", ids, raw_dtype=gguf.GGMLQuantizationType.I64)


def write_gguf(
    drafter: DFlashDraftModel,
    path: str | os.PathLike,
    *,
    target: str | os.PathLike,
    gguf_type: str = "f32",
    overwrite: bool = False,
) -> Path:
    """Write `drafter` as the GGUF file `path` that llama.cpp serves with `-md path --spec-type draft-dflash`.

    Args:
        drafter: The DFlash drafter.
        path: The `.gguf` file to write; it appears only once complete.
        target: A named target (`smollm2-135m`, ...) or the target's GGUF file: its tokenizer, and for a reduced
            draft vocabulary its LM head rows, go into the file, and llama.cpp must be able to run it (see
            `LLAMA_CPP_DFLASH_TARGETS`).
        gguf_type: Type of the body's weight matrices, one of `GGUF_TYPES`.
        overwrite: Replace an existing file.

    Returns:
        The path written.
    """
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"Unknown GGUF weight type {gguf_type!r}; choose one of {', '.join(GGUF_TYPES)}.")
    gguf = _gguf()
    path = Path(path)
    if path.suffix != ".gguf":
        raise ValueError(f"A GGUF export is one file: name it NAME.gguf, got {path}.")
    if path.is_dir() or (path.exists() and not overwrite):
        raise ValueError(f"{path} already exists; choose another file name or pass overwrite=True (`--overwrite`).")
    if path.exists() and _architecture(path) != ARCH:
        raise ValueError(
            f"{path} is not an earlier GGUF export of a drafter (its architecture is not {ARCH!r}); overwrite replaces "
            "only those: choose another file name."
        )
    config = drafter.config
    check_llama_cpp_drafter(config)
    with target_gguf_file(target) as target_file:
        reader = gguf.GGUFReader(target_file)
        check_llama_cpp_target(config, reader)

        def write(temporary: Path) -> None:
            writer = gguf.GGUFWriter(temporary, arch=ARCH)
            writer.add_uint32("general.file_type", int(gguf.LlamaFileType[_TYPE_NAMES[gguf_type][1]]))
            _add_metadata(writer, config, reader)
            _add_body(writer, drafter, gguf_type)
            _add_draft_vocabulary(writer, drafter, reader)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write)
    return path


__all__ = [
    "GGUF_TYPES",
    "LLAMA_CPP_DFLASH_TARGETS",
    "check_llama_cpp_drafter",
    "check_llama_cpp_target",
    "gguf_tensor_name",
    "target_gguf_file",
    "write_gguf",
]
