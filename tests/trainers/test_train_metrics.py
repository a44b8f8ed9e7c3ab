"""Loss weightings of DFlash training: the D-PACE slot weights as a pure function and inside the trainer's loss."""

from __future__ import annotations

import pytest
import torch
from dflash_hf.trainers import DFlashTrainer
from dflash_hf.trainers import metrics as metrics_module
from dflash_hf.trainers.metrics import dpace_slot_weights
from testing_utils import fixed_batch, one_thread, tiny_train_config


def test_dpace_weights_are_each_slots_effect_on_the_expected_accepted_length():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.5], [0.3, 0.9, 0.2, 0.9]], requires_grad=True)
    valid = torch.tensor([[False, True, True, True], [False, True, True, False]])
    weights = dpace_slot_weights(probs, valid)
    # E = a1 + a1 a2 + a1 a2 a3; dE/dlog a_k = sum over the prefixes through k
    assert torch.allclose(weights[0], torch.tensor([0.0, 0.5 + 0.25 + 0.125, 0.25 + 0.125, 0.125]))
    assert torch.allclose(weights[1], torch.tensor([0.0, 0.9 + 0.18, 0.18, 0.0]))  # an invalid slot ends the chain
    assert not weights.requires_grad
    # the same numbers as autograd's derivative of the expected accepted length
    log_a = probs.detach()[0, 1:].log().requires_grad_()
    expected = torch.cumprod(log_a.exp(), 0).sum()
    expected.backward()
    assert torch.allclose(weights[0, 1:], log_a.grad)


def test_dpace_weights_decrease_along_the_block_and_follow_confidence():
    valid = torch.ones(1, 6, dtype=torch.bool)
    valid[:, 0] = False
    unsure = dpace_slot_weights(torch.full((1, 6), 0.1), valid)[0, 1:]
    sure = dpace_slot_weights(torch.full((1, 6), 0.9), valid)[0, 1:]
    assert bool((unsure[1:] < unsure[:-1]).all()) and bool((sure[1:] < sure[:-1]).all())
    # relative to slot 1, later slots weigh more once the drafter is reliable
    assert bool((sure / sure[0] > unsure / unsure[0])[1:].all())


def test_loss_weighting_is_validated(tmp_path):
    with pytest.raises(ValueError, match="loss_weighting must be one of"):
        tiny_train_config(tmp_path, loss_weighting="linear")


def test_trainer_weights_the_loss_by_dpace(tiny_data, tmp_path, monkeypatch):
    """With `loss_weighting="dpace"` the loss is the cross-entropy weighted by D-PACE weights of the drafter's own
    label probabilities; with the default it is not."""
    target, tok, data = tiny_data
    with one_thread():
        trainer = DFlashTrainer(
            args=tiny_train_config(tmp_path, loss_weighting="dpace"), target=target, train_dataset=data,
            processing_class=tok,
        )  # fmt: skip
        seen = {}
        real = metrics_module.dpace_slot_weights

        def spy(label_probs, valid):
            seen["probs"], seen["valid"] = label_probs, valid
            seen["weights"] = real(label_probs, valid)
            return seen["weights"]

        monkeypatch.setattr("dflash_hf.trainers.loss.dpace_slot_weights", spy)
        batch, anchors = fixed_batch(trainer, data)
        trainer.model.eval()
        loss, stats = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        assert torch.equal(seen["valid"], stats["selected"])
        probs = seen["probs"][stats["selected"]]
        assert bool(((probs > 0) & (probs < 1)).all())  # the drafter's probabilities of the labels
        assert torch.isfinite(loss) and loss > 0
        trainer.loss_weighting = "exp_decay"
        decayed, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        assert not torch.isclose(loss, decayed)
