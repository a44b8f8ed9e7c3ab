"""Training DFlash 2 in `DFlashTrainer`: a warm start from a DFlash drafter that starts as an exact no-op, the
selector's teacher-forced K-way loss over the unary top-K, each block convolved alone, the selector's metrics."""

from __future__ import annotations

import pytest
import torch
from dflash_hf.trainers import DFlashTrainer
from testing_utils import fixed_batch, tiny_train_config

from dflash_hf import DFlashDraftModel

DFLASH2 = {"dflash2": True, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def trainer_for(tiny_data, output_dir, model=None, **overrides):
    target, tokenizer, data = tiny_data
    args = tiny_train_config(output_dir, **{**DFLASH2, "logging_steps": 100, **overrides})
    return DFlashTrainer(model=model, args=args, target=target, train_dataset=data, processing_class=tokenizer)


def batch_loss(trainer, data, model=None):
    batch, anchors = fixed_batch(trainer, data)
    model = trainer.model if model is None else model
    model.eval()
    with torch.no_grad():
        return trainer.dflash_loss(model, batch, anchors=anchors)


def test_warm_start_is_an_exact_no_op_then_trains(tiny_data, tmp_path):
    """A DFlash drafter given DFlash 2's parts scores the same DFlash loss and drafts the same; the selector's loss
    joins it; training moves the convolutions, the codebooks and the backbone and lowers the loss."""
    plain = trainer_for(tiny_data, tmp_path / "plain", dflash2=False)
    drafter = plain.model
    before = {name: p.detach().clone() for name, p in drafter.named_parameters()}
    warm = trainer_for(tiny_data, tmp_path / "warm", model=drafter, selector_loss_weight=0.0)
    assert warm.model is drafter and drafter.config.is_dflash2
    data = tiny_data[2]
    plain_loss, plain_stats = batch_loss(plain, data)
    warm_loss, warm_stats = batch_loss(warm, data)
    torch.testing.assert_close(warm_loss, plain_loss)
    assert torch.equal(warm_stats["correct"], plain_stats["correct"])  # a zero successor codebook: the argmax
    assert torch.equal(warm_stats["unary_correct"], warm_stats["correct"])
    for name, parameter in drafter.named_parameters():
        if name in before:
            assert torch.equal(parameter, before[name]), name
    joint = trainer_for(tiny_data, tmp_path / "joint", model=drafter, max_steps=20, learning_rate=1e-2)
    start, _ = batch_loss(joint, data)
    assert start > warm_loss  # the selector's cross-entropy is added
    snapshot = {name: p.detach().clone() for name, p in drafter.named_parameters()}
    joint.train()
    end, stats = batch_loss(joint, data)
    assert end < start - 0.5
    changed = {name for name, p in drafter.named_parameters() if not torch.equal(p, snapshot[name])}
    assert {
        "candidate_selector.successor_codebook.weight",
        "candidate_selector.predecessor_codebook.weight",
        "candidate_selector.hidden_projection.weight",
        "layers.0.attention_conv.base_kernel",
        "layers.1.mlp_conv.kernel_projection.weight",
        "fc.weight",
    } <= changed
    assert stats["in_top_k"].any()


def test_selector_loss_is_the_teacher_forced_k_way_cross_entropy(tiny_data, tmp_path):
    """The loss with the selector's weight 1 minus the loss with weight 0 is the weighted mean of each labelled slot's
    cross-entropy over its top-K candidates given its true previous token, zero where the label is not among them."""
    from dflash_hf.trainers.forward import draft_forward, slot_logits
    from dflash_hf.trainers.slots import LabelledSlots

    trainer = trainer_for(tiny_data, tmp_path)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "candidate_selector" in name:
                parameter.normal_(0.0, 0.5)
    batch, anchors = fixed_batch(trainer, tiny_data[2])
    trainer.model.eval()
    with torch.no_grad():
        with_selector, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        trainer.selector_loss_weight = 0.0
        without, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        context, _ = trainer._features(batch)
        blocks = trainer._prepare_blocks(batch, False, anchors)
        hidden, _ = draft_forward(trainer.model, trainer.adapter, context, blocks, trainer.attn_implementation)
        slots = LabelledSlots.of(blocks.weights > 0)
        logits, labels = slot_logits(trainer.adapter, slots.take(hidden), slots.take(blocks.labels))
        selector = trainer.model.candidate_selector
        previous = slots.take(blocks.previous_ids.view(blocks.labels.shape))
        expected = []
        for i in range(len(labels)):  # one slot at a time, from the definition
            unary, candidates = logits[i].topk(selector.top_k)
            term = selector.predecessor_codebook.weight[previous[i]] * selector.hidden_projection(slots.take(hidden)[i])
            scores = unary + selector.successor_codebook.weight[candidates] @ term
            gold = (candidates == labels[i]).nonzero()
            expected.append(-torch.log_softmax(scores, -1)[gold[0, 0]] if len(gold) else scores.new_zeros(()))
        weights = slots.take(blocks.weights)
        added = (torch.stack(expected) * weights).sum() / weights.sum()
    torch.testing.assert_close(with_selector - without, added, atol=1e-5, rtol=1e-4)


def test_blocks_are_convolved_alone(tiny_data, tmp_path):
    """In one forward over many blocks, a block's hidden states do not depend on the block before it."""
    trainer = trainer_for(tiny_data, tmp_path)
    drafter = trainer.model.eval()
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "conv" in name:
                parameter.normal_(0.0, 0.5)
    width, block = drafter.config.hidden_size, drafter.config.block_size
    noise = torch.randn(1, 2 * block, width)
    context = torch.randn(1, 5, drafter.fc.in_features)
    positions = torch.cat([torch.arange(5), torch.arange(5, 5 + block), torch.arange(5, 5 + block)])[None]
    blocks_seen_apart = torch.ones(1, 1, 2 * block, 5 + 2 * block, dtype=torch.bool)
    blocks_seen_apart[:, :, :block, 5 + block :] = False
    blocks_seen_apart[:, :, block:, 5 : 5 + block] = False
    with torch.no_grad():
        both = drafter(
            noise_embeds=noise,
            context_hidden_states=context,
            position_ids=positions,
            attention_mask=blocks_seen_apart,
            draft_block_size=block,
        ).last_hidden_state
        second = drafter(
            noise_embeds=noise[:, block:],
            context_hidden_states=context,
            position_ids=torch.cat([torch.arange(5), torch.arange(5, 5 + block)])[None],
        ).last_hidden_state
    torch.testing.assert_close(both[:, block:], second, atol=1e-5, rtol=1e-5)


def test_metrics_name_the_selector_and_the_unary_argmax(tiny_data, tmp_path):
    trainer = trainer_for(tiny_data, tmp_path, max_steps=1, eval_strategy="no")
    metrics = trainer.evaluate(tiny_data[2])
    assert {"eval_accuracy", "eval_unary_accuracy", "eval_unary_recall_at_k"} <= set(metrics)
    assert 0.0 <= metrics["eval_unary_accuracy"] <= metrics["eval_unary_recall_at_k"] <= 1.0


def test_saved_dflash2_drafter_loads_back(tiny_data, tmp_path):
    trainer = trainer_for(tiny_data, tmp_path, max_steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    again = DFlashDraftModel.from_pretrained(tmp_path / "final")
    assert again.config.is_dflash2 and again.config.selector_top_k == 4
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_dflash2_options_are_checked(tiny_data, tmp_path):
    with pytest.raises(ValueError, match="not a Markov head"):
        tiny_train_config(tmp_path, dflash2=True, markov_rank=8)
    with pytest.raises(ValueError, match="selector_loss_weight"):
        tiny_train_config(tmp_path, dflash2=True, selector_loss_weight=-1.0)
    with pytest.raises(ValueError, match="does not divide hidden_size"):
        trainer_for(tiny_data, tmp_path, conv_group_size=24)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("muon", [False, True])
def test_selector_learning_rate_drives_the_selector_alone(tiny_data, tmp_path, muon):
    """`selector_learning_rate`: the selector learns at that rate, the rest at `learning_rate`, on one schedule; with
    `muon` the selector is on AdamW (its codebooks are embedding tables) and the body's matrices on Muon."""
    trainer = trainer_for(tiny_data, tmp_path, muon=muon, max_steps=4, selector_learning_rate=1e-2, warmup_steps=0)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    rates = {names[id(p)]: group["lr"] for group in optimizer.param_groups for p in group["params"]}
    selector = {name for name in names.values() if name.startswith("candidate_selector.")}
    assert set(rates) == set(names.values()) and len(selector) == 3
    assert {rates[name] for name in selector} == {1e-2}
    assert {rate for name, rate in rates.items() if name not in selector} == {1e-3}
    if muon:
        on_muon = {names[id(p)] for group in optimizer._inner[0].param_groups for p in group["params"]}
        assert not on_muon & selector and "fc.weight" in on_muon


def test_selector_learning_rate_needs_a_selector(tiny_data, tmp_path):
    with pytest.raises(ValueError, match="selector_learning_rate is a DFlash 2 selector's"):
        trainer_for(tiny_data, tmp_path, dflash2=False, selector_learning_rate=1e-2)
    with pytest.raises(ValueError, match="selector_learning_rate must be > 0"):
        tiny_train_config(tmp_path, selector_learning_rate=0.0)
