"""Shared fixtures: tiny random targets of every supported family, drafters built for them, an oracle drafter.

Everything is built in-process from configs; nothing is ever downloaded.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# commands store per-machine verdicts (`--dtype auto`'s precision.json, `--mkl-mode auto`'s) in the dflash-hf cache:
# a fresh one, whatever the environment names, so that no verdict of an earlier run decides a test and no stand-in
# verdict of a test reaches the user's cache
os.environ["DFLASH_HF_CACHE"] = tempfile.mkdtemp(prefix="dflash-hf-tests-")

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash_hf import DFlashConfig, DFlashDraftModel, runtime

torch.set_num_threads(1)  # tiny models: one thread is fastest and deterministic
# MKL fixes its float32 code path at the process's first matmul (from `MKL_CBWR`): take it here, from the environment
# the suite was started in, so a test that sets `MKL_CBWR` for its commands changes only their subprocesses
torch.ones(2, 2) @ torch.ones(2, 2)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Commands set torch's thread count (`--threads`, by default the CPUs this host has): give it back after each
    test, so that no later test runs on another host's count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _host_without_native_bf16(monkeypatch):
    """`--dtype auto`, the trainer's Muon precision and its bf16 warning follow `runtime.native_bf16_feature`: every
    test runs as on a CPU without native bfloat16 unless it stands in another kind of host itself (the tests of those
    choices do, for each kind), so that no outcome depends on this machine's bf16 units."""
    monkeypatch.setattr(runtime, "native_bf16_feature", lambda: None)


@pytest.fixture(autouse=True)
def _engine_cycle_clock(monkeypatch):
    """The engine's adaptive choices (the block size, the lookup branch) follow each cycle's wall time, which differs
    per host and per run: in tests every cycle takes one second, so that those choices follow acceptance alone, the
    same on every machine (the policies' use of costs has its own tests, with given costs)."""
    from dflash_hf.engine import generation_call

    ticks = itertools.count()
    monkeypatch.setattr(generation_call, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))


@pytest.fixture(autouse=True)
def _restore_mkl_mode():
    """CLI commands choose MKL's code path through `MKL_CBWR` (`runtime.select_mkl_mode`): keep a test's choice
    from reaching later tests' subprocesses."""
    before = os.environ.get("MKL_CBWR")
    yield
    if before is None:
        os.environ.pop("MKL_CBWR", None)
    else:
        os.environ["MKL_CBWR"] = before


@pytest.fixture(autouse=True)
def _measured_mkl_mode(monkeypatch):
    """`--mkl-mode auto` times MKL's code paths in worker processes once per machine (`dflash_hf.mkl_choice`): tests
    stand in a measurement where MKL's default path is fastest, so no command spends seconds timing; the real
    measurement has its own tests (tests/test_precision.py)."""
    from dflash_hf import mkl_choice

    def measure(modes, threads, *args, **kwargs):
        return {mode: {"1": 1.0, "4": 2.0, "8": 3.0} for mode in modes}

    monkeypatch.setattr(mkl_choice, "measure", measure)


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


def make_target_config(family: str, vocab_size: int = VOCAB):
    """Tiny config of a supported target family (Gemma: sliding window 8, softcapping on)."""
    common = {**COMMON, "vocab_size": vocab_size}
    if family == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if family == "gemma3":
        return Gemma3TextConfig(
            **common,
            sliding_window=GEMMA_SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
            tie_word_embeddings=False,
        )
    raise ValueError(family)


def make_target(family: str, seed: int = 0, attn_implementation: str = "sdpa", vocab_size: int = VOCAB):
    torch.manual_seed(seed)
    config = make_target_config(family, vocab_size)
    config._attn_implementation = attn_implementation
    cls = {"qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM}[family]
    model = cls(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model


def make_drafter(target, seed: int = 1, block_size: int = 4, num_layers: int = 2, **kwargs) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = DFlashConfig.from_target(
        target.config, num_hidden_layers=num_layers, block_size=block_size, num_target_features=2, **kwargs
    )
    return DFlashDraftModel(config).eval()


FAMILIES = ["qwen3", "llama", "gemma3"]


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


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
        past_key_values=None,
        cache=None,
        **kwargs,
    ):
        out = super().forward(
            noise_embeds,
            context_hidden_states,
            position_ids,
            attention_mask,
            past_key_values=past_key_values,
            cache=cache,
            **kwargs,
        )
        block = noise_embeds.shape[1]
        embed_table = self._embed_table
        anchor_ids = (noise_embeds[:, 0, None, :] - embed_table[None]).abs().sum(-1).argmin(-1)
        hidden = torch.zeros_like(out.last_hidden_state, dtype=torch.float64)
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
        out.last_hidden_state = hidden.to(out.last_hidden_state.dtype)
        return out


def make_oracle(target, references, corrupt=None, block_size: int = 4) -> OracleDrafter:
    torch.manual_seed(1)
    config = DFlashConfig.from_target(target.config, num_hidden_layers=1, block_size=block_size, num_target_features=2)
    oracle = OracleDrafter(config).eval().setup(target, references, corrupt)
    embeds = target.get_input_embeddings()
    oracle._embed_table = embeds(torch.arange(VOCAB)).detach()
    return oracle


def greedy_reference(target, input_ids, attention_mask=None, max_new_tokens: int = 24) -> torch.Tensor:
    return target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False)


def strip(row: torch.Tensor, pad: int = 0) -> list[int]:
    """Tokens of a row without left/right padding (pad id 0 is never generated by the tiny targets' prompts)."""
    tokens = row.tolist()
    while tokens and tokens[0] == pad:
        tokens.pop(0)
    while tokens and tokens[-1] == pad:
        tokens.pop()
    return tokens
