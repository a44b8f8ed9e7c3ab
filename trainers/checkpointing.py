"""Pickle-free, crash-safe Trainer checkpoints: the `Trainer` hooks that write and read checkpoints, overridden.

A `transformers.Trainer` subclass to derive trainers from (`class MyTrainer(PickleFreeCheckpoints)`): the optimizer,
scheduler, scaler, RNG state and training arguments are written as safetensors + JSON (`checkpoint_io`), a checkpoint
is written in a hidden staging folder and renamed to `checkpoint-N` only once complete, resuming from a folder with
pickle files or from an incomplete checkpoint is refused, and `resume_from_checkpoint=True` picks the newest complete
one.
"""

from __future__ import annotations

import os

import torch
from transformers import Trainer
from transformers.training_args import ParallelMode
from transformers.utils import logging

from dflash_hf.fileio import set_ordinary_mode

from .checkpoint_io import (
    OPTIMIZER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    capture_rng_state,
    check_complete_checkpoint,
    last_complete_checkpoint,
    load_state,
    publish_checkpoint,
    refuse_pickle_checkpoint,
    remove_leftovers,
    restore_rng_state,
    rng_state_name,
    rotate_checkpoints,
    save_state,
    save_training_args,
    staging_folder,
)

logger = logging.get_logger(__name__)


class PickleFreeCheckpoints(Trainer):
    """`Trainer` checkpoint hooks that never pickle and never leave a `checkpoint-N` that looks complete but is not."""

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint=True` picks the newest *complete* checkpoint of the run."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint, skipped = last_complete_checkpoint(self.args.output_dir)
            for folder in skipped:
                logger.warning(f"Skipping incomplete checkpoint {folder}.")
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in {self.args.output_dir} to resume from.")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _get_output_dir(self, trial) -> str:
        """The run folder; while a checkpoint is written, its hidden staging folder (see `_save_checkpoint`)."""
        staging = getattr(self, "_checkpoint_staging", None)
        return str(staging) if staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written in a hidden staging folder and renamed to `checkpoint-N` once complete.

        A kill mid-save never leaves a `checkpoint-N` that looks complete (the next save clears the leftovers), and
        checkpoints beyond `save_total_limit` are moved aside before they are deleted.
        """
        run_dir = super()._get_output_dir(trial)
        name = f"checkpoint-{self.state.global_step}"
        staging = staging_folder(run_dir, self.state.global_step)
        if self.args.should_save:
            remove_leftovers(run_dir)
        self.accelerator.wait_for_everyone()
        self._checkpoint_staging = staging
        try:  # the Trainer writes `staging/checkpoint-N` (its rotation there has nothing to delete)
            super()._save_checkpoint(model, trial)
        finally:
            self._checkpoint_staging = None
        self.accelerator.wait_for_everyone()  # every process has written its RNG state
        if self.args.should_save:
            final = os.path.join(run_dir, name)
            if self.state.best_model_checkpoint == str(staging / name):  # this save is the best so far
                self.state.best_model_checkpoint = final
                self.state.save_to_json(str(staging / name / TRAINER_STATE_NAME))
            publish_checkpoint(staging / name, final)
            staging.rmdir()
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()

    def _save(self, output_dir: str | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Drafter weights (safetensors), config and tokenizer via `save_pretrained`; training arguments as JSON."""
        if not self.args.should_save:
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        drafter = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        shards = {} if self.args.max_shard_size is None else {"max_shard_size": self.args.max_shard_size}
        drafter.save_pretrained(output_dir, state_dict=state_dict, **shards)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        save_training_args(self.args, output_dir)
        set_ordinary_mode(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Optimizer as safetensors + JSON, scheduler as JSON (main process, as the Trainer)."""
        if self.args.should_save:
            save_state(self.optimizer.state_dict(), output_dir, OPTIMIZER_NAME)
            save_state(self.lr_scheduler.state_dict(), output_dir, SCHEDULER_NAME)

    def _save_scaler(self, output_dir: str) -> None:
        """Gradient-scaler state (fp16) as JSON."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and self.args.should_save:
            save_state(scaler.state_dict(), output_dir, SCALER_NAME)

    def _save_rng_state(self, output_dir: str) -> None:
        """This process's RNG states as safetensors + JSON (`rng_state_{rank}` when distributed)."""
        distributed = self.args.parallel_mode == ParallelMode.DISTRIBUTED
        name = rng_state_name(self.args.process_index, self.args.world_size)
        save_state(capture_rng_state(distributed), output_dir, name)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """Refuse a checkpoint holding pickles, or an incomplete one, before the Trainer loads the weights."""
        refuse_pickle_checkpoint(resume_from_checkpoint)
        check_complete_checkpoint(resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restore optimizer and scheduler from `checkpoint_io` files; never unpickles."""
        if checkpoint is None:
            return
        refuse_pickle_checkpoint(checkpoint)
        optimizer, scheduler = load_state(checkpoint, OPTIMIZER_NAME), load_state(checkpoint, SCHEDULER_NAME)
        if optimizer is not None and scheduler is not None:
            try:
                self.optimizer.load_state_dict(optimizer)
            except ValueError as err:
                raise ValueError(
                    f"The optimizer state of {checkpoint} has other parameter groups than this run's optimizer ({err}): "
                    "it was written with other muon / markov_learning_rate / freeze_backbone settings. Resume with "
                    f"the run's own settings, or start a new run from its weights (--drafter {checkpoint})."
                ) from err
            self.lr_scheduler.load_state_dict(scheduler)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Restore the gradient-scaler state when the checkpoint has one."""
        state = load_state(checkpoint, SCALER_NAME) if checkpoint is not None else None
        if state is not None:
            self.accelerator.scaler.load_state_dict(state)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Restore this process's RNG states (python, numpy, torch CPU/CUDA)."""
        if checkpoint is None:
            return
        state = load_state(checkpoint, rng_state_name(self.args.process_index, self.args.world_size))
        if state is None:
            logger.info(f"No RNG state for process {self.args.process_index} in {checkpoint}; the run may diverge.")
            return
        restore_rng_state(state, self.args.parallel_mode == ParallelMode.DISTRIBUTED)
