"""Parity with z-lab's reference package (`dflash==0.1.0`, installed with `--no-deps`): official-layout drafters of
every published variant (sliding, mixed, causal and non-causal, embedding scale, logit multiplier and softcap) draft
the same logits, keep the same tokens per cycle and produce the same output here as in the reference's
`dflash_generate`; and drafters exported here load into the reference and draft the same."""

from __future__ import annotations

import os
import time

import pytest
import torch
from dflash_hf.modeling import DFlashConfig, DFlashDraftModel
from testing_utils import left_padded, make_drafter, make_target
from transformers import Qwen3Config

import dflash_hf
from dflash_hf.engine.candidates import DFlashChain
from dflash_hf.target.adapter import TargetAdapter

try:
    import dflash.model as reference
except ImportError:  # pragma: no cover - CI installs it
    if os.environ.get("DFLASH_HF_REQUIRE_REAL_TARGETS") == "1":  # CI: never skip silently
        raise
    pytest.skip(
        "z-lab's `dflash` package is not installed (pip install --no-deps dflash==0.1.0)", allow_module_level=True
    )

VOCAB = 8  # a small vocabulary: random drafters get blocks accepted, so every acceptance path runs
BLOCK = 8
PROMPT = torch.randint(3, VOCAB - 1, (1, 20), generator=torch.Generator().manual_seed(0))
SLIDING = {"sliding_window": 6, "use_sliding_window": True}
VARIANTS = {
    "full": {},
    "sliding": {"layer_types": ["sliding_attention"] * 3, **SLIDING},
    "mixed": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], **SLIDING},
    "sliding-non-causal": {"layer_types": ["sliding_attention"] * 3, **SLIDING, "is_causal": False},
    "full-causal": {"is_causal": True},
    "embedding-scale": {"dflash_config": {"input_embedding_scale": 8.0}},
    "multiplier-softcap": {"dflash_config": {"output_multiplier": 0.5, "final_logit_softcapping": 2.0}},
    "top-level-knobs": {"output_multiplier": 3.0, "final_logit_softcapping": 1.5, "input_embedding_scale": 0.5},
}

DFLASH2 = {
    "layer_types": ["sliding_attention"] * 3,
    **SLIDING,
    "is_causal": False,
    "dflash_config": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4},
}


@pytest.fixture(autouse=True)
def _reference_clock_on_cpu(monkeypatch):
    """The reference times its cycles with `torch.cuda.synchronize()`; on a CPU its plain clock stands in."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", vocab_size=VOCAB)


def reference_drafter(folder, variant: dict, seed: int = 3, architecture: str = "DFlashDraftModel"):
    """A random-weight drafter built with the reference's own classes, saved in its layout (a DFlash 2 one with a
    selector strong enough to leave the unary argmax, its codebooks saved without `.weight` as published)."""
    variant = dict(variant)
    dflash_config = {"block_size": BLOCK, "mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3]}
    dflash_config.update(variant.pop("dflash_config", {}))
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.3,
        num_target_layers=6,
        architectures=[architecture],
        dflash_config=dflash_config,
        **variant,
    )
    torch.manual_seed(seed)
    model = getattr(reference, architecture)(config).eval()
    if architecture == "DFlash2DraftModel":
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "base_kernel" in name or "kernel_projection" in name:
                    parameter.normal_(0.0, 0.3)
                elif "codebook" in name or "hidden_projection" in name:
                    parameter.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    if architecture == "DFlash2DraftModel":
        from safetensors.torch import load_file, save_file

        weights = load_file(f"{folder}/model.safetensors")
        renamed = {name.removesuffix(".weight") if "codebook" in name else name: w for name, w in weights.items()}
        save_file(renamed, f"{folder}/model.safetensors", metadata={"format": "pt"})
    return model


def record_draft_logits(monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Every draft's logits, as the reference (`compute_logits`) and this package (`draft_logits`) make them."""
    seen: dict[str, list[torch.Tensor]] = {"reference": [], "ours": []}
    compute_logits, draft_logits = reference.DFlashDraftModel.compute_logits, TargetAdapter.draft_logits

    def reference_logits(self, hidden, head):
        seen["reference"].append(compute_logits(self, hidden, head).clone())
        return seen["reference"][-1]

    def our_logits(self, hidden, token_ids=None):
        seen["ours"].append(draft_logits(self, hidden, token_ids).clone())
        return seen["ours"][-1]

    monkeypatch.setattr(reference.DFlashDraftModel, "compute_logits", reference_logits)
    monkeypatch.setattr(TargetAdapter, "draft_logits", our_logits)
    return seen


