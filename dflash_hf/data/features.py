"""Offline target features: `dflash-hf cache-features` and the dataset that reads them back.

The frozen target's tapped hidden states (the concatenated outputs of `target_layer_ids`, width `k * H`) are
computed once per training row and stored in bfloat16 safetensors shards, in the folder format of
[`dflash_hf.data.feature_index`] (written by [`dflash_hf.data.feature_shards`]).

With `final_hidden=True` (the default for new folders) each row also stores the target's final normed hidden state
(`H` more values per token). Through the frozen LM head it gives the target's own next-token distribution at every
position, the teacher of the trainer's distillation loss (`distill_weight`), at a fraction of the cost of storing
logits.

A killed run loses at most the shard in progress; rerunning continues after the last indexed row. A dataset that grew
(`make-data` rerun with a larger `--max-samples` appends rows) is extended in place, its stored rows checked first.
Storage grows linearly with the number of taps: `length * k * H * 2` bytes per row.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..target.linear_attention import new_target_cache
from .batching import pad
from .feature_index import next_row, read_index, settings_of, shard_path
from .feature_shards import ShardWriter, open_index, row_ids


def features_of_batch(adapter, rows: list[int], seqs: list[list[int]], final_hidden: bool) -> dict[str, torch.Tensor]:
    """One target forward over a right-padded batch: the bf16 tensors to store, by name (`"{row}"`, `"{row}.final"`)."""
    device = next(adapter.target.parameters()).device
    ids = pad([torch.tensor(s, dtype=torch.long) for s in seqs]).to(device)
    mask = pad([torch.ones(len(s), dtype=torch.long) for s in seqs]).to(device)
    positions = torch.arange(ids.shape[1], device=device)[None].expand(len(seqs), -1)
    step = adapter.forward(ids, mask, positions, new_target_cache(adapter.target))
    tensors = {}
    for j, (row, s) in enumerate(zip(rows, seqs)):
        tensors[str(row)] = step.context_hidden_states[j, : len(s)].to(torch.bfloat16).cpu().contiguous()
        if final_hidden:
            tensors[f"{row}.final"] = step.last_hidden_state[j, : len(s)].to(torch.bfloat16).cpu().contiguous()
    return tensors


@torch.no_grad()
def cache_features(
    target,
    dataset,
    out_dir: str | os.PathLike,
    target_layer_ids: list[int],
    *,
    target_name: str | None = None,
    max_length: int = 3072,
    batch_size: int = 4,
    shard_bytes: int = 512 * 2**20,
    final_hidden: bool = True,
    first_row: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Compute and store the tapped target features of every row of `dataset` (rows with `input_ids`), and with
    `final_hidden` the target's final normed hidden states (the distillation teacher). With `first_row`, the rows
    before it are left out (for training that skips them, `skip_train_samples`).

    Resumable: rows already indexed in `out_dir` are skipped, and a dataset that only grew at the end is extended
    (stored rows are checked against it first). Returns the index.
    """
    from ..target.adapter import TargetAdapter

    _check_cache_arguments(dataset, max_length, batch_size, first_row)
    adapter = TargetAdapter(target, list(target_layer_ids))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = settings_of(
        target, adapter, target_layer_ids, target_name, max_length, final_hidden, len(dataset), first_row
    )
    writer = ShardWriter(out, open_index(out, settings, dataset))
    total = len(dataset)
    done = writer.end - first_row
    with tqdm(total=total - first_row, initial=done, desc="cache-features", unit="row", disable=not progress) as bar:
        row = writer.end
        while row < total:
            rows = list(range(row, min(row + batch_size, total)))
            seqs = [row_ids(dataset, i, max_length) for i in rows]
            writer.add(features_of_batch(adapter, rows, seqs, final_hidden), seqs)
            row = rows[-1] + 1
            bar.update(len(rows))
            if writer.pending_bytes >= shard_bytes:
                writer.flush(row)
        writer.flush(row)
    return writer.index


