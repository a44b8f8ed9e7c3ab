"""DFlashTrainer: frozen target, attention backends, offline features, checkpoints that resume the same run."""

from __future__ import annotations

import logging

import pytest
import torch
from dflash_hf.trainers import (
    DFlashDataCollator,
    DFlashTrainer,
    DFlashTrainingConfig,
)
from dflash_hf.trainers.masks import build_blocks
from safetensors.torch import load_file
from testing_utils import LOSS_OPTIONS, fixed_batch, host_reads, make_tiny_target, tiny_train_config

from dflash_hf.data.features import OfflineFeatureDataset, cache_features, read_index

pytestmark = pytest.mark.usefixtures("single_thread")


config = tiny_train_config


def test_only_drafter_trains_and_target_is_frozen(tiny_data, tmp_path):
    target, tok, data = tiny_data
    trainer = DFlashTrainer(args=config(tmp_path), target=target, train_dataset=data, processing_class=tok)
    assert not any(p.requires_grad for p in target.parameters())
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(not n.startswith(("embed", "lm_head")) for n in trained)
    emb = target.get_input_embeddings().weight.clone()
    head = target.get_output_embeddings().weight.clone()
    trainer.args.max_steps = 2
    trainer.train()
    assert torch.equal(emb, target.get_input_embeddings().weight)
    assert torch.equal(head, target.get_output_embeddings().weight)
    log = [e for e in trainer.state.log_history if "loss" in e][-1]
    for key in ("accuracy", "accuracy_slot_1", "accuracy_slot_3", "acceptance_length", "acceptance_length_blockwise"):
        assert key in log


def test_peft_adapted_target_stays_frozen(tiny_data, tmp_path):
    peft = pytest.importorskip("peft")
    target = make_tiny_target("llama", seed=3)
    lora = peft.get_peft_model(target, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    _, tok, data = tiny_data
    trainer = DFlashTrainer(args=config(tmp_path, max_steps=1), target=lora, train_dataset=data, processing_class=tok)
    assert not any(p.requires_grad for p in lora.parameters())
    trainer.train()
    assert trainer.state.global_step == 1


def test_flex_attention_matches_dense_sdpa(tiny_data, tmp_path):
    """Same loss from the flex BlockMask and the dense boolean SDPA mask. On CPU torch has no flex backward, so the
    comparison is forward-only here (a GPU run trains with flex)."""
    target, tok, data = tiny_data
    trainer = DFlashTrainer(args=config(tmp_path), target=target, train_dataset=data, processing_class=tok)
    batch, anchors = fixed_batch(trainer, data)
    with torch.no_grad():
        dense, _ = trainer.dflash_loss(trainer.model, batch, attn_implementation="sdpa", anchors=anchors)
        trainer._set_attention(trainer.model, "flex_attention")
        flex, _ = trainer.dflash_loss(trainer.model, batch, attn_implementation="flex_attention", anchors=anchors)
        trainer._set_attention(trainer.model, "eager")
        eager, _ = trainer.dflash_loss(trainer.model, batch, attn_implementation="eager", anchors=anchors)
    assert abs(dense.item() - flex.item()) < 1e-5
    assert abs(dense.item() - eager.item()) < 1e-5


def test_offline_features_match_online(tiny_data, tmp_path):
    target, tok, data = tiny_data
    trainer = DFlashTrainer(args=config(tmp_path / "on"), target=target, train_dataset=data, processing_class=tok)
    layer_ids = trainer.model.config.target_layer_ids
    feats = tmp_path / "features"
    cache_features(target, data, feats, layer_ids, batch_size=2, shard_bytes=1, progress=False)
    index = read_index(feats)
    assert len(index["shards"]) == (len(data) + 1) // 2 and index["dtype"] == "bfloat16"  # one batch per shard
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(feats / index["shards"][0]["file"])).values())
    offline = OfflineFeatureDataset(data, feats, layer_ids)
    batch, anchors = fixed_batch(trainer, data)
    off_batch = DFlashDataCollator(pad_token_id=0)([offline[i] for i in range(len(offline))])
    assert torch.equal(off_batch["input_ids"], batch["input_ids"])
    with torch.no_grad():
        online, _ = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
        cached, _ = trainer.dflash_loss(trainer.model, off_batch, anchors=anchors)
    assert abs(online.item() - cached.item()) < 2e-2 * max(1.0, online.item())
    # the trainer builds the offline dataset itself from features_dir
    off_trainer = DFlashTrainer(
        model=trainer.model,
        args=config(tmp_path / "off", features="offline", features_dir=str(feats), max_steps=1),
        target=target,
        train_dataset=data,
        processing_class=tok,
    )
    assert isinstance(off_trainer.train_dataset, OfflineFeatureDataset)
    off_trainer.train()
    with pytest.raises(ValueError, match="tap target layers"):
        OfflineFeatureDataset(data, feats, [0, 5])


