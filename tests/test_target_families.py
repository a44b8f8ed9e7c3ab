"""Every target family beyond the dense Qwen/LLaMA/Gemma 3 ones, bare and in the multimodal wrappers Transformers
loads them in, through the whole pipeline, as a user with such a target runs it: make-data, cached features, a short training run, both exports with their model cards, and a bench
whose every row is exact (a hybrid target's bench leaves out Transformers' assisted generation, which it refuses)."""

from __future__ import annotations

import pytest
import torch
from testing_utils import (
    HYBRID_FAMILIES,
    MOE_FAMILIES,
    WRAPPERS,
    make_oracle,
    make_target,
    make_tokenizer,
    make_wrapped_target,
    run_make_data,
    tiny_train_config,
    write_prompts,
)

import dflash_hf
from dflash_hf import DFlashDraftModel, bench
from dflash_hf.data.features import OfflineFeatureDataset, cache_features
from dflash_hf.data.make_folder import load_training_data
from dflash_hf.target.support import TARGET_FAMILIES

FAMILIES = [*MOE_FAMILIES, *HYBRID_FAMILIES, "gemma4_text", "deepseek_v3", *(f"wrapped:{name}" for name in WRAPPERS)]
NOTES = {"qwen": "Notes for Qwen targets", "gemma": "Notes for Gemma targets"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_through_make_data_features_training_exports_and_bench(family, tmp_path):
    from dflash_hf.trainers import DFlashTrainer

    wrapper = family.removeprefix("wrapped:") if family.startswith("wrapped:") else None
    target = make_wrapped_target(wrapper) if wrapper else make_target(family)
    tokenizer = make_tokenizer()
    family = target.config.get_text_config(decoder=True).model_type
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["hello world", "list three colors", "how do birds fly"])
    manifest = run_make_data(target, tokenizer, tmp_path / "data", prompts, max_new_tokens=12)
    assert manifest["target_model_type"] == family
    data = load_training_data(tmp_path / "data")
    args = tiny_train_config(tmp_path / "run", max_steps=2)
    trainer = DFlashTrainer(args=args, target=target, train_dataset=data, processing_class=tokenizer)
    cache_features(target, data, tmp_path / "features", trainer.model.config.target_layer_ids, batch_size=2)
    assert len(OfflineFeatureDataset(data, tmp_path / "features")) == len(data)
    assert trainer.train().global_step == 2
    for layout in ("dflash-hf", "official"):
        folder = dflash_hf.export(trainer.model, tmp_path / layout, target=target, base_model="org/tiny", format=layout)
        loaded = DFlashDraftModel.from_pretrained(folder)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trainer.model.state_dict().items())
        card = (folder / "README.md").read_text()
        family_notes = NOTES.get(TARGET_FAMILIES.get(family))
        assert family_notes is None or family_notes in card
    # the bench: an oracle drafter makes every engine row commit long, partial blocks
    references = [
        target.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0].tolist()
        for ids in ([1, 5, 9, 12, 5, 9], [1, 7, 7, 3, 30, 31])
    ]
    oracle = make_oracle(target, references, block_size=4)
    bench_prompts = [bench.BenchPrompt(id=f"p{i}", input_ids=ids[:6]) for i, ids in enumerate(references)]
    result = bench.run_bench(target, oracle, bench_prompts, max_new_tokens=8, warmup_tokens=2, progress=False)
    names = [method.name for method in result.methods]
    assert "dflash_b4" in names and "dflash_adaptive" in names
    if family in HYBRID_FAMILIES:
        assert "native_dflash" not in names and "prompt_lookup" not in names  # Transformers refuses them
        assert "dflash_b4_tree" in names and "dflash_b4_lookup" in names
    for method in result.methods:
        assert method.summary.exact, (family, method.name)
