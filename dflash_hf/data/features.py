"""Offline target features: `dflash-hf cache-features` and the dataset that reads them back.

The frozen target's tapped hidden states (the concatenated outputs of `target_layer_ids`, width `k * H`) are
computed once per training row and stored in bfloat16 safetensors shards:

    FEATURES_DIR/
        index.json                 # format, target, target_layer_ids, width, row count, shards [{file, start, end, lengths, fingerprint}]
        shard-00000.safetensors    # per row: "{row}" (length, k * H) and, with final hidden states, "{row}.final" (length, H)
        ...

With `final_hidden=True` (the default for new folders) each row also stores the target's final normed hidden state
(`H` more values per token). Through the frozen LM head it gives the target's own next-token distribution at every
position, the teacher of the trainer's distillation loss (`distill_weight`), at a fraction of the cost of storing
logits.

Shards are written to a temporary name and renamed into place, then `index.json` is rewritten (also atomically), so
a killed run loses at most the shard in progress; rerunning continues after the last indexed row. A dataset that grew
(`make-data` rerun with a larger `--max-samples` appends rows) is extended in place: every stored shard carries a
fingerprint of its rows' token ids, checked against the dataset before anything is reused. Storage grows linearly with
the number of taps: `length * k * H * 2` bytes per row.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..fileio import (
    SAFETENSORS_TEMPORARY,
    atomic_write,
    atomic_write_text,
    path_inside,
    read_json,
    remove_leftovers,
    set_ordinary_mode,
)
from .batching import pad

FEATURES_FORMAT = "dflash-hf-features/1"
INDEX_NAME = "index.json"
_INDEX_FIX = "the index is not one `dflash-hf cache-features` writes; recreate the features folder."


def _write_index(out: Path, index: dict[str, Any]) -> None:
    """Rewrite `index.json` atomically."""
    atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=1))


def read_index(features_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and check `index.json` of a features folder: its settings, and shard entries naming distinct files inside
    the folder that cover consecutive rows from `first_row` and hold every row's tensors at the recorded width."""
    path = Path(features_dir) / INDEX_NAME
    if not path.is_file():
        raise ValueError(
            f"{features_dir} is not a features folder (no {INDEX_NAME}); create it with "
            "`dflash-hf cache-features --target T --data D --out F`."
        )
    index = read_json(path, "recreate the features folder with `dflash-hf cache-features`.")
    if not isinstance(index, dict) or index.get("format") != FEATURES_FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise ValueError(f"{path} has format {found!r}, expected {FEATURES_FORMAT!r}.")
    _check_index_settings(path, index)
    files = _check_shard_entries(features_dir, index)  # every shard inside the folder before anything is read
    for number, file in enumerate(files):
        _check_shard_tensors(path, number, file, index)
    return index


def _is_count(value: Any, minimum: int = 0) -> bool:
    """Whether `value` is an int (not a bool) of at least `minimum`."""
    return type(value) is int and value >= minimum


# the settings of an index the readers rely on: a check and what it asks for
_INDEX_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "target_layer_ids": (lambda v: isinstance(v, list) and bool(v) and all(map(_is_count, v)), "a list of layers"),
    "width": (lambda v: _is_count(v, 1), "a positive number"),
    "max_length": (lambda v: _is_count(v, 2), "a number >= 2"),
    "num_rows": (_is_count, "a row count"),
    "first_row": (_is_count, "a row number"),
    "final_hidden": (lambda v: isinstance(v, bool), "true or false"),
    "shards": (lambda v: isinstance(v, list), "a list of shard entries"),
}
_INDEX_DEFAULTS = {"final_hidden": False, "first_row": 0}  # indexes written before these settings existed


def _check_index_settings(path: Path, index: dict[str, Any]) -> None:
    """Raise a `ValueError` naming `path` unless the settings of `index` have the types its readers rely on."""
    for key, (valid, wanted) in _INDEX_FIELDS.items():
        value = index.get(key, _INDEX_DEFAULTS.get(key))
        if not valid(value):
            found = f"{value!r:.60}" if key in index else "missing"
            raise ValueError(f"{path}: `{key}` is {found}, not {wanted}: {_INDEX_FIX}")
    if index["width"] % len(index["target_layer_ids"]):
        raise ValueError(
            f"{path}: `width` {index['width']} is not a multiple of the {len(index['target_layer_ids'])} tapped "
            f"layers: {_INDEX_FIX}"
        )