def test_offline_features_of_several_data_folders(tiny_data, tmp_path):
    """`--data a,b --features_dir fa,fb`: each row reads its features from its own folder, in order."""
    target, _, data = tiny_data
    head, tail = data.select(range(3)), data.select(range(3, len(data)))
    cache_features(target, head, tmp_path / "fa", [1, 3], batch_size=2, shard_bytes=1, progress=False)
    cache_features(target, tail, tmp_path / "fb", [1, 3], batch_size=2, progress=False)
    both = OfflineFeatureDataset(data, f"{tmp_path / 'fa'},{tmp_path / 'fb'}", [1, 3])
    single = [OfflineFeatureDataset(head, tmp_path / "fa", [1, 3]), OfflineFeatureDataset(tail, tmp_path / "fb")]
    expected = [single[0][i] for i in range(len(head))] + [single[1][i] for i in range(len(tail))]
    assert len(both) == len(data) and both.has_final_hidden
    for row, want in enumerate(expected):
        got = both[row]
        assert got["input_ids"] == want["input_ids"] == data[row]["input_ids"]
        assert torch.equal(got["context_hidden_states"], want["context_hidden_states"])
        assert torch.equal(got["target_final_hidden"], want["target_final_hidden"])
    with pytest.raises(ValueError, match="one features folder per data folder"):
        OfflineFeatureDataset(data, tmp_path / "fa", [1, 3])


