"""The Markov head (DSpark's): its config and layouts, a new head's zero start, exact greedy and sampled outputs when
slots are drafted one after another through it, and teacher-forced training with the backbone frozen or joint."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_hf.trainers import DFlashDataCollator, DFlashTrainer, sample_anchors
from dflash_hf.trainers.masks import build_blocks
from safetensors.torch import load_file
from testing_utils import (
    VOCAB,
    assert_rows_are_greedy,
    chi_square,
    chi_square_bound,
    exact_joint_of_tokens_2_and_3,
    greedy_reference,
    left_padded,
    make_drafter,
    make_target,
    run_make_data,
    tiny_sampling_models,
    tiny_train_config,
    write_prompts,
)

import dflash_hf
import dflash_hf.engine.token_choice as token_choice
from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.hub.speculators import config_from_speculators

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_NEW = 24
MARKOV_TENSORS = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
GATE_TENSORS = {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}


def random_head(drafter: DFlashDraftModel, seed: int = 0, std: float = 3.0) -> DFlashDraftModel:
    """Give the drafter's head trained-looking (random, non-zero) weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.markov_head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return drafter


def bigram_head(drafter: DFlashDraftModel, continuations: list[list[int]]) -> DFlashDraftModel:
    """A head (rank = vocabulary) that learned the continuations' bigrams: after token `a` it pushes `b` up strongly
    wherever `a b` occurs, so that its chained drafts are often what the target says."""
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB))
        w2 = drafter.markov_head.markov_w2.weight
        w2.zero_()
        for tokens in continuations:
            for previous, token in zip(tokens, tokens[1:]):
                w2[token, previous] = 60.0
    return drafter


def record_proposals(monkeypatch) -> list[dict]:
    """Record every `TokenChoice.propose` call of the engine: its inputs, its drafts, the call's sequences at that moment and its
    logits processors."""
    calls = []
    real = token_choice.TokenChoice.propose

    def recording(self, draft_logits, rows, markov_inputs=None):
        sequences = [self.sequence(row).clone() for row in rows]
        tokens, probs = real(self, draft_logits, rows, markov_inputs)
        calls.append(
            dict(
                logits=draft_logits,
                markov_inputs=markov_inputs,
                tokens=tokens,
                rows=list(rows),
                sequences=sequences,
                process=self.process,
            )
        )
        return tokens, probs

    monkeypatch.setattr(token_choice.TokenChoice, "propose", recording)
    return calls


# ---------------------------------------------------------------------------------------------------- config


def test_config_round_trip_and_checks(tmp_path):
    target = make_target("qwen3")
    config = DFlashConfig.from_target(target.config, num_target_features=2, markov_rank=8, markov_gated=True)
    back = DFlashConfig.from_dict(config.to_dict())
    assert (back.markov_rank, back.markov_gated) == (8, True)
    config.save_pretrained(tmp_path)
    loaded = DFlashConfig.from_pretrained(tmp_path)
    assert (loaded.markov_rank, loaded.markov_gated) == (8, True)
    plain = DFlashConfig.from_target(target.config, num_target_features=2)
    assert (plain.markov_rank, plain.markov_gated) == (0, False)
    assert DFlashDraftModel(plain).markov_head is None
    values = plain.to_dict()
    with pytest.raises(ValueError, match="markov_rank must be an int between 0"):
        DFlashConfig(**{**values, "markov_rank": -1})
    with pytest.raises(ValueError, match="markov_gated needs a Markov head"):
        DFlashConfig(**{**values, "markov_gated": True})
    with pytest.raises(ValueError, match="vocab_size"):
        DFlashConfig(**{**values, "markov_rank": 4, "vocab_size": None})


