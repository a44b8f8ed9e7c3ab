"""Recipe switches of DFlashTrainingConfig: coverage, distillation, initialisation from the target, Muon, bf16
autocast, held-out acceptance evaluation with best-checkpoint selection and early stopping, the loss scored a chunk of
slots at a time."""

from __future__ import annotations

import logging

import pytest
import torch
from dflash_hf.trainers import DFlashDataCollator, DFlashTrainer, DFlashTrainingConfig, optimizers, sample_anchors
from dflash_hf.trainers.initialisation import initialise_from_target
from dflash_hf.trainers.masks import valid_anchor_positions
from dflash_hf.trainers.optimizers import MuonWithAdamW, newton_schulz_float32_pays, orthogonalise_in_float32
from testing_utils import (
    LOSS_OPTIONS,
    REPO,
    fixed_batch,
    make_tiny_target,
    run_make_data,
    tiny_train_config,
    write_prompts,
)

from dflash_hf.data.features import OfflineFeatureDataset, cache_features
from dflash_hf.data.make import load_training_data
from dflash_hf.target.adapter import TargetAdapter

pytestmark = pytest.mark.usefixtures("single_thread")


config = tiny_train_config


def full_batch(data):
    return DFlashDataCollator(pad_token_id=0)([data[i] for i in range(len(data))])


def trainer_of(tiny_data, output_dir, **recipe) -> DFlashTrainer:
    """A trainer of `tiny_data`'s target on its rows, with the tiny recipe changed by `recipe`."""
    target, tok, data = tiny_data
    return DFlashTrainer(args=config(output_dir, **recipe), target=target, train_dataset=data, processing_class=tok)


