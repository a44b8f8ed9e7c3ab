"""The DFlash loss of one batch (docs/design.md §3), as the methods [`DFlashTrainer`] mixes in ([`DFlashLossMixin`]):

1. context features: the frozen target's tapped hidden states (online: one `TargetAdapter.forward`; offline: read
   from a `dflash-hf cache-features` folder);
2. up to `num_anchors` random anchors per sequence among the response tokens with room for a whole block, and the
   blocks on them ([`DFlashLossMixin._prepare_blocks`]);
3. one drafter forward over all blocks of the batch: `[anchor, MASK * (B - 1)]` per block after the context, with
   the sparse mask (context strictly before the anchor + own block; blocks blind to each other) as a flex
   `BlockMask` on GPU or a dense boolean mask (SDPA) on CPU (`forward.draft_forward`);
4. same-position labels, target LM head on the labelled slots only (`loss_chunk_size` of them at a time, each chunk
   recomputed in the backward pass), cross-entropy weighted by `exp(-(k - 1) / gamma)` and normalised by the weight
   sum (`metrics.mixed_slot_losses`);
5. with a Markov head: the head's correction for each slot's true previous token (teacher forcing) added to those
   logits, each slot's loss mixed as `(1 - w) * CE(backbone logits) + w * CE(corrected logits)`
   (`markov_loss_weight`); `freeze_backbone` trains the head alone;
6. with a DFlash 2 candidate selector: plus `selector_loss_weight` times the selector's `K`-way cross-entropy over
   the slot's top-`K` draft logits given its true previous token (teacher forcing); a label outside the top `K`
   gives no selector loss. A slot counts as correct when the selector's choice is its label (greedy decoding's
   walk, teacher-forced), and the unary argmax and top-`K` recall are counted beside it.
"""

from __future__ import annotations

from functools import partial

import torch
from dflash_hf.modeling import DFlashDraftModel
from torch.utils.checkpoint import checkpoint

from dflash_hf.target.linear_attention import new_target_cache

from .config import DFlashTrainingConfig
from .forward import draft_forward, selector_scores, slot_logits, teacher_probs
from .masks import BlockBatch, build_blocks, sample_anchors
from .metrics import dpace_slot_weights, label_probabilities, mixed_slot_losses
from .slots import LabelledSlots