def test_head_shapes_follow_the_draft_vocabulary():
    """`markov_w1` is indexed by target ids, `markov_w2` maps onto the draft vocabulary (llama.cpp's shapes)."""
    target = make_target("llama")
    drafter = make_drafter(target, draft_vocab_size=24, markov_rank=8, markov_gated=True)
    shapes = {name: tuple(t.shape) for name, t in drafter.state_dict().items() if name.startswith("markov_head.")}
    hidden = target.config.hidden_size
    assert shapes == {
        "markov_head.markov_w1.weight": (VOCAB, 8),
        "markov_head.markov_w2.weight": (24, 8),
        "markov_head.gate_proj.weight": (8, hidden + 8),
        "markov_head.gate_proj.bias": (8,),
    }
    with pytest.raises(ValueError, match="already has a Markov head"):
        drafter.add_markov_head(8)
    with pytest.raises(ValueError, match="needs the slots' hidden states"):
        drafter.markov_head(torch.tensor([[3]]))


# ---------------------------------------------------------------------------------------------------- inference


@pytest.mark.parametrize("added", [False, True])
def test_a_new_head_leaves_the_drafts_unchanged(added):
    """`markov_w2` starts at zero (built with the config, or added to a trained drafter): same drafts, same cycles."""
    target = make_target("llama")
    plain = make_drafter(target)
    if added:
        drafter = make_drafter(target)
        drafter.add_markov_head(8, gated=True)
    else:
        drafter = make_drafter(target, markov_rank=8)
    assert drafter.load_state_dict(plain.state_dict(), strict=False).unexpected_keys == []
    bias = drafter.markov_head(torch.arange(VOCAB)[None], torch.randn(1, VOCAB, target.config.hidden_size))
    assert torch.equal(bias, torch.zeros_like(bias))
    input_ids, attention_mask = left_padded([[5, 9, 11, 4], [7, 8, 3, 12, 30, 31]])
    runs = [
        dflash_hf.generate(
            target,
            model,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW,
            candidates="dflash",
            return_dict_in_generate=True,
        )
        for model in (plain, drafter)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].accepted_lengths == runs[1].accepted_lengths


def test_greedy_output_with_a_trained_head_is_plain_greedy(family):
    """Left-padded rows, the block alone and with the lookup branch: every row is the target's own greedy output,
    while the head's chained drafts are accepted in runs."""
    target = make_target(family)
    prompts = [[5, 9, 11, 4], [7, 8, 3, 12, 30, 31, 40], [20, 21, 22]]
    references = [greedy_reference(target, torch.tensor([p]), max_new_tokens=MAX_NEW)[0].tolist() for p in prompts]
    drafter = bigram_head(
        make_drafter(target, markov_rank=VOCAB), [r[len(p) - 1 :] for p, r in zip(prompts, references)]
    )
    input_ids, attention_mask = left_padded(prompts)
    width = input_ids.shape[1]
    for candidates in ("dflash", "dflash+lookup"):
        out = dflash_hf.generate(
            target,
            drafter,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW,
            candidates=candidates,
            return_dict_in_generate=True,
        )
        assert_rows_are_greedy(out.sequences, width, prompts, references, candidates)
        assert max(n for row in out.accepted_lengths for n in row) > 1, candidates