def run_ours(target, drafter, prompt, **kwargs):
    return dflash_hf.generate(
        target,
        drafter,
        prompt,
        max_new_tokens=40,
        do_sample=False,
        candidates="dflash",
        block_size=BLOCK,
        eos_token_id=[],
        return_dict_in_generate=True,
        **kwargs,
    )


def assert_same_cycles(seen, reference_out, ours, full_blocks_to_the_end: bool = False) -> None:
    """The same tokens, and the same acceptance and draft logits in every cycle (`full_blocks_to_the_end`: a compiled
    call drafts whole blocks to its end, the reference shorter ones at the end of its budget: the cycles before)."""
    assert torch.equal(reference_out.output_ids[:, : ours.sequences.shape[1]], ours.sequences)
    cycles = len(seen["reference"])
    if full_blocks_to_the_end:
        cycles = next(
            i for i, logits in enumerate(seen["reference"] + [None]) if logits is None or logits.shape[1] < BLOCK - 1
        )
        assert cycles >= len(seen["reference"]) * 3 // 4
    else:
        assert len(seen["reference"]) == len(seen["ours"])
    assert reference_out.acceptance_lengths[:cycles] == ours.accepted_lengths[0][:cycles]
    for cycle, (expected, got) in enumerate(zip(seen["reference"][:cycles], seen["ours"])):
        assert expected.shape == got.shape, cycle
        torch.testing.assert_close(got, expected.float(), atol=1e-4, rtol=1e-4, msg=f"cycle {cycle}")
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), cycle


@pytest.mark.parametrize("name", list(VARIANTS))
def test_official_variant_drafts_as_the_reference(name, target, tmp_path, monkeypatch):
    model = reference_drafter(tmp_path, VARIANTS[name])
    seen = record_draft_logits(monkeypatch)
    expected = reference.dflash_generate(model, target, PROMPT, 40, None, return_stats=True)
    assert max(expected.acceptance_lengths) > 1  # some blocks are accepted
    ours = run_ours(target, DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32), PROMPT)
    assert_same_cycles(seen, expected, ours)


def test_official_knobs_read_into_the_config(tmp_path):
    reference_drafter(tmp_path, {**VARIANTS["mixed"], "dflash_config": {"input_embedding_scale": 2.0}})
    config = DFlashConfig.from_pretrained(tmp_path)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.sliding_window == 6 and config.is_causal is None
    assert [config.layer_is_causal(i) for i in range(3)] == [True, False, True]
    assert config.input_embedding_scale == 2.0 and config.output_multiplier == 1.0
    assert config.final_logit_softcapping == 0.0  # the reference applies none where the key is absent
    assert config.context_window is None  # a full layer sees the whole context


def test_sliding_drafter_in_a_padded_batch_drafts_each_row_as_alone(target, tmp_path, monkeypatch):
    """Rows that accept different lengths leave masked positions in the pending context: the window still counts
    positions, so every row's drafts are those of its own call."""
    reference_drafter(tmp_path, VARIANTS["mixed"])
    drafter = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :13].tolist(), [5, 4, 3]]
    seen: list[tuple[list[int], torch.Tensor]] = []
    slots = DFlashChain.slots

    def recorded(self, state, block, block_pos):
        logits, hidden = slots(self, state, block, block_pos)
        seen.append((list(state.rows), logits))
        return logits, hidden

    monkeypatch.setattr(DFlashChain, "slots", recorded)
    input_ids, mask = left_padded(prompts)
    batched = run_ours(target, drafter, input_ids, attention_mask=mask)
    per_row = {row: [logits[rows.index(row)] for rows, logits in seen if row in rows] for row in range(len(prompts))}
    assert len({len(lengths) for lengths in batched.accepted_lengths}) > 1 or any(
        len(set(lengths)) > 1 for lengths in batched.accepted_lengths
    )
    for row, prompt in enumerate(prompts):
        seen.clear()
        alone = run_ours(target, drafter, torch.tensor([prompt]))
        assert batched.accepted_lengths[row] == alone.accepted_lengths[0], row
        assert len(per_row[row]) == len(seen), row
        # a batch drafts the block its longest row still has room for: a row's last cycles may draft more slots
        pairs = [(got, expected[0]) for got, (_, expected) in zip(per_row[row], seen)]
        same = next((i for i, (got, expected) in enumerate(pairs) if got.shape != expected.shape), len(pairs))
        assert same >= len(pairs) * 3 // 4, row
        for got, expected in pairs[:same]:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["mixed", "embedding-scale", "multiplier-softcap"])