def _entry(path: Path, number: int, shard: dict[str, Any]) -> str:
    """How errors name a shard entry of the index `path`."""
    return f"{path}: shard entry {number} ({shard['file']!r})"


def _check_shard_entries(features_dir: str | os.PathLike, index: dict[str, Any]) -> list[Path]:
    """The files of the shard entries of `index` (its settings checked), once each entry names its own file inside the
    folder and the entries cover consecutive rows from `first_row` (each row once) up to at most `num_rows`."""
    path = Path(features_dir) / INDEX_NAME
    row = index.get("first_row", 0)
    files: list[Path] = []
    entry_of: dict[Path, int] = {}  # resolved file -> its entry
    for number, shard in enumerate(index["shards"]):
        if not isinstance(shard, dict) or not isinstance(shard.get("file"), str):
            raise ValueError(f"{path}: shard entry {number} has no `file` (the shard's file name): {_INDEX_FIX}")
        file = shard_path(features_dir, shard)
        where = _entry(path, number, shard)
        if file.resolve() in entry_of:
            raise ValueError(f"{where} names the file of shard entry {entry_of[file.resolve()]} again: {_INDEX_FIX}")
        entry_of[file.resolve()] = number
        start, end, lengths = shard.get("start"), shard.get("end"), shard.get("lengths")
        if not (_is_count(start) and _is_count(end) and start < end):
            raise ValueError(f"{where}: `start` {start!r} and `end` {end!r} are not a range of rows: {_INDEX_FIX}")
        if start != row:
            if start < row:
                problem = f"overlap the rows before them (which end at row {row - 1})"
            else:
                problem = f"leave rows {row}..{start - 1} out"
            raise ValueError(f"{where}: its rows {start}..{end - 1} {problem}: {_INDEX_FIX}")
        if end > index["num_rows"]:
            raise ValueError(
                f"{where} ends at row {end}, past the folder's `num_rows` {index['num_rows']}: {_INDEX_FIX}"
            )
        if not (isinstance(lengths, list) and len(lengths) == end - start and all(map(_is_count, lengths))):
            raise ValueError(f"{where}: `lengths` is not the list of its {end - start} rows' lengths: {_INDEX_FIX}")
        files.append(file)
        row = end
    return files


def _check_shard_tensors(path: Path, number: int, file: Path, index: dict[str, Any]) -> None:
    """Raise a `ValueError` naming `path` and the shard entry unless its file holds every row's tensors at the width
    the index records (`width`, and the target's hidden size for final hidden states)."""
    shard = index["shards"][number]
    where = _entry(path, number, shard)
    try:
        with safe_open(str(file), framework="pt") as handle:
            shapes = {name: handle.get_slice(name).get_shape() for name in handle.keys()}
    except (OSError, SafetensorError) as err:
        raise ValueError(f"{where}: its file cannot be read as a safetensors shard ({err}): {_INDEX_FIX}") from err
    widths = {"": index["width"]}
    if index.get("final_hidden", False):
        widths[".final"] = index["width"] // len(index["target_layer_ids"])
    for row in range(shard["start"], shard["end"]):
        for suffix, width in widths.items():
            shape = shapes.get(f"{row}{suffix}")
            if shape is None or len(shape) != 2 or shape[1] != width:
                found = "no such tensor" if shape is None else f"shape {tuple(shape)}"
                raise ValueError(
                    f"{where}: its tensor '{row}{suffix}' should be (tokens, {width}) for the recorded width "
                    f"{index['width']} and taps {index['target_layer_ids']}, found {found}: {_INDEX_FIX}"
                )


