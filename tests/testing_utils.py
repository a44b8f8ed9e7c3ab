"""Builders shared by the tests: tiny random targets of every supported family, drafters built for them, an oracle
drafter, offline tokenizers, tiny prompt files and training configs, saved target folders, the chi-square check of
sampling, the count of host reads, and the patterns of `generate`'s summary line.

Everything is built in-process from configs; nothing is ever downloaded. Fixtures live in `conftest.py`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import string
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel

REPO = Path(__file__).resolve().parents[1]  # the repository: README.md, pyproject.toml, examples/


class CountingBackend(CompileCounter):
    """A dynamo backend that counts the graphs it gets and runs them as traced (no inductor), left itself by
    `CompileConfig.to_dict`'s deep copy: the engine's compiled path, tested on CPU without compiling kernels."""

    def __deepcopy__(self, memo):
        return self


# ------------------------------------------------------------------------------------- tiny targets and drafters

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GEMMA_SLIDING_WINDOW = 8
FAMILIES = ["qwen3", "qwen2", "llama", "gemma3"]
# mixture-of-experts targets (Qwen3-Coder-30B-A3B, gpt-oss, MiniMax-M2): their families' own routers and experts
MOE_FAMILIES = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=GEMMA_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 3,
    ),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
}
# hybrid targets (Qwen3.5/3.6, Qwen3.5-MoE, Qwen3-Next): Gated DeltaNet layers with a full-attention layer every fourth
_LINEAR_ATTENTION = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
_SPARSE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
HYBRID_FAMILIES = {
    "qwen3_5_text": _LINEAR_ATTENTION,
    "qwen3_5_moe_text": {**_LINEAR_ATTENTION, **_SPARSE},
    "qwen3_next": {**_LINEAR_ATTENTION, **_SPARSE},
}
# Gemma 4: per-layer head sizes (full layers 32, sliding 16), per-layer input embeddings, two layers sharing keys and
# values, softcapping
GEMMA4 = dict(
    sliding_window=GEMMA_SLIDING_WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    global_head_dim=32,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=16,
    num_kv_shared_layers=2,
    final_logit_softcapping=30.0,
)
# DeepSeek-V3 (Kimi K2): multi-head latent attention, a dense first layer, routed and shared experts
DEEPSEEK_V3 = dict(
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=8,
    num_key_value_heads=COMMON["num_attention_heads"],
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
AUTO_FAMILIES = {**MOE_FAMILIES, **HYBRID_FAMILIES, "gemma4_text": GEMMA4, "deepseek_v3": DEEPSEEK_V3}


def make_target_config(family: str, vocab_size: int = VOCAB, tie_word_embeddings: bool = False):
    """Tiny config of a supported target family (Qwen2: q/k/v biases, as Qwen2.5; Gemma: sliding window 8,
    softcapping on)."""
    common = {**COMMON, "vocab_size": vocab_size, "tie_word_embeddings": tie_word_embeddings}
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "qwen2":
        return Qwen2Config(**common, max_window_layers=COMMON["num_hidden_layers"])
    if family == "llama":
        return LlamaConfig(**common)
    if family in AUTO_FAMILIES:  # MoE targets (4 experts, 2 per token), hybrid targets, Gemma 4: their own classes
        return AutoConfig.for_model(family, **{**common, **AUTO_FAMILIES[family]})
    if family == "gemma3":
        return Gemma3TextConfig(
            **common,
            sliding_window=GEMMA_SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
        )
    raise ValueError(family)


def make_target(
    family: str,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    vocab_size: int = VOCAB,
    tie_word_embeddings: bool = False,
):
    torch.manual_seed(seed)
    config = make_target_config(family, vocab_size, tie_word_embeddings)
    config._attn_implementation = "eager" if family == "gpt_oss" else attn_implementation  # its sinks: eager only
    classes = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}
    if family in AUTO_FAMILIES:
        model = AutoModelForCausalLM.from_config(config).eval()
    else:
        model = classes.get(family, Gemma3ForCausalLM)(config).eval()
    with torch.no_grad():  # biases start at zero: make them matter
        for name, parameter in model.named_parameters():
            if name.endswith("_proj.bias"):
                parameter.normal_(0.0, 0.3)
            elif family == "gemma4_text":  # its own initialisation makes every greedy continuation repeat one token
                parameter.normal_(*((0.0, 0.3) if parameter.dim() >= 2 else (1.0, 0.2)))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model


# multimodal wrappers (as `AutoModelForImageTextToText` loads them) and the text decoder family each holds
WRAPPERS = {"qwen3_5": "qwen3_5_text", "gemma4": "gemma4_text", "kimi_k25": "deepseek_v3", "muse_glimmer": None}
_VISION = {
    "qwen3_5": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"]),
    "gemma4": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16),
    "kimi_k25": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     pos_emb_height=4, pos_emb_width=4),
    "muse_glimmer": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         pos_emb_height=4, pos_emb_width=4),
}  # fmt: skip


def make_wrapped_target(model_type: str):
    """A tiny multimodal wrapper (`AutoModelForImageTextToText`) around the text decoder `make_target` builds for its
    family (its weights copied in), or Muse-Glimmer's own (sliding window 8), which exists only wrapped."""
    from transformers import AutoModelForImageTextToText

    extra = {"audio_config": None} if model_type == "gemma4" else {}
    family = WRAPPERS[model_type]
    text = make_target(family) if family else None
    text_config = text.config.to_dict() if text else {**COMMON, "sliding_window": GEMMA_SLIDING_WINDOW}
    if model_type == "kimi_k25":
        extra["projection_hidden_size"] = 32
    config = AutoConfig.for_model(model_type, text_config=text_config, vision_config=_VISION[model_type], **extra)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    if text is not None:
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model