def _attention_mask(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's attention mask (all ones when the batch has none)."""
    mask = inputs.get("attention_mask")
    return torch.ones_like(inputs["input_ids"]) if mask is None else mask


class DFlashLossMixin:
    """The loss methods of [`DFlashTrainer`]. They read the frozen target through the trainer's `adapter`, the
    drafter's attention backend `attn_implementation`, and the settings [`_set_loss_settings`] copies from the
    drafter and the training config (attributes, so a subclass or a test may change them between batches)."""

    def _set_loss_settings(self, model: DFlashDraftModel, args: DFlashTrainingConfig) -> None:
        """What `dflash_loss` reads: the drafter's block size and mask id, the loss settings of `args`, and the maps
        between target and draft ids of a reduced draft vocabulary."""
        self.block_size = int(model.config.block_size)
        self.mask_token_id = int(model.config.mask_token_id)
        self.loss_decay_gamma = float(args.loss_decay_gamma)
        self.loss_weighting = args.loss_weighting
        self.num_anchors = int(args.num_anchors)
        self.distill_weight = float(args.distill_weight)
        self.tv_weight = float(args.tv_weight)
        self.hard_labels = args.hard_labels
        self.has_markov_head = model.markov_head is not None
        self.markov_loss_weight = float(args.markov_loss_weight)
        self.selector = model.candidate_selector  # DFlash 2, else None
        self.selector_loss_weight = float(args.selector_loss_weight)
        self.loss_chunk_size = int(args.loss_chunk_size or 0)  # `DFlashTrainer` sets the device's default
        draft_ids = model.draft_token_ids
        self.draft_token_ids = None if draft_ids is None else draft_ids.detach().clone()
        self.target_to_draft = None  # target id -> draft id, -100 (ignored) outside the draft vocabulary
        if self.draft_token_ids is not None:
            self.target_to_draft = torch.full((self.adapter.vocab_size,), -100, dtype=torch.long)
            self.target_to_draft[self.draft_token_ids] = torch.arange(self.draft_token_ids.numel())

    @torch.no_grad()
    def target_features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tapped target hidden states `(b, n, k * H)` and final normed hidden states `(b, n, H)` for a right-padded
        batch (online mode)."""
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        step = self.adapter.forward(input_ids, attention_mask, position_ids, new_target_cache(self.adapter.target))
        return step.context_hidden_states, step.last_hidden_state

    @property
    def _uses_teacher(self) -> bool:
        """Whether the loss needs the target's own next-token distribution (distillation, TV, target labels)."""
        return self.distill_weight > 0 or self.tv_weight > 0 or self.hard_labels == "target"

    def dflash_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        attn_implementation: str | None = None,
        anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weighted block loss of one batch and the statistics behind the metrics.

        `anchors=(anchors, anchor_valid)` overrides the random sampling (tests, reproducible evaluation).
        """
        context, teacher = self._features(inputs)
        blocks = self._prepare_blocks(inputs, model.training, anchors)
        implementation = attn_implementation or self.attn_implementation
        hidden, markov_bias = draft_forward(model, self.adapter, context, blocks, implementation, self.has_markov_head)
        slots = LabelledSlots.of(blocks.weights > 0)
        if len(slots) == 0:  # no sequence had room for a block: keep every parameter in the graph (DDP)
            zero = hidden.sum() * 0.0 + (0.0 if markov_bias is None else markov_bias.sum() * 0.0)
            return zero, {"correct": torch.zeros_like(slots.mask), "selected": slots.mask}
        loss, correct, unary = self._labelled_loss(hidden, markov_bias, blocks, teacher, slots)
        stats = {"correct": slots.spread(correct, False), "selected": slots.mask}
        if self.selector is not None:  # the unary argmax's hits and the top-K recall, beside the selector's
            stats.update(unary_correct=slots.spread(unary[:, 0], False), in_top_k=slots.spread(unary[:, 1], False))
        return loss, {**stats, "anchors": blocks.anchors, "anchor_valid": blocks.anchor_valid}

    def _features(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's context features and the target's final hidden states (`None` if not cached): cached (offline)
        or from the target (online)."""
        teacher = inputs.get("target_final_hidden")
        if "context_hidden_states" in inputs:
            context = inputs["context_hidden_states"]
        else:
            context, teacher = self.target_features(inputs["input_ids"], _attention_mask(inputs))
        if self._uses_teacher and teacher is None:
            raise ValueError(
                "distill_weight > 0, tv_weight > 0 and hard_labels='target' need the target's final hidden states "
                "(`target_final_hidden`): cache features with final hidden states or use features='online'."
            )
        return context, teacher

    def _prepare_blocks(
        self, inputs: dict[str, torch.Tensor], sample: bool, anchors: tuple[torch.Tensor, torch.Tensor] | None
    ) -> BlockBatch:
        """The batch's blocks: anchors (`anchors` where given; else up to `num_anchors` random ones per sequence
        when `sample`, every valid one otherwise), each block's input `[anchor, MASK * (B - 1)]`, positions,
        same-position labels and slot weights (`masks.build_blocks`)."""
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"]
        if anchors is None:  # training samples anchors; evaluation takes every valid one (deterministic)
            lengths = _attention_mask(inputs).sum(dim=1)
            count = self.num_anchors if sample else input_ids.shape[1]
            anchors = sample_anchors(loss_mask, lengths, self.block_size, count)
        anchor_ids, anchor_valid = anchors
        return build_blocks(
            input_ids, loss_mask, anchor_ids, anchor_valid, self.block_size, self.mask_token_id, self.loss_decay_gamma
        )

    def _labelled_loss(
        self,
        hidden: torch.Tensor,
        markov_bias: torch.Tensor | None,
        blocks: BlockBatch,
        teacher: torch.Tensor | None,
        slots: LabelledSlots,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's loss over its labelled `slots`, per slot whether the drafter's choice is its label, and
        (DFlash 2, else `(n, 0)`) whether the unary argmax is and whether the label is among the top `K`.

        The slots are scored `loss_chunk_size` at a time: the LM head's logits of one chunk (and the teacher's
        distribution there) live at once, and with several chunks each one is recomputed in the backward pass
        (activation checkpointing) instead of kept, so the loss's logits are a chunk's, not the batch's. Each chunk
        gives its slots' losses and their labels' probabilities; the weights (exp-decay's, or D-PACE's from those
        probabilities) then weigh the losses.
        """
        chunks = slots.chunks(self.loss_chunk_size)
        sizes = [len(index[0]) for index in chunks]
        parts = zip(
            chunks,
            slots.take(hidden).split(sizes),
            [None] * len(chunks) if markov_bias is None else slots.take(markov_bias).split(sizes),
        )
        recompute = len(chunks) > 1 and torch.is_grad_enabled()
        losses, probs, correct, unary = [], [], [], []
        for index, chunk_hidden, chunk_bias in parts:
            score = partial(self._chunk_losses, blocks=blocks, teacher=teacher, index=index)
            scored = (
                checkpoint(score, chunk_hidden, chunk_bias, use_reentrant=False, preserve_rng_state=False)
                if recompute
                else score(chunk_hidden, chunk_bias)
            )
            for out, part in zip((losses, probs, correct, unary), scored):
                out.append(part)
        weights = slots.take(blocks.weights)
        if self.loss_weighting == "dpace":
            weights = slots.take(dpace_slot_weights(slots.spread(torch.cat(probs)), slots.mask))
        loss = (torch.cat(losses) * weights).sum() / weights.sum()
        return loss, torch.cat(correct), torch.cat(unary)

    def _chunk_losses(
        self,
        hidden: torch.Tensor,
        markov_bias: torch.Tensor | None,
        *,
        blocks: BlockBatch,
        teacher: torch.Tensor | None,
        index: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the labelled slots at `index` (their final hidden states `hidden` and Markov biases `markov_bias`):
        each one's loss (`metrics.mixed_slot_losses`, plus the selector's with a DFlash 2 drafter), its label's
        probability (no gradient; D-PACE weighs by it, else empty), whether the drafter's choice is its label (the
        argmax, or the selector's) and, with a selector, whether the argmax is and whether the label is among the
        top `K` (`(n, 2)`, else `(n, 0)`)."""
        logits, labels, target_probs = self._slot_targets(hidden, blocks, teacher, index)
        # with a Markov head, the logits the engine drafts from (the metrics' too) are the corrected ones
        corrected = logits if markov_bias is None else logits + markov_bias.float()
        losses = mixed_slot_losses(
            corrected,
            labels,
            target_probs=target_probs,
            distill_weight=self.distill_weight,
            tv_weight=self.tv_weight,
            backbone_logits=None if markov_bias is None else logits,
            markov_loss_weight=self.markov_loss_weight,
        )
        dpace = self.loss_weighting == "dpace"
        probs = label_probabilities(corrected, labels) if dpace else losses.new_zeros(0).detach()
        argmax_correct = corrected.argmax(dim=-1) == labels
        if self.selector is None:
            return losses, probs, argmax_correct, argmax_correct.new_zeros(len(labels), 0)
        previous = blocks.previous_ids.view(blocks.labels.shape)[index]
        scores, candidates = selector_scores(self.selector, corrected, hidden, previous, self.draft_token_ids)
        gold = candidates == labels[:, None]
        in_top_k = gold.any(dim=-1)
        selector_losses = torch.nn.functional.cross_entropy(scores, gold.float().argmax(dim=-1), reduction="none")
        losses = losses + self.selector_loss_weight * torch.where(in_top_k, selector_losses, 0.0)
        chosen = candidates.gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
        return losses, probs, chosen == labels, torch.stack([argmax_correct, in_top_k], dim=-1)

    def _slot_targets(
        self, hidden: torch.Tensor, blocks: BlockBatch, teacher: torch.Tensor | None, index: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For the labelled slots' hidden states `hidden` (at `index`): the backbone's logits and their hard labels
        (`forward.slot_logits`), and the teacher's distribution where the loss uses it (`forward.teacher_probs`, else
        `None`)."""
        if self.draft_token_ids is not None:  # the draft vocabulary's maps follow the batch's device
            self.draft_token_ids = self.draft_token_ids.to(hidden.device)
            self.target_to_draft = self.target_to_draft.to(blocks.labels.device)
        labels = blocks.labels[index]
        logits, labels = slot_logits(self.adapter, hidden, labels, self.draft_token_ids, self.target_to_draft)
        if not self._uses_teacher:
            return logits, labels, None
        target_probs = teacher_probs(self.adapter, teacher, blocks.block_positions, index, self.draft_token_ids)
        if self.hard_labels == "target":
            labels = target_probs.argmax(dim=-1)
        return logits, labels, target_probs