def shard_path(features_dir: str | os.PathLike, shard: dict[str, Any]) -> Path:
    """The file of an indexed shard, known to lie inside the features folder."""
    return path_inside(features_dir, shard["file"], f"{Path(features_dir) / INDEX_NAME} (a shard)", _INDEX_FIX)


def _fingerprint(seqs: list[list[int]]) -> str:
    """sha256 of the (truncated) token ids of consecutive rows, with each row's length, as hex."""
    digest = hashlib.sha256()
    for seq in seqs:
        digest.update(len(seq).to_bytes(4, "little"))
        digest.update(torch.tensor(seq, dtype=torch.int32).numpy().tobytes())
    return digest.hexdigest()


def _row_ids(dataset, row: int, max_length: int) -> list[int]:
    return list(dataset[row]["input_ids"])[:max_length]


def _check_stored_rows(out: Path, index: dict[str, Any], dataset) -> None:
    """Raise unless every stored shard was made from the same rows of `dataset` (fingerprint, or lengths for shards
    written before fingerprints existed)."""
    covered = index["shards"][-1]["end"] if index["shards"] else 0
    if covered > len(dataset):
        raise ValueError(
            f"{out} holds features for {covered} rows but the dataset has {len(dataset)}: the folder was made from "
            "another dataset; use another --out folder."
        )
    max_length = int(index["max_length"])
    for shard in index["shards"]:
        seqs = [_row_ids(dataset, i, max_length) for i in range(shard["start"], shard["end"])]
        stored = shard.get("fingerprint")
        same = stored == _fingerprint(seqs) if stored else [len(s) for s in seqs] == list(shard["lengths"])
        if not same:
            raise ValueError(
                f"{out}/{shard['file']} was made from other rows (rows {shard['start']}..{shard['end'] - 1} differ "
                "from the dataset): use another --out folder for this dataset."
            )


def open_index(out: Path, settings: dict[str, Any], dataset, drop_extra_rows: bool = False) -> dict[str, Any]:
    """The index of `out`: a new one, or the stored one once its settings and rows are known to match `dataset` (any
    sequence of rows with `input_ids`). With `drop_extra_rows`, shards past the end of `dataset` are removed first
    (make-data writes a batch's shard before its part)."""
    if (out / INDEX_NAME).is_file():
        index = read_index(out)
        for key in ("target_layer_ids", "width", "max_length", "final_hidden", "first_row"):
            if index.get(key, _INDEX_DEFAULTS.get(key)) != settings[key]:
                raise ValueError(
                    f"{out} holds features made with {key}={index.get(key)!r}, not {settings[key]!r}: use another "
                    "--out folder (or the same settings to resume)."
                )
        while drop_extra_rows and index["shards"] and index["shards"][-1]["end"] > len(dataset):
            shard_path(out, index["shards"][-1]).unlink(missing_ok=True)
            index["shards"].pop()
            _write_index(out, index)
        _check_stored_rows(out, index, dataset)
        if index["num_rows"] != len(dataset):
            index["num_rows"] = len(dataset)
            _write_index(out, index)
    else:
        index = {**settings, "shards": []}
        _write_index(out, index)
    remove_leftovers(out, (".shard-*.tmp", SAFETENSORS_TEMPORARY))  # of a killed shard write
    return index


def settings_of(
    target,
    adapter,
    target_layer_ids: list[int],
    target_name: str | None,
    max_length: int,
    final_hidden: bool,
    num_rows: int,
    first_row: int = 0,
) -> dict[str, Any]:
    """The settings recorded in a features folder's index (`first_row`: the rows before it are not cached)."""
    return {
        "format": FEATURES_FORMAT,
        "target": target_name,
        "target_model_type": getattr(target.config, "model_type", None),
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "hidden_size": adapter.hidden_size,
        "width": adapter.hidden_size * len(target_layer_ids),
        "dtype": "bfloat16",
        "max_length": int(max_length),
        "final_hidden": bool(final_hidden),
        "num_rows": num_rows,
        "first_row": int(first_row),
    }


