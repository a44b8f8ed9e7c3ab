"""`DFlashTrainer`: trains a DFlash drafter against a frozen target (docs/design.md §3).

Why `transformers.Trainer` and not a TRL trainer: no TRL trainer fits. `SFTTrainer` (the closest) assumes the
trained model is a causal LM that embeds its own inputs and computes its own logits from `labels`, and it prepares
text datasets (tokenising, packing) and wraps the *trained* model with PEFT. A DFlash drafter has no embedding and
no LM head: it is fed by a second, frozen model (the target: hidden-state features, embedding, LM head) and trained
on sparse random blocks with a custom mask. Subclassing `SFTTrainer` would mean overriding nearly all of it. So the
trainer subclasses `transformers.Trainer` and follows TRL's conventions: a `*Config` dataclass extending
`TrainingArguments` with the recipe's defaults ([`DFlashTrainingConfig`]), `processing_class`, a built-in data
collator, metrics accumulated per mode and merged into `log()`, `_tag_names` and a model card.

What it does per batch:

1. context features: the frozen target's tapped hidden states (online: one `TargetAdapter.forward`; offline: read
   from a `dflash-hf cache-features` folder);
2. up to `num_anchors` random anchors per sequence among the response tokens with room for a whole block;
3. one drafter forward over all blocks of the batch: `[anchor, MASK * (B - 1)]` per block after the context, with
   the sparse mask (context strictly before the anchor + own block; blocks blind to each other) as a flex
   `BlockMask` on GPU or a dense boolean mask (SDPA) on CPU;
4. same-position labels, target LM head on the labelled slots only, cross-entropy weighted by
   `exp(-(k - 1) / gamma)` and normalised by the weight sum;
5. with a Markov head: the head's correction for each slot's true previous token (teacher forcing) added to those
   logits, each slot's loss mixed as `(1 - w) * CE(backbone logits) + w * CE(corrected logits)`
   (`markov_loss_weight`); `freeze_backbone` trains the head alone.

Only the drafter is handed to the `Trainer` (optimised, checkpointed, wrapped for DDP); the target, its embedding
and its LM head stay frozen (a PEFT/LoRA-adapted target is frozen too, adapters included).

Logged metrics (train and eval, computed by `metrics.py`): `loss`, `accuracy` (all slots), `accuracy_slot_{k}` for
k = 1..B-1, `acceptance_length` (implied by the per-slot accuracies: `1 + sum_k prod_{i<=k} acc_i`) and
`acceptance_length_blockwise` (mean accepted prefix + 1 measured block by block, what greedy verification would
accept against the training data); evaluation also logs `acceptance_length_decoding` (greedy speculative decoding
replayed on each held-out response, blocks anchored where the previous one stopped: the tau a bench measures on such
text, lower than the blockwise mean because decoding anchors after rejections).

Checkpoints hold no pickles (the project's safetensors-only rule): the Trainer's optimizer, scheduler, scaler, RNG
and training-argument hooks are overridden to write safetensors + JSON, and resuming from a folder with pickle files
is refused (`PickleFreeCheckpoints` in `checkpointing.py`). Hence single-process or DDP training only (DeepSpeed and FSDP checkpoints are pickles).
"""

from __future__ import annotations

import torch
from dflash_hf.modeling import DFlashConfig, DFlashDraftModel
from transformers import PreTrainedModel, set_seed
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from dflash_hf import runtime
from dflash_hf.special_tokens import first_token_id
from dflash_hf.target.adapter import TargetAdapter

from .checkpointing import PickleFreeCheckpoints
from .collator import DFlashDataCollator
from .config import DFlashTrainingConfig
from .initialisation import initialise_from_target
from .masks import block_attention_mask, build_blocks, flex_block_mask, sample_anchors
from .metrics import batch_metric_sums, dpace_label_weights, metrics_from_sums, slot_losses, zero_metric_sums
from .optimizers import MuonWithAdamW, newton_schulz_float32_pays
from .vocabulary import frequent_response_tokens

logger = logging.get_logger(__name__)