def test_export_loads_into_the_reference_and_drafts_the_same(name, target, tmp_path, monkeypatch):
    """A drafter of this package with the variant's layout, exported in the official layout, is read by the
    reference as it is read here."""
    reference_drafter(tmp_path / "source", VARIANTS[name])
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "source", dtype=torch.float32)
    folder = dflash_hf.export(drafter, tmp_path / "official", target=target, base_model="tiny/qwen3", format="official")
    model = reference.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    seen = record_draft_logits(monkeypatch)
    expected = reference.dflash_generate(model, target, PROMPT, 40, None, return_stats=True)
    assert_same_cycles(seen, expected, run_ours(target, drafter, PROMPT))


def test_own_drafter_of_a_scaled_embedding_target_exports_its_scale(tmp_path):
    """A Gemma drafter of this package embeds the block with Gemma's scaled embedding: the official layout writes
    that scale, which the reference applies to the raw table."""
    gemma = make_target("gemma3")
    drafter = make_drafter(gemma)
    folder = dflash_hf.export(drafter, tmp_path / "official", target=gemma, base_model="tiny/gemma3", format="official")
    config = DFlashConfig.from_pretrained(folder)
    assert config.input_embedding_scale == pytest.approx(float(gemma.model.embed_tokens.embed_scale))
    assert config.final_logit_softcapping == gemma.config.final_logit_softcapping
    ids = torch.tensor([[3, 4, 5]])
    ours = TargetAdapter.for_drafter(gemma, drafter)
    exported = TargetAdapter.for_drafter(gemma, DFlashDraftModel.from_pretrained(folder))
    assert torch.equal(ours.embed(ids), exported.embed(ids))
    hidden = torch.randn(1, 3, 64)
    assert torch.equal(ours.draft_logits(hidden), exported.draft_logits(hidden))


def test_compiled_sliding_drafter_drafts_as_the_reference(target, tmp_path, monkeypatch):
    """`compile=True` (dynamo's full graph, on a counting backend): the drafter's keys in a static cache, the pending
    context padded; the window still counts positions, so the drafts are the reference's, in a padded batch too."""
    from torch._dynamo.testing import CompileCounter
    from transformers import CompileConfig

    class Counter(CompileCounter):
        def __deepcopy__(self, memo):
            return self

    model = reference_drafter(tmp_path, VARIANTS["mixed"])
    drafter = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    seen = record_draft_logits(monkeypatch)
    expected = reference.dflash_generate(model, target, PROMPT, 40, None, return_stats=True)
    torch._dynamo.reset()
    try:
        compile_config = CompileConfig(backend=Counter(), mode=None, fullgraph=True)
        compiled = run_ours(target, drafter, PROMPT, compile=compile_config)
        assert_same_cycles(seen, expected, compiled, full_blocks_to_the_end=True)
        input_ids, mask = left_padded([PROMPT[0].tolist(), [5, 4, 3]])
        batched = run_ours(target, drafter, input_ids, attention_mask=mask, compile=compile_config)
        assert batched.accepted_lengths[0] == compiled.accepted_lengths[0]
        assert torch.equal(batched.sequences[0, -40:], compiled.sequences[0, -40:])
    finally:
        torch._dynamo.reset()


