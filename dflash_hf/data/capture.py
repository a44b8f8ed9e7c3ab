"""Target features captured while `make-data` makes its rows, so that regenerated data needs no second feature pass.

While the target generates a batch, forward hooks on its tapped layers and its final norm record what each forward
computes: the prompt in the prefill, then one position per decode step. Each row's features are cut out of those
outputs (left padding and finished rows dropped) and written as one shard per make-data part, in the folder format of
`dflash-hf cache-features` (`dflash_hf.data.feature_index`), so training reads them with `features="offline"`.

The last token of a row (its end-of-turn token, or the last one `max_new_tokens` allowed) is never fed to the target
during generation, so its features are stored as zeros: no block's context or distillation teacher reaches the last
position (an anchor lies at least `block_size` tokens before the end). Teacher-forced rows (`responses="source"`) get
their features from one ordinary forward per batch instead. Hooks make this single-threaded by design (make-data
runs one generation at a time).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..target.adapter import TargetAdapter
from .feature_index import next_row, settings_of
from .feature_shards import ShardWriter, open_index
from .features import features_of_batch


class FeatureRecorder:
    """Writes the features of each finished make-data batch to `out_dir` (one shard per batch, before its part)."""

    def __init__(
        self,
        target: PreTrainedModel,
        out_dir: str | os.PathLike,
        target_layer_ids: list[int],
        *,
        max_length: int,
        final_hidden: bool = True,
        target_name: str | None = None,
    ) -> None:
        self.adapter = TargetAdapter(target, list(target_layer_ids))
        self.out = Path(out_dir)
        self.final_hidden = final_hidden
        self.max_length = int(max_length)
        self.settings = settings_of(
            target, self.adapter, target_layer_ids, target_name, self.max_length, final_hidden, num_rows=0
        )
        self.writer: ShardWriter | None = None
        self._outputs: dict[str, list[torch.Tensor]] | None = None

    @property
    def recorded(self) -> bool:
        """Whether forwards were recorded since the last stored batch."""
        return bool(self._outputs and self._outputs["taps"])

    def start(self, done: list[dict[str, Any]]) -> None:
        """Open (or create) the features folder for the rows already made; shards of rows whose part was never
        written (a run killed between the two) are dropped, so features and parts stay aligned."""
        self.out.mkdir(parents=True, exist_ok=True)
        index = open_index(self.out, {**self.settings, "num_rows": len(done)}, done, drop_extra_rows=True)
        covered = next_row(index)
        if covered != len(done):
            raise ValueError(
                f"{self.out} holds features for {covered} of the {len(done)} rows already made (the folder was started "
                "without --features-out): fill it with `dflash-hf cache-features --data OUT --out FEATURES` (same "
                f"--max-length {self.max_length} and taps), then rerun make-data."
            )
        self.writer = ShardWriter(self.out, index)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the tapped layers' and the final norm's outputs of every forward inside the block."""
        self._outputs = {"taps": [], "final": []}
        layers = [self.adapter.layers[i] for i in self.adapter.target_layer_ids]
        per_forward: list[torch.Tensor] = []

        def tap(_module, _args, output) -> None:
            per_forward.append((output[0] if isinstance(output, tuple) else output).detach())
            if len(per_forward) == len(layers):
                self._outputs["taps"].append(torch.cat(per_forward, dim=-1))
                per_forward.clear()

        def final(_module, _args, output) -> None:
            self._outputs["final"].append(output.detach())

        handles = [layer.register_forward_hook(tap) for layer in layers]
        handles.append(self.adapter.base_model.norm.register_forward_hook(final))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def store(self, records: list[dict[str, Any]], prompt_width: int | None = None) -> None:
        """Write the features of `records` (rows about to be published as one part) as one shard.

        With `prompt_width` (the left-padded prompt width of a recorded generation) the rows are cut out of what
        [`recording`] saw; without it (teacher-forced rows) one forward over the rows computes them."""
        seqs = [list(r["input_ids"])[: self.max_length] for r in records]
        start = self.writer.end
        rows = list(range(start, start + len(records)))
        if prompt_width is None:
            tensors = features_of_batch(self.adapter, rows, seqs, self.final_hidden)
        else:
            tensors = self._recorded_rows(rows, records, prompt_width)
        self.writer.add(tensors, seqs)
        self.writer.flush(start + len(records))
        self._outputs = None

    def _recorded_rows(self, rows: list[int], records: list[dict], width: int) -> dict[str, torch.Tensor]:
        """Each row's features from the recorded forwards: its prompt (after its left padding) and the positions of
        its fed response tokens, then zeros for its last token."""
        outputs = {"": torch.cat(self._outputs["taps"], dim=1)}
        if self.final_hidden:
            outputs[".final"] = torch.cat(self._outputs["final"], dim=1)
        tensors = {}
        for j, (row, record) in enumerate(zip(rows, records)):
            length = min(len(record["input_ids"]), self.max_length)
            first = width - int(record["prompt_length"])
            for suffix, full in outputs.items():
                fed = full[j, first : first + length - 1]
                last = fed.new_zeros(1, fed.shape[-1])
                tensors[f"{row}{suffix}"] = torch.cat([fed, last]).to(torch.bfloat16).cpu().contiguous()
        return tensors
