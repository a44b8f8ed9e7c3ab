"""The target watch: module hooks that measure a `target.generate` call from outside.

Transformers' own decoding methods report no statistics of their own; the bench counts, times and locates the
target's forwards (and times the drafter) with forward hooks, and reads the tokens each forward committed from where
the next one starts in the KV cache. The forwards are timed with the package's stopwatches (`runtime.Stopwatch`),
read once the call is done.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from ..runtime import Stopwatch
from ..transformers_compat import cache_of_call


class TargetWatch:
    """Module hooks that count, time and locate the target's forwards (and time the drafter) during one call."""

    def __init__(self, target: PreTrainedModel, drafter: nn.Module | None = None) -> None:
        self.device = target.device
        self.cache_lengths: list[int] = []  # tokens in the target's KV cache when each decoder forward starts
        self._forwards: list[Stopwatch] = []  # one per full target forward (decoder + LM head)
        self._drafts = Stopwatch(self.device)
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
        self._forwards.append(Stopwatch(self.device).__enter__())

    def _leave_target(self, _module, _args, _output) -> None:
        self._depth -= 1
        self._forwards[-1].__exit__(None, None, None)

    def _start_draft(self, _module, _args) -> None:
        if self._depth == 0:  # the LM head inside the target's own forward is verification, not drafting
            self._drafts.__enter__()

    def _stop_draft(self, _module, _args, _output) -> None:
        if self._depth == 0:
            self._drafts.__exit__(None, None, None)

    @property
    def target_seconds(self) -> list[float]:
        """Time of each full target forward (decoder + LM head), in order."""
        return [forward.total for forward in self._forwards]

    @property
    def draft_seconds(self) -> float:
        """Time of the drafter's forwards and of the LM head outside the target's forward, summed."""
        return self._drafts.total

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
