"""The target watch: module hooks that measure a `target.generate` call from outside.

Transformers' own decoding methods report no statistics of their own; the bench counts, times and locates the
target's forwards (and times the drafter) with forward hooks, and reads the tokens each forward committed from where
the next one starts in the KV cache. On a GPU the hooks record CUDA events, which do not wait for the device: the
times are read once, after the call, so watching a call does not stall it once per token.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import PreTrainedModel

from ..transformers_compat import cache_of_call


class Marks:
    """Points in time of the work queued on a device, read after the work: CUDA events on a GPU (recording one does
    not wait for the device), the wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"

    def now(self) -> torch.cuda.Event | float:
        """A mark at this point of the device's queue."""
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """Seconds between two marks (waits for `end` to be reached on a GPU)."""
        if not self.events:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class TargetWatch:
    """Module hooks that count, time and locate the target's forwards (and time the drafter) during one call."""

    def __init__(self, target: PreTrainedModel, drafter: nn.Module | None = None) -> None:
        self.marks = Marks(target.device)
        self.cache_lengths: list[int] = []  # tokens in the target's KV cache when each decoder forward starts
        self._target_spans: list[tuple] = []  # (start, end) marks of each full target forward (decoder + LM head)
        self._draft_spans: list[tuple] = []
        self._depth = 0
        self._handles = [
            target.get_decoder().register_forward_pre_hook(self._on_decoder, with_kwargs=True),
            target.register_forward_pre_hook(self._enter_target),
            target.register_forward_hook(self._leave_target),
        ]
        if drafter is not None:
            lm_head = target.get_output_embeddings()
            for module in (drafter, lm_head):
                self._handles += [
                    module.register_forward_pre_hook(self._start_draft),
                    module.register_forward_hook(self._stop_draft),
                ]

    def _on_decoder(self, _module, args, kwargs) -> None:
        cache = cache_of_call(kwargs)
        if cache is not None:
            self.cache_lengths.append(int(cache.get_seq_length()))
            return
        positions = kwargs.get("position_ids")
        if positions is None:
            raise ValueError("Cannot locate the target's forwards: it was called without a cache or position ids.")
        self.cache_lengths.append(int(positions[0, 0]))

    def _enter_target(self, _module, _args) -> None:
        self._depth += 1
        self._target_start = self.marks.now()

    def _leave_target(self, _module, _args, _output) -> None:
        self._depth -= 1
        self._target_spans.append((self._target_start, self.marks.now()))

    def _start_draft(self, _module, _args) -> None:
        if self._depth == 0:  # the LM head inside the target's own forward is verification, not drafting
            self._draft_start = self.marks.now()

    def _stop_draft(self, _module, _args, _output) -> None:
        if self._depth == 0:
            self._draft_spans.append((self._draft_start, self.marks.now()))

    @property
    def target_seconds(self) -> list[float]:
        """Wall time of each full target forward (decoder + LM head), in order."""
        return [self.marks.seconds(start, end) for start, end in self._target_spans]

    @property
    def draft_seconds(self) -> float:
        """Wall time of the drafter's forwards and of the LM head outside the target's forward, summed."""
        return sum(self.marks.seconds(start, end) for start, end in self._draft_spans)

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()

    def accepted_lengths(self, prompt_length: int, total_length: int) -> list[int]:
        """Tokens committed by each forward after the prefill (see the module docstring)."""
        starts = self.cache_lengths[1:]
        ends = starts[1:] + [total_length - 1]
        lengths = [end - start for start, end in zip(starts, ends)]
        prefill_ok = self.cache_lengths[:1] == [0] and (not starts or starts[0] >= prompt_length)
        if not prefill_ok or any(n < 1 for n in lengths):
            raise ValueError(
                f"Cannot follow this Transformers version's decoding: the target's forwards started at cache lengths "
                f"{self.cache_lengths} for a {prompt_length}-token prompt and a {total_length}-token result."
            )
        return lengths
