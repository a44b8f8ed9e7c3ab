"""Targets of real shapes with random weights, built on the device: `random:qwen3-8b` and the other [`RANDOM_SHAPES`].

Their configs are the public models' shapes (sizes, heads, vocabulary, RoPE, sliding windows), so a forward costs what
the real model's costs, with nothing to download or carry: an 8B target is built on a GPU in about a second. The
weights are random (seeded), so these targets measure speed, never quality: a drafter's acceptance on them means
nothing, which is what `dflash-hf bench --oracle` is for. They are drawn by the device's own generator in the dtype
asked: `random:qwen3-8b` built on a GPU in bf16 is another model than on a CPU or in float32, so data made with one
and a drafter trained or exported with another belong to different targets (for throughput, which is all they
measure, that does not matter).

A random target has no tokenizer of its own. [`HashedTokenizer`] stands in: it splits text into GPT-2-style pieces
(words with their leading space, numbers of up to three digits, runs of punctuation or spaces), about as many as a BPE
tokenizer's tokens for English and code, and gives each piece a fixed id in the vocabulary (a CRC-32 of its bytes); no
chat template. Prompts then have realistic lengths and ids; what they say does not matter to random weights.

    >>> target, tokenizer = build_random_target("random:qwen3-8b", torch.bfloat16, "cuda")
    >>> drafter = random_drafter(target)  # 5 layers, block 16: the DFlash paper's drafter shape
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizer

from .modeling import DFlashConfig, DFlashDraftModel
from .special_tokens import configure_generation

RANDOM_PREFIX = "random:"
RANDOM_DRAFTER_LAYERS = 5  # the DFlash paper's drafter
RANDOM_DRAFTER_BLOCK = 16
RANDOM_SEED = 0

_QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)

RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": _QWEN3_8B,
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128009,
    ),
    "gemma-3-4b": dict(
        model_type="gemma3_text",
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=262208,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=106,
    ),
    "qwen3-coder-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        vocab_size=151936,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        attention_bias=True,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        vocab_size=201088,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
        },
        tie_word_embeddings=False,
        bos_token_id=199998,
        eos_token_id=200002,
        pad_token_id=199999,
    ),
    # hybrid: Gated DeltaNet linear attention with a gated full-attention layer every fourth (partial multimodal RoPE)
    "qwen3.5-9b": dict(
        model_type="qwen3_5_text",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        vocab_size=248320,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        bos_token_id=248044,
        eos_token_id=248046,
    ),
    # Gemma 4: five sliding layers (head 256, window 1024) per full one (head 512, 4 key/value heads shared by keys
    # and values), softcapped logits
    "gemma-4-31b": dict(
        model_type="gemma4_text",
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=60,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=4,
        attention_k_eq_v=True,
        sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
        hidden_size_per_layer_input=0,
        vocab_size=262144,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=106,
    ),
    # Qwen3-8B's layout at a size the tests run in a blink
    "tiny-qwen3": {
        **_QWEN3_8B,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "bos_token_id": 510,
        "eos_token_id": 511,
    },
}
# the mixture-of-experts shapes scaled down the same way: their own routers, 4 experts, 2 per token
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, bos_token_id=510, eos_token_id=511)  # fmt: skip
RANDOM_SHAPES["tiny-qwen3-moe"] = {
    **RANDOM_SHAPES["qwen3-coder-30b-a3b"], **_TINY, "moe_intermediate_size": 32, "num_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 4096,
}  # fmt: skip
RANDOM_SHAPES["tiny-gpt-oss"] = {
    **RANDOM_SHAPES["gpt-oss-20b"], **_TINY, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"] * 4, "pad_token_id": 509,
}  # fmt: skip
RANDOM_SHAPES["qwen3.5-0.8b"] = {
    **RANDOM_SHAPES["qwen3.5-9b"], "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
    "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_value_heads": 16, "tie_word_embeddings": True,
}  # fmt: skip
RANDOM_SHAPES["qwen3.6-27b"] = {
    **RANDOM_SHAPES["qwen3.5-9b"], "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
    "num_attention_heads": 24, "linear_num_value_heads": 48,
}  # fmt: skip
RANDOM_SHAPES["tiny-qwen3.5"] = {
    **RANDOM_SHAPES["qwen3.5-9b"], **_TINY, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "max_position_embeddings": 4096,
}  # fmt: skip
RANDOM_SHAPES["tiny-gemma4"] = {
    **RANDOM_SHAPES["gemma-4-31b"], **_TINY, "global_head_dim": 32, "num_global_key_value_heads": 1,
    "sliding_window": 16, "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
    "bos_token_id": 509, "max_position_embeddings": 4096,
}  # fmt: skip
"""The shapes of the random targets, by the name after `random:` (the public models' `config.json` values)."""

# GPT-2's pre-tokenizer pattern, with Python's `re` classes: contractions, words, 1-3 digits, punctuation, spaces
_PIECES = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+""")


def is_random_target(name: object) -> bool:
    """Whether `name` names a random target (`random:<shape>`)."""
    return isinstance(name, str) and name.startswith(RANDOM_PREFIX)


def random_config(name: str):
    """The Transformers config of the random target `name` (`random:<shape>`); a `ValueError` naming the shapes for
    an unknown one."""
    shape = RANDOM_SHAPES.get(name.removeprefix(RANDOM_PREFIX)) if is_random_target(name) else None
    if shape is None:
        known = ", ".join(RANDOM_PREFIX + key for key in RANDOM_SHAPES)
        raise ValueError(f"Unknown random target {name!r}: choose one of {known}.")
    values = dict(shape)
    return AutoConfig.for_model(values.pop("model_type"), **values)


class HashedTokenizer(PreTrainedTokenizer):
    """A random target's tokenizer: GPT-2-style pieces, each a fixed id (see the module docstring); the model's EOS
    id is its one special token, also used for padding."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_size: int, eos_token_id: int, **kwargs) -> None:
        self._vocab_size, self._eos_id = int(vocab_size), int(eos_token_id)
        super().__init__(eos_token="<eos>", pad_token="<eos>", **kwargs)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {"<eos>": self._eos_id}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return _PIECES.findall(text)

    def _convert_token_to_id(self, token: str) -> int:
        if token == "<eos>":
            return self._eos_id
        # surrogatepass: text with lone surrogates (e.g. from a JSON `\ud800` escape) still gets its fixed ids
        index = zlib.crc32(token.encode("utf-8", "surrogatepass")) % (self._vocab_size - 1)
        return index + 1 if index >= self._eos_id else index  # never the EOS id

    def _convert_id_to_token(self, index: int) -> str:
        return "<eos>" if index == self._eos_id else f"<{index}>"

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


def build_random_target(
    name: str, dtype: torch.dtype, device: str | torch.device | None = None, seed: int = RANDOM_SEED
) -> tuple[PreTrainedModel, HashedTokenizer]:
    """The random target `name` (`random:<shape>`) built directly on `device` (default: CPU) in `dtype`, its weights
    drawn from a generator seeded with `seed`, in eval mode with its generation config set; and its tokenizer."""
    config = random_config(name)
    device = torch.device(device or "cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.name_or_path = name
    tokenizer = HashedTokenizer(config.vocab_size, config.eos_token_id)
    model.eval()
    configure_generation(model, tokenizer)
    return model, tokenizer


def random_drafter(
    target: PreTrainedModel,
    num_layers: int = RANDOM_DRAFTER_LAYERS,
    block_size: int = RANDOM_DRAFTER_BLOCK,
    seed: int = RANDOM_SEED,
) -> DFlashDraftModel:
    """An untrained DFlash drafter for `target` (every size from its config, `DFlashConfig.from_target`), built on
    its device in its dtype with seeded random weights, in eval mode: a drafter forward of the real cost."""
    config = DFlashConfig.from_target(target.config, num_hidden_layers=num_layers, block_size=block_size)
    with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(target.device):
            drafter = DFlashDraftModel._from_config(config, dtype=target.dtype)
    return drafter.eval()