@pytest.mark.parametrize("case", ["reduced vocabulary", "repetition penalty"])
def test_drafts_follow_the_sequential_argmax(case, monkeypatch):
    """Slot k's draft is the argmax of its logits plus the head's correction for the token drafted at slot k - 1
    (the anchor for slot 1), through the processors given the sequence and the drafts before it."""
    target = make_target("llama")
    if case == "reduced vocabulary":
        drafter = make_drafter(target, block_size=5, draft_vocab_size=40, markov_rank=8, markov_gated=True)
        drafter.set_draft_vocabulary(list(range(3, 43)))
        kwargs = {}
    else:
        drafter = make_drafter(target, block_size=5, markov_rank=8)
        kwargs = {"repetition_penalty": 1.5}
    random_head(drafter)
    calls = record_proposals(monkeypatch)
    input_ids, attention_mask = left_padded([[5, 9, 11, 4], [7, 8, 3, 12, 30, 31]])
    dflash_hf.generate(
        target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=12, candidates="dflash", **kwargs
    )
    draft_ids = drafter.draft_token_ids
    changed = 0
    for call in calls:
        anchors, hidden = call["markov_inputs"]
        previous = anchors
        for slot in range(call["logits"].shape[1]):
            with torch.no_grad():
                scores = call["logits"][:, slot] + drafter.markov_head(previous, hidden[:, slot]).float()
            if draft_ids is not None:
                scores = torch.full((scores.shape[0], VOCAB), float("-inf")).index_copy(1, draft_ids, scores)
            if kwargs:  # the engine's own processors, given each row's sequence and the drafts before this slot
                prefixes = [torch.cat([seq, call["tokens"][i, :slot]]) for i, seq in enumerate(call["sequences"])]
                scores = torch.cat(
                    [call["process"].for_row(r, p[None], s[None]) for r, p, s in zip(call["rows"], prefixes, scores)]
                )
            assert torch.equal(call["tokens"][:, slot], scores.argmax(-1)), slot
            independent = call["logits"][:, slot].argmax(-1)
            changed += int(
                (call["tokens"][:, slot] != (independent if draft_ids is None else draft_ids[independent])).sum()
            )
            previous = call["tokens"][:, slot]
    assert calls and changed > 0  # the head moved drafts away from the independent per-slot argmax