def test_cache_features_resumes(tiny_data, tmp_path, monkeypatch):
    target, _, data = tiny_data
    import dflash_hf.data.feature_shards as features

    calls = {"n": 0}
    real = features.save_file

    def dying_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(features, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        cache_features(target, data, tmp_path / "f", [1, 3], batch_size=1, shard_bytes=1, progress=False)
    assert len(read_index(tmp_path / "f")["shards"]) == 2
    # a run that reads only the rows cached so far can start (max_train_samples), one that reads more cannot
    partial = OfflineFeatureDataset(data, tmp_path / "f", [1, 3], rows_read=range(2))
    assert partial[1]["context_hidden_states"].shape[0] == len(data[1]["input_ids"])
    with pytest.raises(ValueError, match="cover its rows 0..1 .* reads rows 0..2"):
        OfflineFeatureDataset(data, tmp_path / "f", [1, 3], rows_read=range(3))
    with pytest.raises(ValueError, match="max_train_samples"):
        OfflineFeatureDataset(data, tmp_path / "f", [1, 3])
    monkeypatch.setattr(features, "save_file", real)
    index = cache_features(target, data, tmp_path / "f", [1, 3], batch_size=1, shard_bytes=1, progress=False)
    assert [s["start"] for s in index["shards"]] == list(range(len(data)))
    assert not list((tmp_path / "f").glob(".*tmp"))
    with pytest.raises(ValueError, match="target_layer_ids"):
        cache_features(target, data, tmp_path / "f", [0, 3], progress=False)


def test_cache_features_from_a_first_row(tiny_data, tmp_path):
    """`first_row` leaves the rows before it out; a run that skips them (skip_train_samples) trains on the folder."""
    target, tok, data = tiny_data
    same = dict(batch_size=2, progress=False)  # the same batches either way (padding changes the last digits)
    cache_features(target, data, tmp_path / "all", [1, 3], **same)
    reference = OfflineFeatureDataset(data, tmp_path / "all", [1, 3])
    index = cache_features(target, data, tmp_path / "f", [1, 3], shard_bytes=1, first_row=2, **same)
    assert index["first_row"] == 2 and index["shards"][0]["start"] == 2 and index["shards"][-1]["end"] == len(data)
    late = OfflineFeatureDataset(data, tmp_path / "f", [1, 3], rows_read=range(2, len(data)))
    for row in range(2, len(data)):
        assert torch.equal(late[row]["context_hidden_states"], reference[row]["context_hidden_states"])
        assert torch.equal(late[row]["target_final_hidden"], reference[row]["target_final_hidden"])
    with pytest.raises(ValueError, match=r"cover its rows 2\.\..* reads rows 1\.\..*--first-row no later"):
        OfflineFeatureDataset(data, tmp_path / "f", [1, 3], rows_read=range(1, len(data)))
    with pytest.raises(ValueError, match="first_row=.*not 0"):
        cache_features(target, data, tmp_path / "f", [1, 3], progress=False)  # resumed with another first row
    with pytest.raises(ValueError, match="first_row must be in"):
        cache_features(target, data, tmp_path / "g", [1, 3], first_row=len(data), progress=False)
    assert not (tmp_path / "g").exists()
    kw = dict(features="offline", features_dir=str(tmp_path / "f"), skip_train_samples=2, max_steps=1)
    run = config(tmp_path / "run", **kw)
    trainer = DFlashTrainer(args=run, target=target, train_dataset=data, processing_class=tok)
    assert list(trainer.train_dataset.indices) == list(range(2, len(data)))
    trainer.train()
    with pytest.raises(ValueError, match="--first-row no later than skip_train_samples"):
        DFlashTrainer(
            args=config(tmp_path / "run1", **{**kw, "skip_train_samples": 1}),
            target=target,
            train_dataset=data,
            processing_class=tok,
        )


def test_cache_features_extends_a_grown_dataset(tiny_data, tmp_path):
    """make-data appends rows when rerun with more samples: the stored shards are kept, only the new rows computed."""
    target, _, data = tiny_data
    feats = tmp_path / "f"
    head = data.select(range(len(data) - 2))
    first = cache_features(target, head, feats, [1, 3], batch_size=2, shard_bytes=1, progress=False)
    stored = {s["file"]: (feats / s["file"]).stat().st_mtime_ns for s in first["shards"]}
    index = cache_features(target, data, feats, [1, 3], batch_size=2, shard_bytes=1, progress=False)
    assert index["num_rows"] == len(data) and index["shards"][-1]["end"] == len(data)
    assert {f: (feats / f).stat().st_mtime_ns for f in stored} == stored  # not rewritten
    offline = OfflineFeatureDataset(data, feats, [1, 3])
    reference = tmp_path / "ref"
    cache_features(target, data, reference, [1, 3], batch_size=2, shard_bytes=1, progress=False)
    fresh = OfflineFeatureDataset(data, reference, [1, 3])
    assert all(
        torch.equal(offline[i]["context_hidden_states"], fresh[i]["context_hidden_states"]) for i in range(len(data))
    )
    # other rows in front (a different dataset) are refused, by fingerprint
    shuffled = data.select(list(range(1, len(data))) + [0])
    with pytest.raises(ValueError, match="made from other rows"):
        cache_features(target, shuffled, feats, [1, 3], progress=False)
    with pytest.raises(ValueError, match="made from another dataset"):
        cache_features(target, head, feats, [1, 3], progress=False)


def test_resume_continues_the_same_run(tiny_data, tmp_path):
    """Interrupted at step 2 and resumed = uninterrupted: same weights (optimizer, scheduler, RNG, step restored)."""
    target, tok, data = tiny_data
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=2)
    full = DFlashTrainer(args=config(tmp_path / "full", **kw), target=target, train_dataset=data, processing_class=tok)
    full.train()
    reference = {k: v.clone() for k, v in full.model.state_dict().items()}
    assert (tmp_path / "full" / "checkpoint-2" / "model.safetensors").is_file()
    assert (tmp_path / "full" / "checkpoint-2" / "optimizer.safetensors").is_file()  # no pickles
    assert not list((tmp_path / "full" / "checkpoint-2").glob("pytorch_model*"))  # weights: safetensors only

    torch.manual_seed(123)  # a different process state: everything must come from the checkpoint
    resumed = DFlashTrainer(
        args=config(tmp_path / "res", **kw), target=target, train_dataset=data, processing_class=tok
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for key, value in resumed.model.state_dict().items():
        assert torch.allclose(value, reference[key], atol=1e-6), key


def test_bad_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="features_dir"):
        DFlashTrainingConfig(output_dir=str(tmp_path), features="offline", use_cpu=True)
    with pytest.raises(ValueError, match="block_size"):
        DFlashTrainingConfig(output_dir=str(tmp_path), block_size=1, use_cpu=True)
    with pytest.raises(ValueError, match="features must be"):
        DFlashTrainingConfig(output_dir=str(tmp_path), features="cached", use_cpu=True)
    with pytest.raises(ValueError, match="target"):
        DFlashTrainer(args=DFlashTrainingConfig(output_dir=str(tmp_path), use_cpu=True))