def _resolve_attention(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "flex_attention" if device.type == "cuda" else "sdpa"
    return backend


def _resolve_drafter(
    model, args: DFlashTrainingConfig, target: PreTrainedModel, train_dataset, processing_class
) -> tuple[DFlashDraftModel, float | None]:
    """The drafter to train: loaded from a path (fp32 master weights whatever its saved dtype), or a new one built from
    the target (optionally initialised from its top layers, with a reduced draft vocabulary); checked against `args`.
    Also returns the new reduced vocabulary's coverage of the training response tokens (else `None`). Every random
    initialisation here (a new drafter, a new Markov head) follows `args.seed`."""
    set_seed(args.seed)  # the Trainer seeds only once it has the model: what is initialised here must follow it too
    coverage = None
    if isinstance(model, str):
        model = DFlashDraftModel.from_pretrained(model, dtype=torch.float32)
    if model is None:
        model = DFlashDraftModel(
            DFlashConfig.from_target(
                target.config,
                num_hidden_layers=args.num_draft_layers,
                block_size=args.block_size,
                num_target_features=args.num_target_features,
                mask_token_id=args.mask_token_id,
                target_layer_ids=args.target_layer_ids,
                tokenizer=processing_class,
                draft_vocab_size=args.draft_vocab_size,
                markov_rank=args.markov_rank or 0,
                markov_gated=args.markov_gated,
            )
        )
        if args.init_from_target:
            copied = initialise_from_target(model, target)
            logger.info(f"Drafter layers initialised from target layers {copied}.")
        if args.draft_vocab_size is not None:
            if train_dataset is None:
                raise ValueError("draft_vocab_size needs the training data to choose the most frequent tokens.")
            vocab_size = int(target.get_input_embeddings().weight.shape[0])
            vocabulary = frequent_response_tokens(train_dataset, args.draft_vocab_size, vocab_size)
            model.set_draft_vocabulary(vocabulary.token_ids)
            coverage = vocabulary.coverage
            logger.info(
                f"Draft vocabulary: the {args.draft_vocab_size} most frequent response tokens of {vocab_size}, "
                f"covering {vocabulary.coverage:.2%} of the training response tokens."
            )
    if not isinstance(model, DFlashDraftModel):
        raise ValueError(f"model must be a DFlashDraftModel (or a path to one), got {type(model).__name__}.")
    if int(model.config.block_size) != int(args.block_size):
        raise ValueError(
            f"The drafter was built for block_size {model.config.block_size} but the training config says "
            f"{args.block_size}: pass --block_size {model.config.block_size} (or start a new drafter)."
        )
    if args.target_layer_ids is not None and list(args.target_layer_ids) != list(model.config.target_layer_ids):
        raise ValueError(
            f"The drafter taps target layers {model.config.target_layer_ids} but the training config says "
            f"{args.target_layer_ids}: drop --target_layer_ids or start a new drafter."
        )
    _give_markov_head(model, args)
    return model, coverage


def _give_markov_head(model: DFlashDraftModel, args: DFlashTrainingConfig) -> None:
    """Add the Markov head `args` asks for to a drafter without one; refuse a drafter whose head differs."""
    if args.markov_rank is None:
        return
    wanted = (int(args.markov_rank), bool(args.markov_gated))
    if model.markov_head is None:
        model.add_markov_head(*wanted)
        logger.info(f"New Markov head of rank {wanted[0]} ({'gated' if wanted[1] else 'vanilla'}), starting at zero.")
    elif (int(model.config.markov_rank), bool(model.config.markov_gated)) != wanted:
        raise ValueError(
            f"The drafter has a Markov head of rank {model.config.markov_rank} (gated: {model.config.markov_gated}) but "
            f"the training config asks for rank {wanted[0]} (gated: {wanted[1]}): drop --markov_rank / --markov_gated "
            "to train the drafter's own head."
        )


def _freeze_backbone(model: DFlashDraftModel) -> None:
    """Leave only the Markov head trainable."""
    if model.markov_head is None:
        raise ValueError(
            "freeze_backbone trains only the Markov head, and this drafter has none: add one with --markov_rank R "
            "(DSpark uses 256)."
        )
    model.requires_grad_(False)
    model.markov_head.requires_grad_(True)


def _move_to_own_group(optimizer: torch.optim.Optimizer, parameter_ids: set[int], lr: float) -> None:
    """Before the first step: move the parameters `parameter_ids` names out of `optimizer`'s groups into groups of
    their own (same settings otherwise) at learning rate `lr`; groups left empty are dropped."""
    for group in list(optimizer.param_groups):
        moved = [p for p in group["params"] if id(p) in parameter_ids]
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in parameter_ids]
            optimizer.add_param_group({**group, "params": moved, "lr": lr})
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]


