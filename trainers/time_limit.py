"""`TimeLimitCallback`: end a training run in time for a wall-clock limit (`DFlashTrainingConfig.max_train_seconds`).

A run on a machine lent for a fixed time (a GPU held for minutes, a job with a wall-clock limit) should stop while
there is still time to save: after each optimizer step the callback compares the time spent since training began plus
the mean step so far against the limit, and stops before a step that would end past it. The stop saves a checkpoint
(unless `save_strategy="no"`), so `--resume_from_checkpoint last` continues the run, and the training command then
exports the drafter as it does at the end of any run. In a distributed run every process stops when any one would.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import SaveStrategy


class TimeLimitCallback(TrainerCallback):
    """Stop training (and save) before the step that would end more than `seconds` after training began.

    Args:
        seconds: The wall-clock budget of the training loop, from the start of `Trainer.train`'s first step (loading
            and the final export are outside it).
        clock: Monotonic seconds (a test gives its own).
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not seconds > 0:
            raise ValueError(f"max_train_seconds must be > 0, got {seconds}.")
        self.seconds = float(seconds)
        self.clock = clock
        self.started: float | None = None
        self.steps = 0
        self.stopped_early = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.started, self.steps, self.stopped_early = self.clock(), 0, False

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.steps += 1
        elapsed = self.clock() - self.started
        if (
            _any_process(elapsed + elapsed / self.steps > self.seconds, args.device)
            and state.global_step < state.max_steps
        ):
            control.should_training_stop = True
            control.should_save = args.save_strategy != SaveStrategy.NO
            self.stopped_early = True
        return control


def _any_process(stop: bool, device: torch.device) -> bool:
    """Whether any process of a distributed run would stop (each one's clock is its own: they must stop together, or
    the next step's collectives wait for a process that left); `stop` itself in a single process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return stop
    if torch.distributed.get_world_size() == 1:
        return stop
    flag = torch.tensor([float(stop)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