def test_a_diverged_head_has_no_say():
    """Non-finite corrections (a diverged head) are dropped: drafting and sampling stay well-defined and exact."""
    target = make_target("llama")
    drafter = make_drafter(target, markov_rank=8)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.fill_(float("nan"))
    input_ids = torch.tensor([[5, 9, 11, 4, 17]])
    out = dflash_hf.generate(target, drafter, input_ids, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(out, greedy_reference(target, input_ids, max_new_tokens=MAX_NEW))
    torch.manual_seed(0)
    sampled = dflash_hf.generate(target, drafter, input_ids, max_new_tokens=MAX_NEW, do_sample=True)
    assert sampled.shape[1] > input_ids.shape[1]


def test_native_path_drafts_without_the_head(monkeypatch):
    """Transformers' `speculation_type="dflash"` projects the drafter's hidden states itself: it never calls the
    head, and its output is still the target's greedy output."""
    target = make_target("qwen3")
    drafter = random_head(make_drafter(target, markov_rank=8))

    def never(*args, **kwargs):
        raise AssertionError("the native path called the Markov head")

    monkeypatch.setattr(drafter.markov_head, "forward", never)
    input_ids = torch.tensor([[5, 9, 11, 4, 17]])
    native = target.generate(
        input_ids, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter, speculation_type="dflash"
    )
    assert torch.equal(native, greedy_reference(target, input_ids, max_new_tokens=MAX_NEW))


@pytest.fixture(scope="module")
def sampling_setup():
    target, plain = tiny_sampling_models()
    drafter = DFlashDraftModel(DFlashConfig(**{**plain.config.to_dict(), "markov_rank": 4})).eval()
    drafter.load_state_dict(plain.state_dict(), strict=False)
    random_head(drafter, seed=2, std=1.5)
    prompt = torch.tensor([[3, 5, 1, 6]])
    return target, drafter, prompt, exact_joint_of_tokens_2_and_3(target, prompt)


@pytest.mark.parametrize("proposal", ["sample", "argmax"])
def test_sampling_through_the_head_matches_the_target_distribution(sampling_setup, proposal):
    """Each slot sampled from its corrected distribution given the slot before it, those distributions verified:
    the tokens follow the target's own distribution (chi-square against the exact joint of tokens 2 and 3)."""
    target, drafter, prompt, expected = sampling_setup
    statistic, cells = chi_square(target, drafter, prompt, expected, proposal)
    assert statistic < chi_square_bound(cells), statistic


def test_verifying_the_uncorrected_distributions_is_caught(sampling_setup, monkeypatch):
    """Drafts sampled through the head but verified against the backbone's own distributions are biased: the same
    bound rejects them (the distribution test can fail)."""
    target, drafter, prompt, expected = sampling_setup
    real = token_choice.TokenChoice.draft_chain

    def uncorrected_probs(self, draft_logits, rows, anchors, hidden_states):
        tokens, _ = real(self, draft_logits, rows, anchors, hidden_states)
        return tokens, self.draft_tokens(draft_logits, rows)[1]

    monkeypatch.setattr(token_choice.TokenChoice, "draft_chain", uncorrected_probs)
    statistic, cells = chi_square(target, drafter, prompt, expected, "sample")
    assert statistic > chi_square_bound(cells), statistic


# ---------------------------------------------------------------------------------------------------- training


def markov_trainer(tiny_data, output_dir, model=None, **overrides):
    target, tokenizer, data = tiny_data
    args = tiny_train_config(output_dir, **{"markov_rank": 16, "logging_steps": 100, **overrides})
    return DFlashTrainer(model=model, args=args, target=target, train_dataset=data, processing_class=tokenizer)


def fixed_loss(trainer, data) -> float:
    """The trainer's loss on the whole tiny dataset with fixed anchors (evaluation mode, no gradient)."""
    batch = DFlashDataCollator(pad_token_id=0)([data[i] for i in range(len(data))])
    anchors = sample_anchors(
        batch["loss_mask"],
        batch["attention_mask"].sum(1),
        trainer.block_size,
        8,
        generator=torch.Generator().manual_seed(0),
    )
    trainer.model.eval()
    with torch.no_grad():
        loss, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
    return float(loss)


def test_teacher_forcing_feeds_the_true_previous_tokens():
    """Slot k's head input is the true token at anchor + k - 1: the anchor for slot 1 (and for the untrained slot 0)."""
    input_ids = torch.arange(10, 30)[None]
    anchors = torch.tensor([[3, 9]])
    blocks = build_blocks(input_ids, torch.ones_like(input_ids), anchors, torch.ones_like(anchors).bool(), 4, 63, 4.0)
    assert blocks.previous_ids.tolist() == [[13, 13, 14, 15, 19, 19, 20, 21]]
    assert blocks.labels[0, :, 1:].tolist() == [[14, 15, 16], [20, 21, 22]]  # each slot's label follows its input


@pytest.mark.parametrize("gated", [False, True])
def test_frozen_backbone_trains_only_the_head(tiny_data, tmp_path, gated):
    """`freeze_backbone`: only `markov_head.*` is trainable and changes, the backbone stays bit-identical, the loss
    (on the corrected logits) goes down."""
    trainer = markov_trainer(
        tiny_data, tmp_path, freeze_backbone=True, markov_gated=gated, max_steps=20, learning_rate=1e-2
    )
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable == MARKOV_TENSORS | (GATE_TENSORS if gated else set())
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    start = fixed_loss(trainer, tiny_data[2])
    trainer.train()
    assert fixed_loss(trainer, tiny_data[2]) < start - 0.5
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]) == (name not in trainable), name


def test_joint_training_trains_head_and_backbone(tiny_data, tmp_path):
    trainer = markov_trainer(tiny_data, tmp_path, max_steps=20, learning_rate=1e-2)
    assert all(p.requires_grad for p in trainer.model.parameters())
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    start = fixed_loss(trainer, tiny_data[2])
    trainer.train()
    assert fixed_loss(trainer, tiny_data[2]) < start - 1.0
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert MARKOV_TENSORS <= changed and "fc.weight" in changed and "layers.0.mlp.up_proj.weight" in changed