def make_tiny_target(family: str = "llama", seed: int = 0, vocab_size: int = 64):
    """A tiny random target (hidden 64, 6 layers) of a supported family, built offline (see `make_target`)."""
    return make_target(family, seed=seed, vocab_size=vocab_size)


def make_drafter(target, seed: int = 1, block_size: int = 4, num_layers: int = 2, **kwargs) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = DFlashConfig.from_target(
        target.config, num_hidden_layers=num_layers, block_size=block_size, num_target_features=2, **kwargs
    )
    return DFlashDraftModel(config).eval()


class OracleDrafter(DFlashDraftModel):
    """A drafter rigged to propose the target's own greedy continuation.

    For every block it looks up the reference continuation of the row (identified by the anchor's position and id;
    ambiguous anchors get junk proposals)
    and returns hidden states that the target's square LM head maps onto exactly those tokens. `corrupt` lists
    `(position, slot)` pairs where it proposes a wrong token instead, to vary acceptance lengths across rows.
    """

    def setup(self, target, references: list[list[int]], corrupt=None) -> "OracleDrafter":
        weight = target.get_output_embeddings().weight.detach().double()
        if weight.shape[0] != weight.shape[1]:
            raise ValueError("the oracle needs a square LM head (vocab == hidden)")
        self._inverse = torch.linalg.inv(weight)
        self._by_anchor = {}
        for row, tokens in enumerate(references):
            for pos, tok in enumerate(tokens):
                key = (pos, tok)
                # an anchor shared by two rows is ambiguous: propose junk there (still a valid proposal)
                self._by_anchor[key] = row if self._by_anchor.get(key, row) == row else None
        self._references = references
        self._corrupt = set(corrupt or [])
        self._vocab = weight.shape[0]
        return self

    def forward(
        self,
        noise_embeds,
        context_hidden_states=None,
        position_ids=None,
        attention_mask=None,
        cache=None,
        **kwargs,
    ):
        out = super().forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache=cache, **kwargs)
        out.last_hidden_state = self._oracle_states(noise_embeds, position_ids, out.last_hidden_state)
        return out

    @torch.compiler.disable  # host-side lookups: a compiled drafter (`compile=True`) runs them eagerly
    def _oracle_states(self, noise_embeds, position_ids, last_hidden_state):
        """Final states whose LM-head logits put the reference's token (or its corruption) on top of every slot."""
        block = noise_embeds.shape[1]
        embed_table = self._embed_table
        anchor_ids = (noise_embeds[:, 0, None, :] - embed_table[None]).abs().sum(-1).argmin(-1)
        hidden = torch.zeros_like(last_hidden_state, dtype=torch.float64)
        for b in range(noise_embeds.shape[0]):
            anchor_pos = int(position_ids[b, -block])
            row = self._by_anchor.get((anchor_pos, int(anchor_ids[b])))
            for slot in range(1, block):
                pos = anchor_pos + slot
                token = (int(anchor_ids[b]) + 7) % self._vocab
                if row is not None and pos < len(self._references[row]):
                    token = self._references[row][pos]
                if (pos, slot) in self._corrupt:
                    token = (token + 1) % self._vocab
                target_logits = torch.full((self._vocab,), -10.0, dtype=torch.float64)
                target_logits[token] = 10.0
                hidden[b, slot] = self._inverse @ target_logits
        return hidden.to(last_hidden_state.dtype)