class ShardWriter:
    """Collects the tensors of consecutive rows and publishes them as shards: each shard file is renamed into place,
    then the index is rewritten to include it (both atomically)."""

    def __init__(self, out: Path, index: dict[str, Any]) -> None:
        self.out, self.index = out, index
        self.end = index["shards"][-1]["end"] if index["shards"] else int(index.get("first_row", 0))  # next row
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.pending_seqs: list[list[int]] = []

    def add(self, tensors: dict[str, torch.Tensor], seqs: list[list[int]]) -> None:
        """Queue the tensors of the next `len(seqs)` rows (their token ids, for the shard's fingerprint)."""
        self.pending.update(tensors)
        self.pending_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.pending_seqs.extend(seqs)

    def flush(self, end: int) -> None:
        """Publish the queued rows (up to row `end`) as one shard."""
        if not self.pending:
            return
        name = f"shard-{len(self.index['shards']):05d}.safetensors"
        tensors = self.pending
        atomic_write(self.out / name, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FEATURES_FORMAT}))
        set_ordinary_mode(self.out / name)
        self.index["shards"].append(
            {
                "file": name,
                "start": self.end,
                "end": end,
                "lengths": [len(s) for s in self.pending_seqs],
                "fingerprint": _fingerprint(self.pending_seqs),
            }
        )
        self.index["num_rows"] = max(int(self.index["num_rows"]), end)
        _write_index(self.out, self.index)
        self.end = end
        self.pending, self.pending_bytes, self.pending_seqs = {}, 0, []


def features_of_batch(adapter, rows: list[int], seqs: list[list[int]], final_hidden: bool) -> dict[str, torch.Tensor]:
    """One target forward over a right-padded batch: the bf16 tensors to store, by name (`"{row}"`, `"{row}.final"`)."""
    from transformers.cache_utils import DynamicCache

    device = next(adapter.target.parameters()).device
    ids = pad([torch.tensor(s, dtype=torch.long) for s in seqs]).to(device)
    mask = pad([torch.ones(len(s), dtype=torch.long) for s in seqs]).to(device)
    positions = torch.arange(ids.shape[1], device=device)[None].expand(len(seqs), -1)
    step = adapter.forward(ids, mask, positions, DynamicCache())
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

    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if "input_ids" not in dataset.column_names:
        raise ValueError(f"The dataset has no `input_ids` column (columns: {dataset.column_names}).")
    if not 0 <= first_row < len(dataset):
        raise ValueError(f"first_row must be in 0..{len(dataset) - 1} (the dataset's rows), got {first_row}.")
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
            seqs = [_row_ids(dataset, i, max_length) for i in rows]
            writer.add(features_of_batch(adapter, rows, seqs, final_hidden), seqs)
            row = rows[-1] + 1
            bar.update(len(rows))
            if writer.pending_bytes >= shard_bytes:
                writer.flush(row)
        writer.flush(row)
    return writer.index


def features_folders(features_dir: str | os.PathLike | list) -> list[Path]:
    """The features folder(s) named by `features_dir`: one path, a list, or paths separated by commas."""
    if isinstance(features_dir, (list, tuple)):
        return [Path(p) for p in features_dir]
    return [Path(p.strip()) for p in str(features_dir).split(",") if p.strip()]


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
            if list(index["target_layer_ids"]) != taps:
                raise ValueError(
                    f"The features in {folder} tap target layers {index['target_layer_ids']} but the drafter uses "
                    f"{taps}: recache with --target-layer-ids {' '.join(map(str, taps))} or train with "
                    "features='online'."
                )
            first = int(index.get("first_row", 0))
            covered = index["shards"][-1]["end"] if index["shards"] else first
            needed = range(max(rows_read.start - start, 0), min(rows_read.stop - start, int(index["num_rows"])))
            if needed and not first <= needed.start < needed.stop <= covered:
                raise ValueError(
                    f"The features in {folder} cover its rows {first}..{covered - 1} (of {index['num_rows']}) but "
                    f"this run reads rows {needed.start}..{needed.stop - 1}: finish (rerun) `dflash-hf cache-features` "
                    "on its dataset (with a --first-row no later than skip_train_samples), or change "
                    "skip_train_samples / max_train_samples."
                )
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
