"""`ThroughputCallback`: the training rate once the run is warm.

The first optimizer step of a run pays for what later steps reuse: compiling flex attention's kernels, autotuning,
the allocator's first requests, CUDA's lazy initialisation. A rate over the whole loop (the Trainer's
`train_runtime`) counts that cost, which a run of minutes does not amortise; the callback times the steps after the
first `warmup_steps` on device-synchronised clocks (`dflash_hf.runtime.clock`) and counts the anchor-blocks and samples
they trained, so a short run measures what a long one sustains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dflash_hf.runtime import clock


class ThroughputCallback(TrainerCallback):
    """Times the optimizer steps after the first `warmup_steps` of a run.

    Args:
        trained_blocks: The anchor-blocks trained so far by this process, a tensor on the device (read at the end).
        warmup_steps: Steps left out of the rate.
        clock: Seconds once a device's queued work is done (a test gives its own).
    """

    def __init__(
        self,
        trained_blocks: Callable[[], torch.Tensor],
        warmup_steps: int = 1,
        clock: Callable[[torch.device], float] = clock,
    ) -> None:
        self.trained_blocks = trained_blocks
        self.warmup_steps = int(warmup_steps)
        self.clock = clock
        self._first_step = 0
        self.start: tuple[float, int, torch.Tensor] | None = None  # time, global step, blocks when warm
        self.end: tuple[float, int, torch.Tensor] | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.start = self.end = None
        self._first_step = state.global_step  # a resumed run starts later

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.start is None and state.global_step - self._first_step == self.warmup_steps:
            self.start = (self.clock(args.device), state.global_step, self.trained_blocks().clone())

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.start is not None and state.global_step > self.start[1]:
            self.end = (self.clock(args.device), state.global_step, self.trained_blocks().clone())

    def warm_rates(self, reduce: Callable[[torch.Tensor], torch.Tensor], samples_per_step: int) -> dict[str, float]:
        """`anchor_blocks_per_second_warm` and `samples_per_second_warm` of the steps after warm-up (blocks summed
        over processes by `reduce`; `samples_per_step` the samples of one optimizer step over every process); `None`
        when the run had no step after them."""
        if self.start is None or self.end is None:
            return {"anchor_blocks_per_second_warm": None, "samples_per_second_warm": None}
        seconds = self.end[0] - self.start[0]
        blocks = float(reduce(self.end[2] - self.start[2]))
        steps = self.end[1] - self.start[1]
        return {
            "anchor_blocks_per_second_warm": round(blocks / seconds, 1),
            "samples_per_second_warm": round(steps * samples_per_step / seconds, 3),
        }