def inner_optimizer(trainer) -> torch.optim.Optimizer:
    """The optimizer the trainer built, under accelerate's wrapper."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def learning_rates(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, float]:
    """Each named parameter's current learning rate (from its group)."""
    return {names[id(p)]: group["lr"] for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("muon", [False, True])
def test_markov_learning_rate_drives_the_head_alone(tiny_data, tmp_path, muon):
    """`markov_learning_rate`: the head's parameters learn at that rate, the backbone's at `learning_rate`, on one
    schedule; with `muon` the head is on AdamW (an embedding table) and the backbone's matrices on Muon."""
    trainer = markov_trainer(
        tiny_data, tmp_path, muon=muon, max_steps=4, learning_rate=1e-3, markov_learning_rate=1e-2, warmup_steps=0
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    rates = learning_rates(inner_optimizer(trainer), names)
    assert set(rates) == set(names.values())  # every parameter once
    assert {rates[name] for name in MARKOV_TENSORS} == {1e-2}
    assert {rate for name, rate in rates.items() if name not in MARKOV_TENSORS} == {1e-3}
    if muon:
        muon_opt, adamw = inner_optimizer(trainer)._inner
        on_muon = {names[id(p)] for group in muon_opt.param_groups for p in group["params"]}
        assert not on_muon & MARKOV_TENSORS and "fc.weight" in on_muon
        assert MARKOV_TENSORS <= {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    for _ in range(2):  # halfway through the cosine
        trainer.lr_scheduler.step()
    after = learning_rates(inner_optimizer(trainer), names)
    head_rate, backbone_rate = after["markov_head.markov_w1.weight"], after["fc.weight"]
    assert 0 < backbone_rate < 1e-3 and head_rate == pytest.approx(10 * backbone_rate)  # one cosine for both


@pytest.mark.parametrize("muon", [False, True])
def test_a_frozen_backbone_trains_the_head_at_its_own_rate(tiny_data, tmp_path, muon):
    """Only the head trains: with `muon` nothing is left for Muon, so the head gets the Trainer's AdamW; no empty
    parameter group stays behind, so the logged learning rate is the head's."""
    trainer = markov_trainer(
        tiny_data, tmp_path, muon=muon, freeze_backbone=True, max_steps=2, markov_learning_rate=5e-3, warmup_steps=0
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    optimizer = inner_optimizer(trainer)
    assert isinstance(optimizer, torch.optim.AdamW) and all(group["params"] for group in optimizer.param_groups)
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    assert learning_rates(optimizer, names) == dict.fromkeys(MARKOV_TENSORS, 5e-3)
    assert trainer.lr_scheduler.get_last_lr()[0] == 5e-3


@pytest.mark.parametrize("muon", [False, True])
def test_a_run_with_the_heads_own_rate_resumes_the_same_run(tiny_data, tmp_path, muon):
    """Checkpoints hold the head's parameter groups: resuming gives the weights of the uninterrupted run; a
    checkpoint of a run with other groups is refused with the fix."""
    kw = dict(muon=muon, max_steps=4, save_strategy="steps", save_steps=2, markov_learning_rate=1e-2)
    full = markov_trainer(tiny_data, tmp_path / "full", **kw)
    full.train()
    resumed = markov_trainer(tiny_data, tmp_path / "resumed", **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for key, value in resumed.model.state_dict().items():
        assert torch.allclose(value, full.model.state_dict()[key], atol=1e-6), key
    other = markov_trainer(tiny_data, tmp_path / "other", **{**kw, "markov_learning_rate": None})
    if not muon:  # without the head's own rate the plain optimizer has one group fewer
        with pytest.raises(ValueError, match="other muon / markov_learning_rate / freeze_backbone settings"):
            other.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))


def test_muon_with_adamw_updates_a_parameter_once():
    """A parameter given both as a Muon candidate and in an AdamW group is on AdamW alone."""
    from dflash_hf.trainers.optimizers import MuonWithAdamW

    matrix, table = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(6, 4))
    optimizer = MuonWithAdamW([matrix, table], lr=0.1, adamw_groups=[{"params": [table], "lr": 0.01}])
    muon, adamw = optimizer._inner
    assert [p for group in muon.param_groups for p in group["params"]] == [matrix]
    assert [p for group in adamw.param_groups for p in group["params"]] == [table]
    assert adamw.param_groups[0]["lr"] == 0.01


def test_markov_loss_weight_mixes_backbone_and_corrected_losses(tiny_data, tmp_path):
    """`loss(w) = (1 - w) * loss(backbone logits) + w * loss(corrected logits)`; at w = 0 it is the loss of the same
    drafter without a head."""
    target, tokenizer, data = tiny_data
    trainer = markov_trainer(tiny_data, tmp_path / "head", model=make_drafter(target))  # the backbone, plus a head
    random_head(trainer.model, std=0.5)
    losses = {}
    for weight in (0.0, 0.5, 1.0):
        trainer.markov_loss_weight = weight
        losses[weight] = fixed_loss(trainer, data)
    assert losses[0.5] == pytest.approx(0.5 * losses[0.0] + 0.5 * losses[1.0], rel=1e-5)
    assert abs(losses[1.0] - losses[0.0]) > 0.1
    headless = DFlashTrainer(
        model=make_drafter(target),  # the same backbone (same seed), no head
        args=tiny_train_config(tmp_path / "plain"),
        target=target,
        train_dataset=data,
        processing_class=tokenizer,
    )
    assert fixed_loss(headless, data) == pytest.approx(losses[0.0], rel=1e-6)


def test_training_options_are_checked(tiny_data, tmp_path):
    with pytest.raises(ValueError, match="markov_gated describes a new Markov head"):
        tiny_train_config(tmp_path, markov_gated=True)
    with pytest.raises(ValueError, match="markov_loss_weight=0"):
        tiny_train_config(tmp_path, markov_rank=4, freeze_backbone=True, markov_loss_weight=0.0)
    with pytest.raises(ValueError, match="markov_loss_weight must be in"):
        tiny_train_config(tmp_path, markov_loss_weight=1.5)
    target, tokenizer, data = tiny_data
    with pytest.raises(ValueError, match="has none: add one with --markov_rank"):
        DFlashTrainer(
            args=tiny_train_config(tmp_path, freeze_backbone=True),
            target=target,
            train_dataset=data,
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match="markov_learning_rate must be > 0"):
        tiny_train_config(tmp_path, markov_rank=4, markov_learning_rate=0.0)
    with pytest.raises(ValueError, match="this drafter has none: add one with --markov_rank R or drop"):
        DFlashTrainer(
            args=tiny_train_config(tmp_path, markov_learning_rate=1e-3),
            target=target,
            train_dataset=data,
            processing_class=tokenizer,
        )
    headed = make_drafter(target, block_size=4, markov_rank=8)
    with pytest.raises(ValueError, match="asks for rank 16"):
        markov_trainer(tiny_data, tmp_path, model=headed)


def test_train_command_adds_a_head_to_a_drafter_and_records_it(tiny_data, tmp_path):
    """`dflash-hf train --drafter D --markov_rank R --freeze_backbone`: the exported drafter is D's backbone plus the
    trained head, and its card names the head and the loss."""
    from dflash_hf.cli import main as cli_main

    target, tokenizer, _ = tiny_data
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    run_make_data(target, tokenizer, tmp_path / "data", write_prompts(tmp_path / "p.jsonl"), max_new_tokens=12)
    backbone = make_drafter(target)
    backbone.save_pretrained(tmp_path / "drafter")
    argv = ["train", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data"), "--base_model", "org/t"]
    argv += ["--drafter", str(tmp_path / "drafter"), "--output_dir", str(tmp_path / "run"), "--block_size", "4"]
    argv += ["--markov_rank", "8", "--freeze_backbone", "true", "--max_steps", "2", "--num_anchors", "8"]
    argv += ["--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
    assert cli_main(argv) == 0
    final = DFlashDraftModel.from_pretrained(tmp_path / "run" / "final")
    assert (final.config.markov_rank, final.config.markov_gated) == (8, False)
    head = {k: v for k, v in final.state_dict().items() if k.startswith("markov_head.")}
    assert set(head) == MARKOV_TENSORS and head["markov_head.markov_w2.weight"].abs().sum() > 0  # trained
    assert all(torch.equal(v, final.state_dict()[k]) for k, v in backbone.state_dict().items())  # frozen
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    assert "`markov_head`: rank 8, vanilla" in card and "`freeze_backbone`: True" in card


# ---------------------------------------------------------------------------------------------------- layouts


def trained_pair(family: str = "llama", **kwargs):
    target = make_target(family)
    drafter = make_drafter(target, draft_vocab_size=24, markov_rank=8, **kwargs)
    drafter.set_draft_vocabulary(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:24])
    return target, random_head(drafter, std=0.5)


def assert_same_drafter(loaded: DFlashDraftModel, drafter: DFlashDraftModel) -> None:
    assert (loaded.config.markov_rank, loaded.config.markov_gated) == (
        drafter.config.markov_rank,
        drafter.config.markov_gated,
    )
    expected = drafter.state_dict()
    assert set(loaded.state_dict()) == set(expected)
    assert all(torch.equal(t, expected[name]) for name, t in loaded.state_dict().items())


@pytest.mark.parametrize("layout", ["dflash-hf", "official"])
@pytest.mark.parametrize("gated", [False, True])
def test_layouts_with_remote_code_carry_the_head(tmp_path, layout, gated):
    target, drafter = trained_pair(markov_gated=gated)
    folder = dflash_hf.export(drafter, tmp_path / layout, target=target, base_model=BASE_MODEL, format=layout)
    config = json.loads((folder / "config.json").read_text())
    if layout == "official":
        assert config["dflash_config"]["markov_rank"] == 8
        assert config["dflash_config"]["markov_head_type"] == ("gated" if gated else "vanilla")
        assert config["sample_from_anchor"] is False
    else:
        assert (config["markov_rank"], config["markov_gated"]) == (8, gated)
    names = set(load_file(folder / "model.safetensors"))
    assert MARKOV_TENSORS <= names and (GATE_TENSORS <= names) == gated
    assert_same_drafter(DFlashDraftModel.from_pretrained(folder), drafter)
    dflash_hf.validate_hub_folder(folder)


@pytest.mark.parametrize("gated", [False, True])
def test_speculators_layout_is_dspark(tmp_path, gated):
    """speculators' DSpark model: its type, fields, slot convention and head tensors (DeepSpec's names)."""
    target, drafter = trained_pair(markov_gated=gated)
    folder = dflash_hf.export(drafter, tmp_path / "spec", target=target, base_model=BASE_MODEL, format="speculators")
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkDraftModel"]
    assert config["speculators_config"]["algorithm"] == "dspark"
    assert config["markov_rank"] == 8 and config["markov_head_type"] == ("gated" if gated else "vanilla")
    assert config["sample_from_anchor"] is False and config["enable_confidence_head"] is False
    tensors = load_file(folder / "model.safetensors")
    assert tuple(tensors["markov_head.markov_w1.weight"].shape) == (VOCAB, 8)  # the verifier's vocabulary
    assert tuple(tensors["markov_head.markov_w2.weight"].shape) == (24, 8)  # the draft vocabulary
    for name, tensor in drafter.state_dict().items():
        if name.startswith("markov_head."):
            assert torch.equal(tensors[name], tensor), name
    back = config_from_speculators(config)
    assert (back.markov_rank, back.markov_gated) == (8, gated)
    dflash_hf.validate_hub_folder(folder)


def test_speculators_configs_of_another_slot_convention_are_refused(tmp_path):
    target, drafter = trained_pair()
    folder = dflash_hf.export(drafter, tmp_path / "spec", target=target, base_model=BASE_MODEL, format="speculators")
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="sample_from_anchor"):
        config_from_speculators({**config, "sample_from_anchor": True})
    with pytest.raises(ValueError, match="not supported"):
        config_from_speculators({**config, "markov_head_type": "rnn"})
    official = json.loads(
        (
            dflash_hf.export(drafter, tmp_path / "off", target=target, base_model=BASE_MODEL, format="official")
            / "config.json"
        ).read_text()
    )
    with pytest.raises(ValueError, match="sample_from_anchor: true"):
        DFlashConfig.from_dict({**official, "sample_from_anchor": True})