def make_oracle(target, references, corrupt=None, block_size: int = 4) -> OracleDrafter:
    torch.manual_seed(1)
    config = DFlashConfig.from_target(target.config, num_hidden_layers=1, block_size=block_size, num_target_features=2)
    oracle = OracleDrafter(config).eval().setup(target, references, corrupt)
    embeds = target.get_input_embeddings()
    oracle._embed_table = embeds(torch.arange(VOCAB)).detach()
    return oracle


def corrupt_slots(
    every: int, slot_step: int = 1, position_step: int = 1, positions: int = 80, block_size: int = 4
) -> set[tuple[int, int]]:
    """The `(position, slot)` drafts an oracle gets wrong (`make_oracle`'s `corrupt`): those below `positions` whose
    `position_step * position + slot_step * slot` is a multiple of `every`, over the draft slots 1 .. block_size - 1."""
    return {
        (pos, slot)
        for pos in range(positions)
        for slot in range(1, block_size)
        if (position_step * pos + slot_step * slot) % every == 0
    }


def greedy_reference(target, input_ids, attention_mask=None, max_new_tokens: int = 24) -> torch.Tensor:
    return target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False)


def left_padded(prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` of `prompts` (token lists or 1-D tensors) padded on the left with id 0."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.as_tensor(prompt)
        attention_mask[i, width - len(prompt) :] = 1
    return input_ids, attention_mask


def assert_rows_are_greedy(sequences: torch.Tensor, width: int, prompts, references, label: object = None) -> None:
    """Each row of a left-padded batch's `sequences` (prompts `width` wide) goes on as its own plain greedy
    `references[i]` (prompt included) does, then holds padding only."""
    for i, (prompt, reference) in enumerate(zip(prompts, references)):
        generated = torch.as_tensor(reference[len(prompt) :])
        row = sequences[i, width:]
        assert torch.equal(row[: len(generated)], generated), (label, f"row {i}")
        assert (row[len(generated) :] == 0).all(), (label, f"row {i}")


def assert_short_runs_are_greedy(target, drafter, input_ids: torch.Tensor, candidates: str) -> None:
    """With `max_new_tokens` ending inside a cycle (1, 3, 6, 11), `candidates` give plain greedy decoding's tokens."""
    for max_new_tokens in (1, 3, 6, 11):
        expected = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[99])
        out = dflash_hf.generate(
            target, drafter, input_ids, max_new_tokens=max_new_tokens, eos_token_id=[99], candidates=candidates
        )
        assert torch.equal(out, expected), max_new_tokens


def strip(row: torch.Tensor, pad: int = 0) -> list[int]:
    """Tokens of a row without left/right padding (pad id 0 is never generated by the tiny targets' prompts)."""
    tokens = row.tolist()
    while tokens and tokens[0] == pad:
        tokens.pop(0)
    while tokens and tokens[-1] == pad:
        tokens.pop()
    return tokens


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside the block (tiny models run ~10x faster than on 2 contended threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------ tokenizers, prompts, training configs

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.digits + " .,!?:;'()-_+=*/<>#@\"")
CHAR_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '#' + m['content'] }}{% endfor %}{% if add_generation_prompt %}{{ '>' }}{% endif %}"
)
PROMPTS = [
    "hello world",
    "write a poem about cats",
    "what is two plus two?",
    "explain gravity briefly",
    "list three colors",
    "how do birds fly",
]


def make_tokenizer(vocab_size: int = 64, chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `vocab_size` ids (0 pad, 1 bos, 2 eos, 3 unk), built offline."""
    symbols = (SPECIALS + CHARS)[:vocab_size]
    vocab = {tok: i for i, tok in enumerate(symbols)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template:
        fast.chat_template = CHAR_CHAT_TEMPLATE
    return fast


def write_prompts(path: Path, prompts=PROMPTS, extra: list[dict] | None = None) -> Path:
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(prompts)] + list(extra or [])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_make_data(target, tokenizer, folder: Path, source: Path | str, **settings) -> dict:
    """`make_data` of `target` from the prompt file `source` into `folder`, without a progress bar and with nothing
    held out unless `settings` say otherwise; returns the manifest."""
    from dflash_hf.data.make import make_data

    settings = {"held_out_fraction": 0.0, "progress": False, **settings}
    return make_data(target, tokenizer, folder, source=str(source), **settings)


# every way the loss is made, by name (the tests of the loss's host reads and of its chunks run each)
LOSS_OPTIONS = {
    "exp-decay": {},
    "dpace": dict(loss_weighting="dpace"),
    "distill-tv": dict(distill_weight=0.3, tv_weight=0.2),
    "target-labels-draft-vocab": dict(hard_labels="target", draft_vocab_size=12),
    "markov-head": dict(markov_rank=4, markov_loss_weight=0.5),
}


def tiny_train_config(output_dir, **overrides):
    """`DFlashTrainingConfig` of a tiny CPU run (B=4, 2 draft layers, 2 taps, 8 anchors), with `overrides`."""
    from dflash_hf.trainers import DFlashTrainingConfig

    base = dict(
        output_dir=str(output_dir),
        block_size=4,
        num_anchors=8,
        num_draft_layers=2,
        num_target_features=2,
        per_device_train_batch_size=3,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    base.update(overrides)
    return DFlashTrainingConfig(**base)


def fixed_batch(trainer, data, seed=0):
    """The whole dataset collated into one batch, with anchors drawn under `seed`: `(batch, (anchors, valid))`."""
    from dflash_hf.trainers import DFlashDataCollator, sample_anchors

    batch = DFlashDataCollator(pad_token_id=0)([data[i] for i in range(len(data))])
    torch.manual_seed(seed)
    anchors = sample_anchors(batch["loss_mask"], batch["attention_mask"].sum(1), trainer.block_size, 8)
    return batch, anchors


# ------------------------------------------------------------------------------------------- host reads
# On a GPU every read of a tensor's values on the host (`tolist`, `item`, `bool(tensor)`, `int(tensor)`, `.cpu()`, ...)
# waits for all the work queued before it, and so does every op whose output shape depends on tensor values
# (`nonzero`, boolean-mask indexing, `multinomial`'s checks). `host_reads` counts both kinds on any device.

READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__")
aten = torch.ops.aten
# ops whose result's shape (or validity check) depends on values: on a GPU they wait for the queue like a read
VALUE_DEPENDENT_OPS = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.multinomial.default,
}


def _boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else None
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


class HostReads(TorchDispatchMode):
    """Counts the host reads made while `active` in `counts`: the value-dependent ops it sees as a dispatch mode, and
    the tensor methods that read values (through [`host_reads`])."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active and (
            func in VALUE_DEPENDENT_OPS
            or (func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and _boolean_index(args))
        ):
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        before, self.active = self.active, True
        try:
            yield
        finally:
            self.active = before


@contextlib.contextmanager
def host_reads(monkeypatch, value_dependent_ops: bool = True) -> Iterator[HostReads]:
    """A [`HostReads`] counting inside the block whenever it is `active` (`with reads.counting(): ...`): the tensor
    methods of `READ_METHODS` (patched on `torch.Tensor`; a read inside a read counts once) and, with
    `value_dependent_ops`, the value-dependent ops (a dispatch mode, under which dynamo compiles nothing)."""
    reads = HostReads()

    def reading(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if reads.active:
                reads.counts[name] += 1
            before, reads.active = reads.active, False
            try:
                return real(self, *args, **kwargs)
            finally:
                reads.active = before

        return read

    for name in READ_METHODS:
        monkeypatch.setattr(torch.Tensor, name, reading(name))
    with reads if value_dependent_ops else contextlib.nullcontext():
        yield reads


# ------------------------------------------------------------------------------------- saved target folders

WORDS = "the a cat dog sat on mat ran far and then it was red blue big small happy code def return print".split()
WORD_CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def make_word_tokenizer(chat_template: str | None = WORD_CHAT_TEMPLATE, pad: bool = True) -> PreTrainedTokenizerFast:
    """Offline word-level tokenizer over `WORDS` (ids 0-3 are `<pad> <s> </s> <unk>`)."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>" if pad else None,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def make_llama(seed: int = 0) -> LlamaForCausalLM:
    """Tiny random LLaMA (6 layers) over the word-level vocabulary."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(SPECIALS) + len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def save_tiny_target(folder: Path, chat_template: str | None = WORD_CHAT_TEMPLATE, seed: int = 0) -> Path:
    """A tiny LLaMA and its word-level tokenizer saved to `folder`, as a target folder the commands load."""
    make_llama(seed).save_pretrained(folder)
    make_word_tokenizer(chat_template).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------- sampling's distribution check

SAMPLING_VOCAB = 8
TEMPERATURE, TOP_K = 1.3, 6
SAMPLES = 6000


def tiny_sampling_models():
    """`(target, drafter)`: a tiny LLaMA over `SAMPLING_VOCAB` ids with no end token, and a 1-layer drafter for it."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SAMPLING_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        initializer_range=0.5,
        pad_token_id=0,
        eos_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    torch.manual_seed(1)
    drafter = DFlashDraftModel(
        DFlashConfig.from_target(config, num_hidden_layers=1, block_size=4, num_target_features=2)
    ).eval()
    return target, drafter


def tiny_sampling_target(model_type: str, **extra):
    """`(target, drafter)` as [`tiny_sampling_models`] gives them, the target of `model_type` (with its family's
    `extra` settings: experts, linear-attention heads) at the same small sizes."""
    dense, _ = tiny_sampling_models()
    config = AutoConfig.for_model(
        model_type,
        **{k: getattr(dense.config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")},
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        initializer_range=0.5,
        pad_token_id=0,
        eos_token_id=None,
        **extra,
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval()
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = None, 0
    torch.manual_seed(1)
    drafter = DFlashDraftModel(
        DFlashConfig.from_target(config, num_hidden_layers=1, block_size=4, num_target_features=2)
    )
    return target, drafter.eval()


def _processed_probs(target, sequences: torch.Tensor) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    with torch.no_grad():
        logits = target(sequences).logits[:, -1].float()
    return torch.softmax(warpers(sequences, logits), dim=-1)


def exact_joint_of_tokens_2_and_3(target, prompt: torch.Tensor) -> torch.Tensor:
    """P(t2, t3) of plain sampling, summing out t1 (exact enumeration over the vocabulary)."""
    p1 = _processed_probs(target, prompt)[0]
    firsts = torch.cat([prompt.expand(SAMPLING_VOCAB, -1), torch.arange(SAMPLING_VOCAB)[:, None]], dim=1)
    p2 = _processed_probs(target, firsts)  # (t1, t2)
    pairs = torch.tensor(list(itertools.product(range(SAMPLING_VOCAB), repeat=2)))
    seconds = torch.cat([prompt.expand(len(pairs), -1), pairs], dim=1)
    p3 = _processed_probs(target, seconds).view(SAMPLING_VOCAB, SAMPLING_VOCAB, SAMPLING_VOCAB)  # (t1, t2, t3)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def chi_square(target, drafter, prompt, expected: torch.Tensor, proposal: str = "argmax") -> tuple[float, int]:
    """`(statistic, cells)`: chi-square of tokens 2 and 3 of `SAMPLES` speculative samples against `expected`."""
    torch.manual_seed(1234)
    out = dflash_hf.generate(
        target,
        drafter,
        prompt.expand(SAMPLES, -1).contiguous(),
        max_new_tokens=3,
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=1.0,
        sampling_proposal=proposal,
    )
    t2, t3 = out[:, -2], out[:, -1]
    counts = torch.bincount(t2 * SAMPLING_VOCAB + t3, minlength=SAMPLING_VOCAB * SAMPLING_VOCAB).double()
    expected_counts = expected.reshape(-1).double() * SAMPLES
    keep = expected_counts > 5  # standard chi-square validity; the rare cells are pooled
    pooled = torch.cat([counts[keep], counts[~keep].sum()[None]])
    pooled_expected = torch.cat([expected_counts[keep], expected_counts[~keep].sum()[None]])
    return float(((pooled - pooled_expected) ** 2 / pooled_expected.clamp_min(1e-9)).sum()), int(keep.sum())


def chi_square_bound(cells: int) -> float:
    """Five standard deviations above the chi-square statistic's mean for `cells` kept cells."""
    dof = cells  # pooled cell included, minus one constraint
    return dof + 5 * (2 * dof) ** 0.5


# ---------------------------------------------------------------------------------- `generate`'s summary line

NUMBER = r"\d+\.\d\d"
SUMMARY = rf"^tokens: (\d+) \| tau: {NUMBER} \| {NUMBER} tokens/s$"
COMPARE = (
    rf"^tokens: (\d+) \| tau: {NUMBER} \| {NUMBER} tokens/s \| plain (greedy|sampling|greedy, static cache) \((float32|bfloat16)\): {NUMBER} tokens/s "
    rf"\| speedup: {NUMBER}x \| identical: (yes|no|n/a \(sampling\))$"
)


# ------------------------------------------------------------------------------------ a stand-in inference server


class StandInServer:
    """A loopback HTTP server answering as llama.cpp's `llama-server` (`api="llama.cpp"`) or an OpenAI-compatible
    completions server (`api="openai"`), with a tiny target's greedy answers; for make-data's `--server` tests.

    `tokenizer` is what `/tokenize` uses (another tokenizer stands in a server of another model), `vocab_size` what
    `/v1/models` reports (llama.cpp only), `token_ids=False` a server that returns no token ids, `slow_first` the
    seconds the first completion request takes longer. `most_in_flight` counts the most completion requests served at
    once, `started_while_first_ran` those that began while the first one was served. Use as a context manager; `url`
    is its address.
    """

    def __init__(
        self,
        target,
        tokenizer,
        api: str = "llama.cpp",
        vocab_size: int | None = None,
        token_ids: bool = True,
        slow_first: float = 0.0,
    ):
        import http.server
        import threading

        self.target, self.tokenizer, self.api = target, tokenizer, api
        self.vocab_size = target.config.vocab_size if vocab_size is None else vocab_size
        self.token_ids, self.slow_first = token_ids, slow_first
        self.in_flight = self.most_in_flight = self.completions = self.started_while_first_ran = 0
        self._first_running = False
        self._lock, self._model_lock = threading.Lock(), threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/props" and server.api == "llama.cpp":
                    return self._send(200, {"total_slots": 4})
                if self.path == "/v1/models":
                    meta = {"n_vocab": server.vocab_size} if server.api == "llama.cpp" else None
                    return self._send(200, {"data": [{"id": "stand-in", "meta": meta}]})
                self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    text = body["content"] if server.api == "llama.cpp" else body["prompt"]
                    ids = server.tokenizer(text, add_special_tokens=False)["input_ids"]
                    return self._send(200, {"tokens": ids})
                if (self.path, server.api) in (("/completion", "llama.cpp"), ("/v1/completions", "openai")):
                    limit = body["n_predict"] if server.api == "llama.cpp" else body["max_tokens"]
                    return self._send(200, server.complete(body["prompt"], limit))
                self._send(404, {"error": "not found"})

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def complete(self, prompt: list[int], limit: int) -> dict:
        import time

        with self._lock:
            self.in_flight += 1
            self.completions += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            first = self.completions == 1
            self._first_running |= first
            self.started_while_first_ran += self._first_running and not first
        time.sleep(0.05 + (self.slow_first if first else 0.0))  # requests overlap as on a server with several slots
        with self._model_lock, torch.no_grad():
            out = self.target.generate(
                torch.tensor([prompt]), max_new_tokens=limit, do_sample=False, eos_token_id=2, pad_token_id=0
            )
        tokens = out[0, len(prompt) :].tolist()
        with self._lock:
            self.in_flight -= 1
            self._first_running &= not first
        if self.api == "llama.cpp":
            return {"tokens": tokens, "content": "", "stop_type": "eos"} if self.token_ids else {"content": ""}
        choice = {"text": "", "finish_reason": "stop", **({"token_ids": tokens} if self.token_ids else {})}
        return {"choices": [choice]}

    def __enter__(self) -> "StandInServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()