def _training_dataset(train_dataset, args: DFlashTrainingConfig, model: DFlashDraftModel):
    """The training rows as the trainer reads them: with cached features attached (offline), the first
    `skip_train_samples` left out and cut to `max_train_samples`."""
    if train_dataset is None:
        return None
    first = int(args.skip_train_samples)
    if first >= len(train_dataset):
        raise ValueError(
            f"skip_train_samples={first} leaves nothing of the {len(train_dataset)} training rows; lower it."
        )
    end = (
        len(train_dataset)
        if args.max_train_samples is None
        else min(first + int(args.max_train_samples), len(train_dataset))
    )
    if args.features == "offline":
        from dflash_hf.data.features import OfflineFeatureDataset

        if not isinstance(train_dataset, OfflineFeatureDataset):
            train_dataset = OfflineFeatureDataset(
                train_dataset, args.features_dir, model.config.target_layer_ids, rows_read=range(first, end)
            )
        if (float(args.distill_weight) > 0 or float(args.tv_weight) > 0 or args.hard_labels == "target") and not (
            train_dataset.has_final_hidden
        ):
            uses = [f"{name}={getattr(args, name)}" for name in ("distill_weight", "tv_weight") if getattr(args, name)]
            uses += ["hard_labels='target'"] if args.hard_labels == "target" else []
            raise ValueError(
                f"{' and '.join(uses)} need(s) the target's final hidden states, but the features in "
                f"{args.features_dir} were cached without them: recache with `dflash-hf cache-features` (without "
                "--no-final-hidden), use features='online', or set them to 0 / 'data'."
            )
    if (first, end) != (0, len(train_dataset)):
        train_dataset = torch.utils.data.Subset(train_dataset, range(first, end))
    return train_dataset


def _warn_if_bf16_is_emulated(args: DFlashTrainingConfig) -> None:
    """bf16 autocast on a CPU without native bfloat16 trains, but every bf16 matmul is emulated: say so."""
    if args.bf16 and args.device.type == "cpu" and runtime.native_bf16_feature() is None:
        logger.warning(
            "bf16=True on a CPU without native bfloat16 (no AMX / AVX512-BF16): autocast emulates every bf16 "
            "matmul, about 8x slower than float32 (a SmolLM2 drafter step 3.3 s -> 25 s on an AVX2 EPYC); "
            "train with bf16=False on this machine."
        )