def test_reduced_draft_vocabulary_from_response_tokens(tiny_data, tmp_path, caplog):
    from collections import Counter

    from dflash_hf.trainers.vocabulary import frequent_response_tokens

    target, tok, data = tiny_data
    counts = Counter(t for row in data for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    size = min(8, len(counts))
    caplog.set_level(logging.INFO, logger="dflash_hf")
    trainer = DFlashTrainer(
        args=config(tmp_path, draft_vocab_size=size), target=target, train_dataset=data, processing_class=tok
    )
    chosen = trainer.model.draft_token_ids.tolist()
    assert chosen == sorted(chosen) and len(chosen) == size
    left_out = [c for t, c in counts.items() if t not in chosen]
    assert not left_out or min(counts[t] for t in chosen) >= max(left_out)  # the most frequent response tokens
    # its coverage of the training response tokens is stated
    coverage = frequent_response_tokens(data, size, target.config.vocab_size).coverage
    assert coverage == pytest.approx(sum(counts[t] for t in chosen) / sum(counts.values()))
    assert (coverage < 1) == bool(left_out)
    assert trainer.draft_vocabulary_coverage == coverage and f"covering {coverage:.2%}" in caplog.text
    batch, anchors = fixed_batch(trainer, data)
    loss, stats = trainer.dflash_loss(trainer.model, batch, anchors=anchors)
    assert torch.isfinite(loss)
    # a label outside the draft vocabulary can never count as correct
    blocks = build_blocks(
        batch["input_ids"],
        batch["loss_mask"],
        anchors[0],
        anchors[1],
        trainer.block_size,
        trainer.mask_token_id,
        trainer.loss_decay_gamma,
    )
    outside = ~torch.isin(blocks.labels, trainer.draft_token_ids)
    assert not stats["correct"][stats["selected"] & outside].any()


# a training step's loss reads the device twice: the most anchors any row has room for (its blocks' count) and the
# places of the labelled slots (every gather and scatter of the loss, its D-PACE weights, the teacher's distribution and
# the accuracy statistics index by them); Transformers reads a right-padded batch's mask twice more in the target's
# online forward (to choose its attention kernel)
STEP_READS, PADDED_TARGET_FORWARD_READS = 2, 2


@pytest.mark.parametrize(
    "settings",
    [*LOSS_OPTIONS.values(), dict(loss_chunk_size=5, loss_weighting="dpace", distill_weight=0.5)],
    ids=[*LOSS_OPTIONS, "chunked"],
)
def test_a_training_step_reads_the_device_twice(tiny_data, tmp_path, monkeypatch, settings):
    """Counted on the loss and its backward of one right-padded batch with online features."""
    target, tok, data = tiny_data
    trainer = DFlashTrainer(args=config(tmp_path, **settings), target=target, train_dataset=data, processing_class=tok)
    batch = DFlashDataCollator(pad_token_id=0)([data[i] for i in range(len(data))])
    assert not batch["attention_mask"].all()
    trainer.model.train()
    with host_reads(monkeypatch) as reads, reads.counting():
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
    assert sum(reads.counts.values()) == STEP_READS + PADDED_TARGET_FORWARD_READS, reads.counts
    assert all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("markov", [False, True], ids=["drafter", "markov-head"])
def test_a_batch_without_room_for_a_block_is_a_zero_loss_that_reaches_every_parameter(tiny_data, tmp_path, markov):
    """No response token (an all-zero loss mask): the loss is zero and every trainable parameter, a Markov head's
    included, gets a gradient (zero), as DDP needs from every process."""
    target, tok, data = tiny_data
    settings = dict(markov_rank=4, markov_loss_weight=0.5) if markov else {}
    trainer = DFlashTrainer(args=config(tmp_path, **settings), target=target, train_dataset=data, processing_class=tok)
    batch = DFlashDataCollator(pad_token_id=0)([data[i] for i in range(3)])
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    assert loss.item() == 0.0
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and not p.grad.any() for p in trained)