def record_selected_paths(monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Every DFlash 2 draft (the selector's path), as the reference and this package choose them."""
    from dflash_hf.engine.token_choice import TokenChoice

    seen: dict[str, list[torch.Tensor]] = {"reference": [], "ours": []}
    select, draft_selected = reference.CandidateSelector.select, TokenChoice.draft_selected

    def reference_select(self, *args):
        out = select(self, *args)
        seen["reference"].append(out[0].clone())
        return out

    def our_select(self, *args):
        out = draft_selected(self, *args)
        seen["ours"].append(out[0].clone())
        return out

    monkeypatch.setattr(reference.CandidateSelector, "select", reference_select)
    monkeypatch.setattr(TokenChoice, "draft_selected", our_select)
    return seen


def test_dflash2_loads_from_published_files_and_drafts_as_the_reference(target, tmp_path, monkeypatch):
    """A DFlash 2 folder (codebooks without `.weight`) loads through `AutoModel` with remote code's classes, drafts
    the reference's logits and selector paths in every cycle, and the selector leaves the unary argmax."""
    model = reference_drafter(tmp_path, DFLASH2, architecture="DFlash2DraftModel")
    drafter = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert drafter.config.is_dflash2 and drafter.candidate_selector.top_k == 4
    seen, paths = record_draft_logits(monkeypatch), record_selected_paths(monkeypatch)
    expected = reference.dflash_generate(model, target, PROMPT, 40, None, return_stats=True)
    ours = run_ours(target, drafter, PROMPT)
    assert_same_cycles(seen, expected, ours)
    assert len(paths["reference"]) == len(paths["ours"])
    for cycle, (want, got) in enumerate(zip(paths["reference"], paths["ours"])):
        assert torch.equal(want, got), cycle
    argmaxes = torch.cat([logits.argmax(-1) for logits in seen["ours"]], dim=1)
    assert not torch.equal(torch.cat(paths["ours"], dim=1), argmaxes)  # the selector changed some choices


def test_dflash2_export_loads_into_the_reference_and_drafts_the_same(target, tmp_path, monkeypatch):
    """A DFlash 2 drafter exported in the official layout (codebooks without `.weight`) is the reference's
    `DFlash2DraftModel` and drafts the same paths; our own layout loads back the same tensors."""
    reference_drafter(tmp_path / "source", DFLASH2, architecture="DFlash2DraftModel")
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "source", dtype=torch.float32)
    folder = dflash_hf.export(drafter, tmp_path / "official", target=target, base_model="tiny/qwen3", format="official")
    model = reference.DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    seen, paths = record_draft_logits(monkeypatch), record_selected_paths(monkeypatch)
    expected = reference.dflash_generate(model, target, PROMPT, 40, None, return_stats=True)
    assert_same_cycles(seen, expected, run_ours(target, drafter, PROMPT))
    assert all(torch.equal(a, b) for a, b in zip(paths["reference"], paths["ours"]))
    ours = dflash_hf.export(drafter, tmp_path / "ours", target=target, base_model="tiny/qwen3")
    for folder in (ours, tmp_path / "official"):
        again = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)
        assert again.config.is_dflash2
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(again.state_dict()[name], tensor), name


def test_on_a_hybrid_target_the_reference_drifts_after_a_rejection_and_this_package_does_not(tmp_path, monkeypatch):
    """A Qwen3.5 target: the reference's loop crops its cache after a rejection, which rolls back the keys, values and
    convolution states but leaves each linear-attention layer's recurrent state past the rejected drafts, so its
    output leaves plain greedy's; this package's stays plain greedy's. Until the first rejection both draft alike."""
    target = make_target("qwen3_5_text", vocab_size=VOCAB)
    target.generation_config.eos_token_id = None
    model = reference_drafter(tmp_path, VARIANTS["full"])
    seen = record_draft_logits(monkeypatch)
    expected = reference.dflash_generate(model, target, PROMPT, 40, None, return_stats=True)
    ours = run_ours(target, DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32), PROMPT)
    plain = target.generate(PROMPT, max_new_tokens=40, do_sample=False)
    assert torch.equal(ours.sequences, plain)
    assert not torch.equal(expected.output_ids[:, : plain.shape[1]], plain)
    assert expected.acceptance_lengths[0] < BLOCK  # its first cycle rejected drafts
    torch.testing.assert_close(seen["ours"][0], seen["reference"][0].float(), atol=1e-4, rtol=1e-4)