class DFlashTrainer(PickleFreeCheckpoints):
    """Trainer of a DFlash drafter against a frozen target; see the module docstring.

    Args:
        model (`DFlashDraftModel` or `str`, *optional*): The drafter to train, or a path/repo to load it from. When
            omitted, a new drafter is built from the target (`DFlashConfig.from_target` with the config's
            `num_draft_layers`, `block_size`, `target_layer_ids`/`num_target_features`, `mask_token_id`).
        args ([`DFlashTrainingConfig`]): Training configuration.
        target (`PreTrainedModel`): The frozen target (optionally PEFT-adapted). Supplies features (online), the
            shared embedding and the LM head.
        train_dataset / eval_dataset: Rows with `input_ids` and `loss_mask` (a `dflash-hf make-data` dataset), or,
            with `features="offline"`, a dataset whose rows also carry `context_hidden_states` (see
            `dflash_hf.data.features.OfflineFeatureDataset`, built automatically from `features_dir`).
        processing_class: The target's tokenizer (for the pad id, the default mask id and the model card).

    Attributes:
        draft_vocabulary_coverage (`float` or `None`): For a new drafter with `draft_vocab_size`, the share of the
            training response tokens inside its draft vocabulary (also logged, and written to the model card).
    """

    _tag_names = ["dflash", "dflash-hf", "speculative-decoding"]
    _name = "DFlash"

    def __init__(
        self,
        model: DFlashDraftModel | str | None = None,
        args: DFlashTrainingConfig | None = None,
        target: PreTrainedModel | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        data_collator=None,
        callbacks=None,
        optimizers=(None, None),
        **kwargs,
    ) -> None:
        if args is None:
            args = DFlashTrainingConfig(output_dir="dflash-drafter")
        elif not isinstance(args, DFlashTrainingConfig):
            raise ValueError(
                f"args must be a DFlashTrainingConfig, got {type(args).__name__}: build it with "
                "`DFlashTrainingConfig(output_dir=..., ...)`."
            )
        # resolves, in order, what `Trainer.__init__` needs first: drafter, target, datasets, collator
        if target is None:
            raise ValueError(
                "DFlashTrainer needs the frozen `target` model: the drafter is conditioned on its hidden states and "
                "shares its embedding and LM head."
            )
        model, self.draft_vocabulary_coverage = _resolve_drafter(model, args, target, train_dataset, processing_class)

        self.target = target
        self.target.requires_grad_(False)
        self.target.eval()
        self.adapter = TargetAdapter.for_drafter(target, model)
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
        if args.freeze_backbone:
            _freeze_backbone(model)
        if args.markov_learning_rate is not None and not self.has_markov_head:
            raise ValueError(
                "markov_learning_rate is the Markov head's learning rate, and this drafter has none: add one with "
                "--markov_rank R or drop --markov_learning_rate."
            )
        draft_ids = model.draft_token_ids
        self.draft_token_ids = None if draft_ids is None else draft_ids.detach().clone()
        if self.draft_token_ids is not None:  # target id -> draft id, -100 (ignored) outside the draft vocabulary
            self.target_to_draft = torch.full((self.adapter.vocab_size,), -100, dtype=torch.long)
            self.target_to_draft[self.draft_token_ids] = torch.arange(self.draft_token_ids.numel())

        train_dataset = _training_dataset(train_dataset, args, model)
        if data_collator is None:
            pad_id = first_token_id(
                getattr(processing_class, "pad_token_id", None), getattr(processing_class, "eos_token_id", None)
            )
            data_collator = DFlashDataCollator(pad_token_id=pad_id or 0, max_length=args.max_length)

        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            data_collator=data_collator,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "DFlashTrainer writes pickle-free checkpoints for single-process and DDP training only (DeepSpeed and "
                "FSDP checkpoints are pickles); the drafter is small, train it with DDP (`accelerate launch "
                "--num_processes N` without a DeepSpeed/FSDP config)."
            )
        # The loss is already a weighted mean over the batch; let the Trainer divide by the accumulation steps.
        self.model_accepts_loss_kwargs = False
        _warn_if_bf16_is_emulated(self.args)
        self.attn_implementation = _resolve_attention(args.attention_backend, self.args.device)
        self._set_attention(self.model, self.attn_implementation)
        if args.early_stopping_patience:
            from transformers import EarlyStoppingCallback

            self.add_callback(EarlyStoppingCallback(early_stopping_patience=int(args.early_stopping_patience)))
        if self.target.device != self.args.device and not getattr(self.target, "hf_device_map", None):
            self.target.to(self.args.device)
        self._metric_sums = {mode: zero_metric_sums(self.block_size, self.args.device) for mode in ("train", "eval")}

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _set_attention(model: PreTrainedModel, implementation: str) -> None:
        """Switch the drafter's attention backend (Transformers checks that the backend is available)."""
        model.set_attn_implementation(implementation)

    @torch.no_grad()
    def target_features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tapped target hidden states `(b, n, k * H)` and final normed hidden states `(b, n, H)` for a right-padded
        batch (online mode)."""
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        step = self.adapter.forward(input_ids, attention_mask, position_ids, DynamicCache())
        return step.context_hidden_states, step.last_hidden_state

    def create_optimizer(self, model=None):
        """The Trainer's optimizer (AdamW by default), or with `muon=True` Muon for the backbone's 2-D weight matrices
        and AdamW for the rest; a Markov head is on AdamW under `muon`, at `markov_learning_rate` where given."""
        if self.optimizer is not None:
            return self.optimizer
        head = {} if self.model.markov_head is None else dict(self.model.markov_head.named_parameters("markov_head"))
        head_ids = {id(p) for p in head.values()}
        head_lr = self.args.markov_learning_rate or self.args.learning_rate
        backbone = [p for p in self.model.parameters() if p.requires_grad and id(p) not in head_ids]
        if self.args.muon and any(p.ndim == 2 for p in backbone):
            decay = self.get_decay_parameter_names(self.model)
            self.optimizer = MuonWithAdamW(
                backbone,
                lr=self.args.learning_rate,
                weight_decay=self.args.weight_decay,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
                newton_schulz_float32=newton_schulz_float32_pays(self.args.device),
                adamw_groups=[  # the Trainer's decay split, at the head's rate
                    {"params": [p for name, p in head.items() if name in decay], "lr": head_lr},
                    {
                        "params": [p for name, p in head.items() if name not in decay],
                        "lr": head_lr,
                        "weight_decay": 0.0,
                    },
                ],
            )
            return self.optimizer
        super().create_optimizer(model) if model is not None else super().create_optimizer()
        if head_lr != self.args.learning_rate:
            _move_to_own_group(self.optimizer, head_ids, head_lr)
        return self.optimizer

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
        # one pass in the recipe's order (features, anchors, blocks, drafter forward, loss, statistics): each step's
        # tensors feed the next, so helpers would take and return most of them
        input_ids = inputs["input_ids"]
        loss_mask = inputs["loss_mask"]
        attention_mask = inputs.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        lengths = attention_mask.sum(dim=1)
        teacher = inputs.get("target_final_hidden")
        if "context_hidden_states" in inputs:
            context = inputs["context_hidden_states"]
        else:
            context, teacher = self.target_features(input_ids, attention_mask)
        uses_teacher = self.distill_weight > 0 or self.tv_weight > 0 or self.hard_labels == "target"
        if uses_teacher and teacher is None:
            raise ValueError(
                "distill_weight > 0, tv_weight > 0 and hard_labels='target' need the target's final hidden states "
                "(`target_final_hidden`): cache features with final hidden states or use features='online'."
            )
        batch, seq = input_ids.shape
        block = self.block_size
        if anchors is None:
            # Training samples up to num_anchors random anchors; evaluation takes every valid anchor (deterministic).
            anchors = sample_anchors(loss_mask, lengths, block, self.num_anchors if model.training else seq)
        anchor_ids, anchor_valid = anchors
        blocks = build_blocks(
            input_ids, loss_mask, anchor_ids, anchor_valid, block, self.mask_token_id, self.loss_decay_gamma
        )
        num = anchor_ids.shape[1]
        with torch.no_grad():
            noise_embeds = self.adapter.embed(blocks.block_ids)
        implementation = attn_implementation or self.attn_implementation
        if implementation == "flex_attention":
            mask = flex_block_mask(anchor_ids, anchor_valid, seq, block)
        else:
            mask = block_attention_mask(anchor_ids, anchor_valid, seq, block)
        markov_inputs = {"previous_token_ids": blocks.previous_ids} if self.has_markov_head else {}
        output = model(
            noise_embeds=noise_embeds,
            context_hidden_states=context,
            position_ids=blocks.position_ids,
            attention_mask=mask,
            **markov_inputs,
        )
        hidden = output.last_hidden_state.view(batch, num, block, -1)
        selected = blocks.weights > 0
        weights = blocks.weights[selected]
        if weights.numel() == 0:  # no sequence had room for a block: keep every parameter in the graph (DDP)
            loss = hidden.sum() * 0.0
            stats = {"correct": torch.zeros_like(blocks.weights, dtype=torch.bool), "selected": selected}
            return loss, stats
        labels = blocks.labels[selected]
        if self.draft_token_ids is None:
            logits = self.adapter.logits(hidden[selected])
        else:  # reduced draft vocabulary: labels outside it cannot be drafted and count as misses
            self.draft_token_ids = self.draft_token_ids.to(hidden.device)
            self.target_to_draft = self.target_to_draft.to(labels.device)
            logits = self.adapter.logits(hidden[selected], self.draft_token_ids)
            labels = self.target_to_draft[labels]
        target_probs = None
        if uses_teacher:
            target_probs = self._teacher_probs(teacher, blocks.position_ids[:, seq:].view(batch, num, block), selected)
            if self.hard_labels == "target":
                labels = target_probs.argmax(dim=-1)
        base_logits = logits
        if self.has_markov_head:  # from here on the logits the engine drafts from (the metrics' too)
            logits = logits + output.markov_bias.view(batch, num, block, -1)[selected].float()
        ce = slot_losses(logits, labels, target_probs, self.distill_weight, self.tv_weight)
        if self.has_markov_head and self.markov_loss_weight < 1.0:
            w = self.markov_loss_weight
            base = slot_losses(base_logits, labels, target_probs, self.distill_weight, self.tv_weight)
            ce = w * ce + (1.0 - w) * base
        if self.loss_weighting == "dpace":
            weights = dpace_label_weights(logits, labels, selected)
        loss = (ce * weights).sum() / weights.sum()
        correct = torch.zeros_like(selected)
        correct[selected] = logits.argmax(dim=-1) == labels
        return loss, {"correct": correct, "selected": selected, "anchors": anchor_ids, "anchor_valid": anchor_valid}

    def _teacher_probs(self, teacher: torch.Tensor, positions: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """The target's own next-token distribution for each labelled slot (the distillation teacher): its final hidden
        state one position earlier, through the frozen LM head (over the draft vocabulary, renormalised there)."""
        source = (positions - 1).clamp_min(0)[selected]  # slot at position p is predicted from the target at p - 1
        rows = selected.nonzero()[:, 0]
        with torch.no_grad():
            hidden = teacher[rows, source].to(self.adapter.lm_head.weight.dtype)
            draft_ids = None if self.draft_token_ids is None else self.draft_token_ids.to(hidden.device)
            return self.adapter.logits(hidden, draft_ids).float().softmax(dim=-1)

    def _accumulate(self, mode: str, stats: dict[str, torch.Tensor]) -> None:
        """Add one batch's statistics to the running sums of `mode` (evaluation, which takes every valid anchor, also
        replays decoding)."""
        sums = self._metric_sums[mode]
        for key, value in batch_metric_sums(stats, replay_decoding=mode == "eval").items():
            sums[key] += value

    # ---------------------------------------------------------------- Trainer hooks
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, stats = self.dflash_loss(model, inputs)
        mode = "train" if model.training else "eval"
        self._accumulate(mode, stats)
        return (loss, stats) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's loop, with the acceptance metrics in the returned metrics (so `metric_for_best_model` and
        early stopping can use them)."""
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        output.metrics.update({f"{prefix}_{key}": value for key, value in self._metrics("eval").items()})
        return output

    def _metrics(self, mode: str) -> dict[str, float]:
        """The metrics of `mode` since its last log, summed over every process; its sums start again from zero."""
        reduced = {k: self.accelerator.reduce(v.clone(), reduction="sum") for k, v in self._metric_sums[mode].items()}
        self._metric_sums[mode] = zero_metric_sums(self.block_size, self.args.device)
        return metrics_from_sums(reduced)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        metrics = self._metrics(mode)
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        if "loss" in logs or "eval_loss" in logs:
            logs = {**logs, **metrics}
        super().log(logs, start_time)

    def create_model_card(self, *args, **kwargs) -> None:
        """Model cards of trained drafters are written by `dflash_hf.export` (see `dflash-hf train`)."""
        return None
