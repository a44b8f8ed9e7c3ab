"""End-to-end learning: make-data -> DFlashTrainer -> `dflash_hf.generate` accepts far more drafted tokens."""

from __future__ import annotations

import torch
from dflash_hf.trainers import DFlashTrainer, DFlashTrainingConfig
from testing_utils import PROMPTS, make_tiny_target, make_tokenizer, one_thread, run_make_data, write_prompts

from dflash_hf import DFlashDraftModel, generate
from dflash_hf.data.make import load_training_data
from dflash_hf.data.prompts import encode_prompt

BLOCK = 8
NEW_TOKENS = 40


def engine_tau(target, drafter, prompts) -> float:
    """Tokens committed per target verify forward, measured by the generation engine over all prompts."""
    lengths = []
    for ids in prompts:
        out = generate(
            target, drafter.eval(), torch.tensor([ids]), max_new_tokens=NEW_TOKENS, return_dict_in_generate=True
        )
        lengths.extend(n for row in out.accepted_lengths for n in row)
    return sum(lengths) / len(lengths)


def test_training_raises_engine_tau(tmp_path):
    with one_thread():
        target = make_tiny_target("llama", seed=0)
        tok = make_tokenizer()
        src = write_prompts(tmp_path / "p.jsonl")
        run_make_data(target, tok, tmp_path / "data", src, max_new_tokens=NEW_TOKENS, batch_size=6)
        data = load_training_data(tmp_path / "data")
        args = DFlashTrainingConfig(
            output_dir=str(tmp_path / "run"),
            max_steps=80,
            per_device_train_batch_size=6,
            learning_rate=3e-3,
            block_size=BLOCK,
            num_anchors=64,
            num_draft_layers=2,
            num_target_features=2,
            logging_steps=20,
            save_strategy="no",
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        torch.manual_seed(0)
        trainer = DFlashTrainer(args=args, target=target, train_dataset=data, processing_class=tok)
        untrained = DFlashDraftModel(trainer.model.config)
        untrained.load_state_dict(trainer.model.state_dict())
        prompts = [encode_prompt(tok, p) for p in PROMPTS]
        before = engine_tau(target, untrained, prompts)
        trainer.train()
        after = engine_tau(target, trainer.model, prompts)
        logs = [e for e in trainer.state.log_history if "acceptance_length" in e]
    # Measured with the engine on this setup: ~1.0 untrained, ~6-7.5 of a possible 8 after 80 steps.
    assert before < 1.5, before
    assert after > 4.0, (before, after)
    assert logs[-1]["acceptance_length"] > logs[0]["acceptance_length"]
