"""`ThroughputCallback`: the training rate once the run is warm, evaluations and checkpoints left out.

The first optimizer step of a run pays for what later steps reuse: compiling flex attention's kernels, autotuning,
the allocator's first requests, CUDA's lazy initialisation. A rate over the whole loop (the Trainer's
`train_runtime`) counts that cost, which a run of minutes does not amortise, and every evaluation and checkpoint
save on top. The callback times the steps after the first `warmup_steps` on device-synchronised clocks
(`dflash_hf.runtime.clock`), pausing from the end of a step or epoch that evaluates, saves or stops to the next step,
and counts the anchor-blocks and rows trained meanwhile, so a short run measures what a long one sustains. Its clock
waits for the device only where a timed stretch begins or ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dflash_hf.runtime import clock


class ThroughputCallback(TrainerCallback):
    """Times the optimizer steps after the first `warmup_steps` of a run, evaluations and checkpoint saves left out.

    Args:
        trained: This process's training so far: `(anchor-blocks, rows)`, the blocks a tensor on the device (read
            once, at the end), the rows a number.
        warmup_steps: Steps left out of the rate (at least 1: the first step compiles).
        clock: Seconds once a device's queued work is done (a test gives its own).
    """

    def __init__(
        self,
        trained: Callable[[], tuple[torch.Tensor, int]],
        warmup_steps: int = 1,
        clock: Callable[[torch.device], float] = clock,
    ) -> None:
        if int(warmup_steps) < 1:
            raise ValueError(f"warmup_steps must be >= 1 (the first step compiles), got {warmup_steps}.")
        self.trained = trained
        self.warmup_steps = int(warmup_steps)
        self.clock = clock
        self._first_step = 0
        self._open: tuple[float, torch.Tensor, int] | None = None  # a timed stretch: its start, blocks, rows
        self._timed: list[tuple[float, torch.Tensor, int]] = []  # the closed stretches: seconds, blocks, rows
        self._warm = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._first_step = state.global_step  # a resumed run starts later
        self._open, self._timed, self._warm = None, [], False

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._warm and self._open is None:  # after warm-up, an evaluation or a save
            self._open = self._mark(args.device)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self._warm:
            if state.global_step - self._first_step >= self.warmup_steps:
                self._warm = True
                if not _pauses(control):
                    self._open = self._mark(args.device)
        elif self._open is not None and _pauses(control):
            self._close(args.device)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._open is not None and _pauses(control):  # an epoch's evaluation or save comes next
            self._close(args.device)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._open is not None:
            self._close(args.device)

    def _mark(self, device: torch.device) -> tuple[float, torch.Tensor, int]:
        blocks, rows = self.trained()
        return self.clock(device), blocks.clone(), rows

    def _close(self, device: torch.device) -> None:
        (start, blocks, rows), (end, blocks_now, rows_now) = self._open, self._mark(device)
        self._timed.append((end - start, blocks_now - blocks, rows_now - rows))
        self._open = None

    def warm_rates(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float | None]:
        """`anchor_blocks_per_second_warm` and `samples_per_second_warm` of the timed steps, summed over processes by
        `reduce` (called on every process alike); `None` when the run had no timed step."""
        if not self._timed:  # the same steps on every process: all of them return here, or none
            return {"anchor_blocks_per_second_warm": None, "samples_per_second_warm": None}
        blocks = sum(timed[1] for timed in self._timed)
        rows = torch.tensor(float(sum(timed[2] for timed in self._timed)), dtype=torch.float64, device=blocks.device)
        blocks, rows = float(reduce(blocks)), float(reduce(rows))
        seconds = sum(timed[0] for timed in self._timed)
        if seconds <= 0:
            return {"anchor_blocks_per_second_warm": None, "samples_per_second_warm": None}
        return {
            "anchor_blocks_per_second_warm": round(blocks / seconds, 1),
            "samples_per_second_warm": round(rows / seconds, 3),
        }


def _pauses(control: TrainerControl) -> bool:
    """Whether the step just ended is followed by an evaluation, a save or the end of training (work that is not a
    training step)."""
    return control.should_evaluate or control.should_save or control.should_training_stop