def seeded_anchors(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """8 anchors a row of `batch` (B = 4), drawn by a generator seeded 0."""
    lengths = batch["attention_mask"].sum(1)
    return sample_anchors(batch["loss_mask"], lengths, 4, 8, generator=torch.Generator().manual_seed(0))


def test_coverage_every_response_position_is_an_anchor(tiny_data):
    _, _, data = tiny_data
    batch = full_batch(data)
    lengths = batch["attention_mask"].sum(1)
    anchors, valid = sample_anchors(batch["loss_mask"], lengths, 4, num_anchors=10_000)
    expected = valid_anchor_positions(batch["loss_mask"], lengths, 4)
    for row in range(anchors.shape[0]):
        assert sorted(anchors[row][valid[row]].tolist()) == expected[row].nonzero().flatten().tolist()


def _weighted_slot_loss(trainer, target, batch, anchors, slot_loss, differentiable: bool = False):
    """The block loss recomputed by hand, slot by slot: `slot_loss(target logits at p - 1, draft logits at p)`
    weighted like the trainer's (B = 4); a float, or with `differentiable` a tensor in the drafter's graph."""
    from dflash_hf.trainers.masks import block_attention_mask, build_blocks

    ids, mask = batch["input_ids"], batch["attention_mask"]
    blocks = build_blocks(ids, batch["loss_mask"], *anchors, 4, trainer.mask_token_id, trainer.loss_decay_gamma)
    adapter = TargetAdapter(target, trainer.model.config.target_layer_ids)
    with torch.no_grad():
        context, final = trainer.target_features(ids, mask)
    with torch.set_grad_enabled(differentiable):
        out = trainer.model(
            noise_embeds=adapter.embed(blocks.block_ids),
            context_hidden_states=context,
            position_ids=blocks.position_ids,
            attention_mask=block_attention_mask(*anchors, ids.shape[1], 4),
        )
        hidden = out.last_hidden_state.view(ids.shape[0], anchors[0].shape[1], 4, -1)
        total, weight_sum = 0.0, 0.0
        for b, j, k in (blocks.weights > 0).nonzero().tolist():
            pos = int(anchors[0][b, j]) + k
            weight = float(blocks.weights[b, j, k])
            total = total + weight * slot_loss(adapter.logits(final[b, pos - 1]), adapter.logits(hidden[b, j, k]))
            weight_sum += weight
    return total / weight_sum if differentiable else float(total) / weight_sum


def test_distillation_pulls_towards_the_targets_distribution(tiny_data, tmp_path):
    """w=1 is exactly the cross-entropy against the target's softmax one position before each slot; w=0 is the
    hard-label loss; the mix is linear."""
    target, _, data = tiny_data
    trainer = trainer_of(tiny_data, tmp_path / "a", distill_weight=1.0)
    batch = full_batch(data)
    anchors = seeded_anchors(batch)
    with torch.no_grad():
        soft, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        trainer.distill_weight = 0.0
        hard, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        trainer.distill_weight = 0.25
        mixed, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
    assert abs(mixed.item() - (0.75 * hard.item() + 0.25 * soft.item())) < 1e-4
    assert abs(soft.item() - hard.item()) > 1e-3

    # reference: the soft loss recomputed by hand, slot by slot, from the target's softmax at position p - 1
    def soft_ce(teacher_logits, student_logits):
        return -(teacher_logits.softmax(-1) * student_logits.log_softmax(-1)).sum()

    assert abs(soft.item() - _weighted_slot_loss(trainer, target, batch, anchors, soft_ce)) < 1e-4


def test_total_variation_loss_is_deepspecs_mix(tiny_data, tmp_path):
    """tv_weight=t: (1 - t) * CE(label) + t * TV, with TV recomputed by hand slot by slot against the target's softmax
    one position before each slot; the trainer's gradient is autograd's of that reference."""
    target, _, data = tiny_data
    trainer = trainer_of(tiny_data, tmp_path / "a", tv_weight=0.9)
    batch = full_batch(data)
    anchors = seeded_anchors(batch)
    with torch.no_grad():
        mixed, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        trainer.tv_weight = 0.0
        hard, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
    trainer.tv_weight = 1.0

    def tv(teacher_logits, student_logits):
        return 0.5 * (teacher_logits.softmax(-1) - student_logits.softmax(-1)).abs().sum()

    reference = _weighted_slot_loss(trainer, target, batch, anchors, tv)
    assert abs(mixed.item() - (0.1 * hard.item() + 0.9 * reference)) < 1e-4
    assert 0.0 < reference < 1.0

    pure, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
    ours = torch.autograd.grad(pure, trainer.model.fc.weight)[0]
    by_hand = _weighted_slot_loss(trainer, target, batch, anchors, tv, differentiable=True)
    expected = torch.autograd.grad(by_hand, trainer.model.fc.weight)[0]
    assert torch.allclose(ours, expected, atol=1e-6, rtol=1e-4)


def test_tv_weight_is_checked_and_needs_the_teacher(tmp_path):
    with pytest.raises(ValueError, match=r"tv_weight must be in \[0, 1 - distill_weight\]"):
        config(tmp_path, tv_weight=0.6, distill_weight=0.5)
    with pytest.raises(ValueError, match="tv_weight must be in"):
        config(tmp_path, tv_weight=-0.1)
    for distill, tv in ((0.8, 0.2), (0.9, 0.1), (0.0, 1.0)):  # weights adding up to 1 in floats
        assert config(tmp_path, distill_weight=distill, tv_weight=tv).tv_weight == tv


def test_target_hard_labels_are_the_targets_argmax(tiny_data, tmp_path):
    """hard_labels='target': on regenerated data the same labels as the data's; on teacher-forced (here: corrupted)
    text the target's own argmax one position before each slot, recomputed by hand."""
    target, _, data = tiny_data
    trainer = trainer_of(tiny_data, tmp_path / "a", hard_labels="target")
    batch = full_batch(data)
    anchors = seeded_anchors(batch)

    def losses(batch):
        with torch.no_grad():
            trainer.hard_labels = "target"
            own, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
            trainer.hard_labels = "data"
            given, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        return own.item(), given.item()

    own, given = losses(batch)
    assert abs(own - given) < 1e-5  # the data is the target's own greedy text
    corrupted = dict(batch)
    generator = torch.Generator().manual_seed(1)
    noise = torch.randint(4, 64, batch["input_ids"].shape, generator=generator)
    corrupted["input_ids"] = torch.where(batch["loss_mask"].bool(), noise, batch["input_ids"])
    own, given = losses(corrupted)
    assert abs(own - given) > 1e-3

    def hard_ce(teacher_logits, student_logits):
        return -student_logits.log_softmax(-1)[teacher_logits.argmax()]

    assert abs(own - _weighted_slot_loss(trainer, target, corrupted, anchors, hard_ce)) < 1e-4


def test_distillation_training_reaches_lower_teacher_loss(tiny_data, tmp_path):
    """A few steps with w=1 lower the soft loss (the student moves towards the teacher)."""
    data = tiny_data[2]
    trainer = trainer_of(tiny_data, tmp_path, distill_weight=1.0, max_steps=12, learning_rate=3e-3)
    batch = full_batch(data)
    anchors = seeded_anchors(batch)
    with torch.no_grad():
        before, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
    trainer.train()
    with torch.no_grad():
        after, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
    assert after.item() < before.item() - 0.05


def test_offline_final_hidden_matches_online_distillation(tiny_data, tmp_path):
    target, tok, data = tiny_data
    trainer = trainer_of(tiny_data, tmp_path / "on", distill_weight=1.0)
    feats = tmp_path / "features"
    cache_features(target, data, feats, trainer.model.config.target_layer_ids, batch_size=2, progress=False)
    offline = OfflineFeatureDataset(data, feats, trainer.model.config.target_layer_ids)
    assert offline.has_final_hidden and offline[0]["target_final_hidden"].shape[-1] == target.config.hidden_size
    batch = full_batch(data)
    off_batch = DFlashDataCollator(pad_token_id=0)([offline[i] for i in range(len(offline))])
    anchors = seeded_anchors(batch)
    with torch.no_grad():
        online, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        cached, _ = trainer.dflash_loss(trainer.model, off_batch, anchors=anchors)
    assert abs(online.item() - cached.item()) < 2e-2 * max(1.0, online.item())
    # a folder cached without final hidden states cannot feed distillation
    bare = tmp_path / "bare"
    cache_features(target, data, bare, trainer.model.config.target_layer_ids, final_hidden=False, progress=False)
    with pytest.raises(ValueError, match="final hidden states"):
        DFlashTrainer(
            model=trainer.model,
            target=target,
            train_dataset=data,
            processing_class=tok,
            args=config(tmp_path / "off", distill_weight=0.5, features="offline", features_dir=str(bare)),
        )


def test_init_from_target_copies_the_top_layers(tiny_data, tmp_path):
    target = tiny_data[0]
    trainer = trainer_of(tiny_data, tmp_path, init_from_target=True)
    drafter = trainer.model
    layers = target.model.layers
    top = len(layers) - 2
    for i, layer in enumerate(drafter.layers):
        assert torch.equal(layer.self_attn.q_proj.weight, layers[top + i].self_attn.q_proj.weight)
        assert torch.equal(layer.mlp.down_proj.weight, layers[top + i].mlp.down_proj.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    # fc picks the last tap: the fused context is the first copied layer's input norm of that tap's output
    hidden = target.config.hidden_size
    features = torch.randn(1, 3, 2 * hidden)
    with torch.no_grad():
        fused = drafter.fuse_context(features)
        expected = layers[top].input_layernorm(features[..., -hidden:])
    assert torch.allclose(fused, expected, atol=1e-5)
    with pytest.raises(ValueError, match="Llama/Qwen-style"):
        initialise_from_target(drafter, make_tiny_target("gemma3"))


@pytest.mark.parametrize("native", [None, "AMX-BF16"])
def test_muon_optimises_matrices_and_adamw_the_rest(native, tiny_data, tmp_path, monkeypatch):
    """Muon for the 2-D weights, AdamW for the rest; on a CPU without native bf16 Muon orthogonalises in float32."""
    monkeypatch.setattr("dflash_hf.runtime.native_bf16_feature", lambda: native)
    trainer = trainer_of(tiny_data, tmp_path, muon=True, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, MuonWithAdamW) and opt.newton_schulz_float32 == (native is None)
    muon, adamw = opt._inner
    assert isinstance(muon, torch.optim.Muon) and all(p.ndim == 2 for p in muon.param_groups[0]["params"])
    assert isinstance(adamw, torch.optim.AdamW) and all(p.ndim == 1 for p in adamw.param_groups[0]["params"])
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert any("proj" in n for n in changed) and any("norm" in n for n in changed)
    # the scheduler drives both inner optimizers
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == trainer.lr_scheduler.get_last_lr()[0]


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_muon_float32_orthogonalisation_is_torchs_in_more_precision(shape, monkeypatch):
    """Same iteration as torch's bf16 one (within bf16 rounding), used by a Muon step only where chosen, then put
    back."""
    from torch.optim import _muon

    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    args = ((_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C), _muon.DEFAULT_NS_STEPS, _muon.EPS)
    ours = orthogonalise_in_float32(grad, *args)
    assert ours.dtype == torch.float32 and ours.shape == grad.shape
    assert torch.allclose(ours, _muon._zeropower_via_newtonschulz(grad, *args).float(), atol=0.05)
    calls = []

    def counted(name, function):
        def wrapper(*a, **k):
            calls.append(name)
            return function(*a, **k)

        return wrapper

    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", counted("bf16", _muon._zeropower_via_newtonschulz))
    monkeypatch.setattr(optimizers, "orthogonalise_in_float32", counted("float32", orthogonalise_in_float32))
    installed = _muon._zeropower_via_newtonschulz
    for float32 in (False, True):
        weight = torch.nn.Parameter(grad.clone())
        weight.grad = grad.clone()
        MuonWithAdamW([weight], lr=0.1, newton_schulz_float32=float32).step()
        assert _muon._zeropower_via_newtonschulz is installed
    assert calls == ["bf16", "float32"]
    monkeypatch.setattr("dflash_hf.runtime.native_bf16_feature", lambda: None)
    assert newton_schulz_float32_pays(torch.device("cpu")) and not newton_schulz_float32_pays(torch.device("cuda"))
    monkeypatch.setattr("dflash_hf.runtime.native_bf16_feature", lambda: "AMX-BF16")
    assert not newton_schulz_float32_pays(torch.device("cpu"))


def test_muon_checkpoint_resumes_the_same_run(tiny_data, tmp_path):
    target, tok, data = tiny_data
    kw = dict(muon=True, max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=2)
    full = DFlashTrainer(args=config(tmp_path / "full", **kw), target=target, train_dataset=data, processing_class=tok)
    full.train()
    torch.manual_seed(5)
    resumed = DFlashTrainer(
        args=config(tmp_path / "res", **kw), target=target, train_dataset=data, processing_class=tok
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for key, value in resumed.model.state_dict().items():
        assert torch.allclose(value, full.model.state_dict()[key], atol=1e-6), key


@pytest.mark.parametrize("native", ["AMX-BF16", None])
def test_bf16_autocast_trains_on_cpu(native, tiny_data, tmp_path, monkeypatch, caplog):
    """bf16 autocast trains on any CPU; where bf16 is emulated (no native feature) the trainer says it is slow."""
    target, tok, data = tiny_data
    monkeypatch.setattr("dflash_hf.runtime.native_bf16_feature", lambda: native)
    with caplog.at_level(logging.WARNING, logger="dflash_hf"):
        trainer = DFlashTrainer(
            args=config(tmp_path, bf16=True, max_steps=2), target=target, train_dataset=data, processing_class=tok
        )
    assert ("train with bf16=False on this machine" in caplog.text) == (native is None)
    seen = []
    handle = trainer.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer.train()
    handle.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights stay fp32


def test_held_out_acceptance_selects_the_best_checkpoint(tiny_data, tmp_path):
    """Evaluation uses every anchor (deterministic), reports blockwise acceptance, and with load_best_model_at_end
    the best evaluation's weights are the ones kept; early stopping ends a run that stopped improving."""
    target, tok, data = tiny_data
    args = config(
        tmp_path,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        per_device_eval_batch_size=6,
    )
    assert args.metric_for_best_model == "acceptance_length_blockwise" and args.greater_is_better
    trainer = DFlashTrainer(args=args, target=target, train_dataset=data, eval_dataset=data, processing_class=tok)
    first = trainer.evaluate()
    again = trainer.evaluate()
    assert first["eval_acceptance_length_blockwise"] == again["eval_acceptance_length_blockwise"]
    assert "eval_accuracy_slot_1" in first
    assert 1.0 <= first["eval_acceptance_length_decoding"] <= args.block_size
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_acceptance_length_blockwise" in e]
    assert len(evals) == 3
    best = max(e["eval_acceptance_length_blockwise"] for e in evals)
    assert trainer.state.best_metric == best
    assert abs(trainer.evaluate()["eval_acceptance_length_blockwise"] - best) < 1e-9

    stop = config(
        tmp_path / "stop",
        max_steps=40,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        early_stopping_patience=1,
        learning_rate=0.0,
    )
    stopper = DFlashTrainer(args=stop, target=target, train_dataset=data, eval_dataset=data, processing_class=tok)
    stopper.train()
    assert stopper.state.global_step < 40  # lr 0: no improvement, stopped after one patient evaluation


def test_bad_recipe_values_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="distill_weight"):
        DFlashTrainingConfig(output_dir=str(tmp_path), distill_weight=1.5, use_cpu=True)
    with pytest.raises(ValueError, match="hard_labels must be one of"):
        DFlashTrainingConfig(output_dir=str(tmp_path), hard_labels="teacher", use_cpu=True)
    with pytest.raises(ValueError, match="early_stopping_patience"):
        DFlashTrainingConfig(output_dir=str(tmp_path), early_stopping_patience=0, use_cpu=True)


def test_train_offers_the_export_formats_it_writes(tmp_path, capsys):
    """--export_format's help names only the layouts `train` writes; another one is refused, pointing to `export`."""
    import dataclasses
    import re

    from dflash_hf.cli import main as cli_main
    from dflash_hf.commands.train import TRAIN_EXPORT_FORMATS, DFlashScriptArguments

    field = next(f for f in dataclasses.fields(DFlashScriptArguments) if f.name == "export_format")
    assert re.findall(r"'([^']+)'", field.metadata["help"]) == list(TRAIN_EXPORT_FORMATS)
    argv = ["train", "--target", "smollm2-135m", "--data", str(tmp_path), "--output_dir", str(tmp_path / "run")]
    assert cli_main([*argv, "--use_cpu", "true", "--export_format", "speculators"]) == 2
    error = capsys.readouterr().err
    assert "--export_format must be 'dflash-hf' or 'official'" in error and "`dflash-hf export`" in error


def test_max_train_samples_trains_on_a_prefix(tiny_data, tmp_path):
    data = tiny_data[2]
    trainer = trainer_of(tiny_data, tmp_path, max_train_samples=2)
    assert len(trainer.train_dataset) == 2
    assert [trainer.train_dataset[i]["input_ids"] for i in range(2)] == [data[i]["input_ids"] for i in range(2)]
    with pytest.raises(ValueError, match="max_train_samples"):
        DFlashTrainingConfig(output_dir=str(tmp_path), max_train_samples=0, use_cpu=True)


def test_skip_train_samples_trains_on_the_rows_a_grown_folder_added(tiny_data, tmp_path):
    target, tok, data = tiny_data
    trainer = trainer_of(tiny_data, tmp_path, skip_train_samples=1, max_train_samples=2)
    assert [trainer.train_dataset[i]["input_ids"] for i in range(len(trainer.train_dataset))] == [
        data[i]["input_ids"] for i in range(1, 3)
    ]
    with pytest.raises(ValueError, match="leaves nothing"):
        DFlashTrainer(
            args=config(tmp_path, skip_train_samples=len(data)), target=target, train_dataset=data, processing_class=tok
        )
    with pytest.raises(ValueError, match="skip_train_samples"):
        DFlashTrainingConfig(output_dir=str(tmp_path), skip_train_samples=-1, use_cpu=True)


def test_train_command_reads_a_yaml_recipe_and_flags_override_it(tiny_data, tmp_path, caplog):
    """`dflash-hf train --config recipe.yaml` (TRL's parser): the file sets the recipe, command-line flags win."""
    import json

    from dflash_hf.cli import main as cli_main

    target, tok, _ = tiny_data
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    run_make_data(target, tok, tmp_path / "data", write_prompts(tmp_path / "p.jsonl"), max_new_tokens=12)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"target: {tmp_path / 'target'}\ndata: {tmp_path / 'data'}\nbase_model: test-org/tiny\n"
        f"output_dir: {tmp_path / 'run'}\nblock_size: 4\nnum_draft_layers: 1\nnum_target_features: 2\n"
        "num_anchors: 8\nmax_steps: 3\ndistill_weight: 0.5\nuse_cpu: true\nreport_to: none\ndisable_tqdm: true\n"
        "save_strategy: 'no'\n"
    )
    assert cli_main(["train", "--config", str(recipe), "--max_steps", "2"]) == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 2  # the flag overrode the file's 3
    args = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert args["block_size"] == 4 and args["num_hidden_layers"] == 1  # the file's recipe was used

    # several data folders at once: regenerated + teacher-forced rows, the target's argmax as hard labels
    replies = tmp_path / "chats.jsonl"
    replies.write_text(
        "".join(json.dumps({"id": f"c{i}", "prompt": f"hi {i}", "response": "yo " * (i + 1)}) + "\n" for i in range(3))
    )
    run_make_data(target, tok, tmp_path / "tf", replies, max_new_tokens=12, responses="source")
    both = f"{tmp_path / 'data'},{tmp_path / 'tf'}"
    argv = ["train", "--config", str(recipe), "--data", both, "--hard_labels", "target", "--output_dir"]
    # a reduced draft vocabulary: its coverage is logged at --log_level info and recorded on the card
    argv = [*argv[:1], "--draft_vocab_size", "6", "--log_level", "info", *argv[1:]]
    with caplog.at_level(logging.INFO, logger="dflash_hf"):
        assert cli_main(argv + [str(tmp_path / "mix")]) == 0
    assert "Draft vocabulary: the 6 most frequent response tokens" in caplog.text
    summary = json.loads((tmp_path / "mix" / "train_summary.json").read_text())
    assert summary["samples"] == len(load_training_data(tmp_path / "data")) + 3
    card = (tmp_path / "mix" / "final" / "README.md").read_text()
    assert "regenerated" in card and "3 teacher-forced" in card and "hard_labels" in card
    assert "draft_vocabulary_coverage" in card


def test_a_saved_bf16_drafter_continues_training_in_fp32(tiny_data, tmp_path):
    """Warm start from a checkpoint saved in bf16 (like the bundled drafter): master weights are fp32 again."""
    target, tok, data = tiny_data
    first = DFlashTrainer(args=config(tmp_path / "a"), target=target, train_dataset=data, processing_class=tok)
    first.model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    warm = DFlashTrainer(
        model=str(tmp_path / "bf16"),
        args=config(tmp_path / "b", max_steps=1),
        target=target,
        train_dataset=data,
        processing_class=tok,
    )
    assert all(p.dtype == torch.float32 for p in warm.model.parameters())
    warm.train()


@pytest.mark.parametrize(
    "recipe",
    sorted((REPO / "examples" / "recipes").rglob("*.yaml")),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_shipped_recipes_parse(recipe):
    """Every recipe under examples/recipes/ (ablations/ included) is a valid `dflash-hf train --config` file."""
    import yaml

    from dflash_hf.commands.train import _trl_parser

    # --use_cpu: GPU recipes (qwen3-8b.yaml: bf16) are parsed on this CPU-only machine too
    script, config = _trl_parser().parse_args_and_config(["--config", str(recipe), "--use_cpu", "true"])
    values = yaml.safe_load(recipe.read_text())
    for key, value in values.items():
        parsed = getattr(script, key) if hasattr(script, key) else getattr(config, key)
        if key not in ("use_cpu", "report_to"):  # report_to "none" becomes []
            assert parsed == value or str(parsed) == str(value) or getattr(parsed, "value", None) == value, key


@pytest.mark.parametrize(
    "settings",
    [*LOSS_OPTIONS.values(), dict(markov_rank=4, markov_loss_weight=0.5, loss_weighting="dpace", distill_weight=0.5)],
    ids=[*LOSS_OPTIONS, "markov-dpace-distill"],
)
def test_a_chunked_loss_is_the_whole_loss_with_a_chunk_of_logits_at_a_time(tiny_data, tmp_path, monkeypatch, settings):
    """`loss_chunk_size=5`: the same loss, gradients and accuracy statistics as every slot at once, and the LM head
    never scores more than 5 slots in one call (forward or recomputation in the backward pass)."""
    target, tok, data = tiny_data
    trainer = DFlashTrainer(args=config(tmp_path, **settings), target=target, train_dataset=data, processing_class=tok)
    assert trainer.loss_chunk_size == 0  # on CPU: every slot at once by default
    batch, anchors = fixed_batch(trainer, data)
    trainer.model.train()
    results, logits = [], trainer.adapter.draft_logits
    for size in (0, 5):
        trainer.loss_chunk_size = size
        trainer.model.zero_grad()
        scored = []
        monkeypatch.setattr(
            trainer.adapter, "draft_logits", lambda h, *a, seen=scored: seen.append(h.shape[0]) or logits(h, *a)
        )
        loss, stats = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        loss.backward()
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]
        results.append((loss.detach(), stats["correct"], grads, scored))
    (whole, correct, grads, scored), (chunked, chunked_correct, chunked_grads, chunked_scored) = results
    assert max(scored) > 5 and max(chunked_scored) <= 5
    with torch.no_grad():  # evaluation: chunked without recomputation, the same loss
        trainer.model.eval()
        evaluated, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
    assert torch.allclose(evaluated, chunked, rtol=1e-5)
    assert torch.allclose(whole, chunked, rtol=1e-5) and torch.equal(correct, chunked_correct)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(grads, chunked_grads))
