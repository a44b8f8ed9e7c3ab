"""`DFlashTrainer`: trains a DFlash drafter against a frozen target (docs/design.md §3).

Why `transformers.Trainer` and not a TRL trainer: no TRL trainer fits. `SFTTrainer` (the closest) assumes the
trained model is a causal LM that embeds its own inputs and computes its own logits from `labels`, and it prepares
text datasets (tokenising, packing) and wraps the *trained* model with PEFT. A DFlash drafter has no embedding and
no LM head: it is fed by a second, frozen model (the target: hidden-state features, embedding, LM head) and trained
on sparse random blocks with a custom mask. Subclassing `SFTTrainer` would mean overriding nearly all of it. So the
trainer subclasses `transformers.Trainer` and follows TRL's conventions: a `*Config` dataclass extending
`TrainingArguments` with the recipe's defaults ([`DFlashTrainingConfig`]), `processing_class`, the model and the
training rows prepared before `Trainer.__init__` (`_prepare_model`, `_prepare_dataset`), a built-in data collator,
metrics accumulated per mode and merged into the logs, `_tag_names` and a model card.

Per batch (`loss.py`, [`DFlashLossMixin`]): the target's features, random blocks on the response tokens, one drafter
forward over all of them with a sparse mask, and their weighted loss on the target's LM head.

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
is refused (`PickleFreeCheckpoints` in `checkpointing.py`). Hence single-process or DDP training only (DeepSpeed and
FSDP checkpoints are pickles).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
from dflash_hf.modeling import DFlashDraftModel
from dflash_hf.modeling.configuration_dflash import markov_head_type
from transformers import EarlyStoppingCallback, PreTrainedModel
from transformers.trainer_utils import EvalLoopOutput, TrainOutput
from transformers.utils import logging

from dflash_hf import runtime
from dflash_hf.target.adapter import TargetAdapter

from .checkpointing import PickleFreeCheckpoints
from .collator import DFlashDataCollator
from .config import DFlashTrainingConfig
from .drafter import freeze_backbone, resolve_drafter
from .loss import DFlashLossMixin
from .metrics import batch_metric_sums, metrics_from_sums, zero_metric_sums
from .optimizers import MuonWithAdamW, build_optimizer
from .throughput import ThroughputCallback
from .time_limit import TimeLimitCallback

logger = logging.get_logger(__name__)


def _resolve_attention(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "flex_attention" if device.type == "cuda" else "sdpa"
    return backend


LOSS_CHUNK_LOGITS = 2**28  # the most logits a loss chunk holds on a GPU by default (1 GiB in float32)


def _resolve_loss_chunk(size: int | None, device: torch.device, vocabulary: int) -> int:
    """`loss_chunk_size` on `device`: as given, else chunks of at most [`LOSS_CHUNK_LOGITS`] logits over
    `vocabulary` on a GPU and every slot at once (0) on CPU, where memory is rarely short and recomputing costs."""
    if size is not None:
        return int(size)
    return max(1, LOSS_CHUNK_LOGITS // vocabulary) if device.type == "cuda" else 0


def _warn_if_bf16_is_emulated(args: DFlashTrainingConfig) -> None:
    """bf16 autocast on a CPU without native bfloat16 trains, but every bf16 matmul is emulated: say so."""
    if args.bf16 and args.device.type == "cpu" and runtime.native_bf16_feature() is None:
        logger.warning(
            "bf16=True on a CPU without native bfloat16 (no AMX / AVX512-BF16): autocast emulates every bf16 "
            "matmul, about 8x slower than float32 (a SmolLM2 drafter step 3.3 s -> 25 s on an AVX2 EPYC); "
            "train with bf16=False on this machine."
        )


class DFlashTrainer(DFlashLossMixin, PickleFreeCheckpoints):
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
        time_limit (`TimeLimitCallback` or `None`): With `max_train_seconds`, the callback that ends the run in time
            (`time_limit.stopped_early` tells whether it did).
        throughput (`ThroughputCallback`): Times the steps after a run's first, evaluations and saves left out
            ([`warm_throughput`]).
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
        if target is None:
            raise ValueError(
                "DFlashTrainer needs the frozen `target` model: the drafter is conditioned on its hidden states and "
                "shares its embedding and LM head."
            )
        model = self._prepare_model(model, args, target, train_dataset, processing_class)
        self._set_loss_settings(model, args)
        train_dataset = self._prepare_dataset(train_dataset, args, model)
        if data_collator is None:
            data_collator = DFlashDataCollator.for_tokenizer(processing_class, args.max_length)
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
        self._prepare_device(args)
        if args.early_stopping_patience:
            self.add_callback(EarlyStoppingCallback(early_stopping_patience=int(args.early_stopping_patience)))
        self.time_limit = None if args.max_train_seconds is None else TimeLimitCallback(float(args.max_train_seconds))
        if self.time_limit is not None:
            self.add_callback(self.time_limit)
        self._mode = "train"  # whose sums the statistics go to: "eval" while `_evaluating`
        self._metric_sums = {mode: zero_metric_sums(self.block_size, self.args.device) for mode in ("train", "eval")}
        self._trained_blocks = torch.zeros((), dtype=torch.float64, device=self.args.device)
        self._trained_rows = 0
        self.throughput = ThroughputCallback(lambda: (self._trained_blocks, self._trained_rows))
        self.add_callback(self.throughput)

    # ---------------------------------------------------------------- preparation (before `Trainer.__init__`)
    def _prepare_model(
        self,
        model: DFlashDraftModel | str | None,
        args: DFlashTrainingConfig,
        target: PreTrainedModel,
        train_dataset,
        processing_class,
    ) -> DFlashDraftModel:
        """The drafter to train (`drafter.resolve_drafter`), checked against the target, which is frozen
        (`self.target`, read through `self.adapter`); with `freeze_backbone` only its Markov head trains. Sets
        `draft_vocabulary_coverage`."""
        model, self.draft_vocabulary_coverage = resolve_drafter(model, args, target, train_dataset, processing_class)
        self.target = target
        self.target.requires_grad_(False)
        self.target.eval()
        self.adapter = TargetAdapter.for_drafter(target, model)
        if args.freeze_backbone:
            freeze_backbone(model)
        if args.selector_learning_rate is not None and model.candidate_selector is None:
            raise ValueError(
                "selector_learning_rate is a DFlash 2 selector's learning rate, and this drafter has none: make it a "
                "DFlash 2 drafter with --dflash2 or drop --selector_learning_rate."
            )
        if args.markov_learning_rate is not None and model.markov_head is None:
            raise ValueError(
                "markov_learning_rate is the Markov head's learning rate, and this drafter has none: add one with "
                "--markov_rank R or drop --markov_learning_rate."
            )
        return model

    def _prepare_dataset(self, dataset, args: DFlashTrainingConfig, model: DFlashDraftModel):
        """The training rows as the trainer reads them: with cached features attached (offline), the first
        `skip_train_samples` left out and cut to `max_train_samples`."""
        if dataset is None:
            return None
        first = int(args.skip_train_samples)
        if first >= len(dataset):
            raise ValueError(
                f"skip_train_samples={first} leaves nothing of the {len(dataset)} training rows; lower it."
            )
        end = len(dataset) if args.max_train_samples is None else min(first + int(args.max_train_samples), len(dataset))
        if args.features == "offline":
            from dflash_hf.data.features import OfflineFeatureDataset

            if not isinstance(dataset, OfflineFeatureDataset):
                dataset = OfflineFeatureDataset(
                    dataset, args.features_dir, model.config.target_layer_ids, rows_read=range(first, end)
                )
            if self._uses_teacher and not dataset.has_final_hidden:
                uses = [
                    f"{name}={getattr(args, name)}" for name in ("distill_weight", "tv_weight") if getattr(args, name)
                ]
                uses += ["hard_labels='target'"] if args.hard_labels == "target" else []
                raise ValueError(
                    f"{' and '.join(uses)} need(s) the target's final hidden states, but the features in "
                    f"{args.features_dir} were cached without them: recache with `dflash-hf cache-features` (without "
                    "--no-final-hidden), use features='online', or set them to 0 / 'data'."
                )
        if (first, end) != (0, len(dataset)):
            dataset = torch.utils.data.Subset(dataset, range(first, end))
        return dataset

    def _prepare_device(self, args: DFlashTrainingConfig) -> None:
        """Once the Trainer knows the device: the drafter's attention backend and the loss's chunk size there, the
        target moved there (unless it is dispatched over devices), and a warning where bf16 is emulated."""
        _warn_if_bf16_is_emulated(self.args)
        self.attn_implementation = _resolve_attention(args.attention_backend, self.args.device)
        scored = self.adapter.vocab_size if self.draft_token_ids is None else self.draft_token_ids.numel()
        self.loss_chunk_size = _resolve_loss_chunk(args.loss_chunk_size, self.args.device, scored)
        self._set_attention(self.model, self.attn_implementation)
        if self.target.device != self.args.device and not getattr(self.target, "hf_device_map", None):
            self.target.to(self.args.device)

    @staticmethod
    def _set_attention(model: PreTrainedModel, implementation: str) -> None:
        """Switch the drafter's attention backend (Transformers checks that the backend is available)."""
        model.set_attn_implementation(implementation)

    # ---------------------------------------------------------------- metrics
    def _accumulate(self, mode: str, stats: dict[str, torch.Tensor]) -> None:
        """Add one batch's statistics to the running sums of `mode` (evaluation, which takes every valid anchor, also
        replays decoding)."""
        sums = self._metric_sums[mode]
        if mode == "train":
            self._trained_rows += stats["selected"].shape[0]
        for key, value in batch_metric_sums(stats, replay_decoding=mode == "eval").items():
            sums[key] += value
            if key == "blocks" and mode == "train":
                self._trained_blocks += value

    @property
    def anchor_blocks_trained(self) -> int:
        """Blocks (valid anchors) this trainer's training steps have trained on, over every process: the unit of the
        training throughput (`anchor_blocks_per_second` in `dflash-hf train`'s summary). Read from the device once."""
        return int(self.accelerator.reduce(self._trained_blocks.clone(), reduction="sum"))

    def warm_throughput(self) -> dict[str, float | None]:
        """The rate of the last run's steps after its first, evaluations and checkpoint saves left out
        (`ThroughputCallback`), over every process: `anchor_blocks_per_second_warm` and `samples_per_second_warm`
        (`None` for a run of one step)."""
        return self.throughput.warm_rates(lambda total: self.accelerator.reduce(total, reduction="sum"))

    def _metrics(self, mode: str) -> dict[str, float]:
        """The metrics of `mode` since its last log, summed over every process; its sums start again from zero."""
        reduced = {k: self.accelerator.reduce(v.clone(), reduction="sum") for k, v in self._metric_sums[mode].items()}
        self._metric_sums[mode] = zero_metric_sums(self.block_size, self.args.device)
        return metrics_from_sums(reduced)

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """While it lasts, batch statistics go to the evaluation sums and logs take no training metrics."""
        previous, self._mode = self._mode, "eval"
        try:
            yield
        finally:
            self._mode = previous

    # ---------------------------------------------------------------- Trainer hooks
    def create_optimizer(self, model=None):
        """The drafter's optimizer (`optimizers.build_optimizer`): the Trainer's (AdamW by default), or with
        `muon=True` Muon for the backbone's 2-D weight matrices and AdamW for the rest; a Markov head at
        `markov_learning_rate` where given."""
        if self.optimizer is None:
            decay = self.get_decay_parameter_names(self.model)
            self.optimizer = build_optimizer(self.model, self.args, decay, partial(super().create_optimizer, model))
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, stats = self.dflash_loss(model, inputs)
        self._accumulate(self._mode, stats)
        return (loss, stats) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluate(
        self, eval_dataset=None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """The Trainer's evaluation, its batches and its log in evaluation mode (see `log`)."""
        with self._evaluating():
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def evaluation_loop(
        self,
        dataloader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """The Trainer's loop in evaluation mode, with the acceptance metrics in the returned metrics (named
        `{metric_key_prefix}_{metric}`, so `metric_for_best_model` and early stopping can use them)."""
        with self._evaluating():
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        output.metrics.update({f"{metric_key_prefix}_{key}": value for key, value in self._metrics("eval").items()})
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log. In training mode each log takes the training metrics since the one before, and the
        training step's log (the one with `loss`) shows them; evaluation's metrics join its results in
        `evaluation_loop`."""
        if self._mode == "train":
            metrics = self._metrics("train")
            if "loss" in logs:
                logs = {**logs, **metrics}
        super().log(logs, start_time)

    def training_facts(self, result: TrainOutput, last_log: dict[str, float], wall_seconds: float, data: str) -> dict:
        """The recorded facts of a finished run, for the model card: the data (named by `data`), steps, recipe,
        optimizer, precision, wall time, final loss, the draft vocabulary's coverage and the Markov head where there
        are, the training metrics of the last training log (`last_log`) and the best evaluation metric."""
        args = self.args
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # the Trainer's accelerate wrapper, if any
        facts = {
            "data": data,
            "samples": len(self.train_dataset),
            "steps": self.state.global_step,
            "epochs": args.num_train_epochs,
            "block_size": args.block_size,
            "num_anchors": args.num_anchors,
            "loss_decay_gamma": args.loss_decay_gamma,
            "loss_weighting": args.loss_weighting,
            "learning_rate": args.learning_rate,
            "effective_batch_size": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * args.world_size,
            "features": args.features,
            "distill_weight": args.distill_weight,
            "tv_weight": args.tv_weight,
            "hard_labels": args.hard_labels,
            "init_from_target": args.init_from_target,
            "optimizer": "muon+adamw"
            if isinstance(optimizer, MuonWithAdamW)
            else getattr(args.optim, "value", str(args.optim)),
            "precision": "bf16 autocast" if args.bf16 else ("fp16 autocast" if args.fp16 else "fp32"),
            "wall_time_s": round(wall_seconds, 1),
            "final_train_loss": round(float(result.training_loss), 4),
        }
        if self.draft_vocabulary_coverage is not None:
            facts["draft_vocabulary_coverage"] = round(self.draft_vocabulary_coverage, 4)
        if self.has_markov_head:
            drafter = self.accelerator.unwrap_model(self.model).config
            facts["markov_head"] = f"rank {drafter.markov_rank}, {markov_head_type(drafter)}"
            facts.update(
                markov_loss_weight=args.markov_loss_weight,
                freeze_backbone=args.freeze_backbone,
                markov_learning_rate=args.markov_learning_rate or args.learning_rate,
            )
        for key in ("accuracy", "acceptance_length", "acceptance_length_blockwise"):
            if key in last_log:
                facts[f"train_{key}"] = round(float(last_log[key]), 4)
        if self.state.best_metric is not None and args.metric_for_best_model:
            facts[f"best_eval_{args.metric_for_best_model}"] = round(float(self.state.best_metric), 4)
        return facts

    def create_model_card(self, *args, **kwargs) -> None:
        """Model cards of trained drafters are written by `dflash_hf.export` (see `dflash-hf train`)."""
        return None