def _check_cache_arguments(dataset, max_length: int, batch_size: int, first_row: int) -> None:
    """Raise a `ValueError` for [`cache_features`] arguments it cannot honour, before anything is written."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if "input_ids" not in dataset.column_names:
        raise ValueError(f"The dataset has no `input_ids` column (columns: {dataset.column_names}).")
    if not 0 <= first_row < len(dataset):
        raise ValueError(f"first_row must be in 0..{len(dataset) - 1} (the dataset's rows), got {first_row}.")


def features_folders(features_dir: str | os.PathLike | list) -> list[Path]:
    """The features folder(s) named by `features_dir`: one path, a list, or paths separated by commas."""
    if isinstance(features_dir, (list, tuple)):
        return [Path(p) for p in features_dir]
    return [Path(p.strip()) for p in str(features_dir).split(",") if p.strip()]


def _check_folder(folder: Path, index: dict[str, Any], taps: list[int], rows_read: range) -> None:
    """Raise a `ValueError` unless the features folder `folder` (its checked `index`) taps `taps` and holds the rows of
    `rows_read` among its own (numbered from its first row; rows of other folders are left out)."""
    if list(index["target_layer_ids"]) != taps:
        raise ValueError(
            f"The features in {folder} tap target layers {index['target_layer_ids']} but the drafter uses "
            f"{taps}: recache with --target-layer-ids {' '.join(map(str, taps))} or train with "
            "features='online'."
        )
    first, covered = int(index.get("first_row", 0)), next_row(index)
    needed = range(max(rows_read.start, 0), min(rows_read.stop, int(index["num_rows"])))
    if needed and not first <= needed.start < needed.stop <= covered:
        raise ValueError(
            f"The features in {folder} cover its rows {first}..{covered - 1} (of {index['num_rows']}) but "
            f"this run reads rows {needed.start}..{needed.stop - 1}: finish (rerun) `dflash-hf cache-features` "
            "on its dataset (with a --first-row no later than skip_train_samples), or change "
            "skip_train_samples / max_train_samples."
        )


class OfflineFeatureDataset(torch.utils.data.Dataset):
    """A `make-data` dataset whose rows also carry `context_hidden_states` (bf16 `(length, k * H)`) read from a features folder.

    Several folders (a list, or paths separated by commas) cover consecutive rows, in order: the features of
    `--data a,b` are `--features_dir fa,fb`."""

    def __init__(
        self,
        dataset,
        features_dir: str | os.PathLike | list,
        target_layer_ids: list[int] | None = None,
        rows_read: range | None = None,
    ) -> None:
        """Rows also carry `target_final_hidden` (bf16 `(length, H)`) when the folders store final hidden states.

        `rows_read`: only these rows will be read (a run with `skip_train_samples` / `max_train_samples`), so a
        features folder still being cached, or cached from a later first row, is enough once it covers them."""
        self.dataset = dataset
        self.folders = features_folders(features_dir)
        self.indexes = [read_index(folder) for folder in self.folders]
        taps = [int(i) for i in (target_layer_ids or self.indexes[0]["target_layer_ids"])]
        self._starts = [0]
        for index in self.indexes:
            self._starts.append(self._starts[-1] + int(index["num_rows"]))
        if self._starts[-1] != len(dataset):
            raise ValueError(
                f"The features in {', '.join(map(str, self.folders))} are for {self._starts[-1]} rows but the "
                f"dataset has {len(dataset)}: cache (or extend) them with `dflash-hf cache-features` on this dataset "
                "(one features folder per data folder, in the same order)."
            )
        rows_read = range(len(dataset)) if rows_read is None else rows_read
        for folder, index, start in zip(self.folders, self.indexes, self._starts):
            _check_folder(folder, index, taps, range(rows_read.start - start, rows_read.stop - start))
        self._shard_ends = [[s["end"] for s in index["shards"]] for index in self.indexes]
        self._shard_files = [
            [shard_path(folder, s) for s in index["shards"]] for folder, index in zip(self.folders, self.indexes)
        ]
        self._handles: dict[Path, Any] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def _folder_of(self, row: int) -> int:
        """The number of the folder holding `row`."""
        return bisect.bisect_right(self._starts, row) - 1

    def _locate(self, row: int) -> tuple[Path, int]:
        """The shard file holding `row` and the row's number inside its folder."""
        folder = self._folder_of(row)
        local = row - self._starts[folder]
        return self._shard_files[folder][bisect.bisect_right(self._shard_ends[folder], local)], local

    @property
    def has_final_hidden(self) -> bool:
        """Whether the folders store the target's final hidden states (needed for distillation)."""
        return all(index.get("final_hidden", False) for index in self.indexes)

    def _tensor(self, row: int, suffix: str = "") -> torch.Tensor:
        shard, local = self._locate(row)
        handle = self._handles.get(shard)
        if handle is None:
            handle = safe_open(str(shard), framework="pt")
            self._handles[shard] = handle
        return handle.get_tensor(f"{local}{suffix}")

    def features(self, row: int) -> torch.Tensor:
        """The cached tapped features of `row`, bf16 `(length, k * H)`."""
        return self._tensor(row)

    def __getitem__(self, row: int) -> dict[str, Any]:
        item = dict(self.dataset[int(row)])
        hidden = self.features(int(row))
        expected = min(len(item["input_ids"]), int(self.indexes[self._folder_of(int(row))]["max_length"]))
        if hidden.shape[0] != expected:
            raise ValueError(
                f"Row {row}: cached features cover {hidden.shape[0]} tokens, the row has {expected}: the features "
                "folder was made from another dataset; recache it."
            )
        item["context_hidden_states"] = hidden
        if self.has_final_hidden:
            item["target_final_hidden"] = self._tensor(int(row), ".final")
        return item

    def __getstate__(self):  # dataloader workers reopen the shards
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state
