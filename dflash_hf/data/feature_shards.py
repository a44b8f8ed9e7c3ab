"""Writing a features folder: shards published one at a time, and the index of a folder being resumed or extended.

Shards are written to a temporary name and renamed into place, then `index.json` is rewritten (also atomically), so
a killed run loses at most the shard in progress. Every stored shard carries a fingerprint of its rows' token ids,
checked against the dataset before a folder is reused, so a dataset that grew at the end is extended in place.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..fileio import SAFETENSORS_TEMPORARY, atomic_write, remove_leftovers, set_ordinary_mode
from .feature_index import FEATURES_FORMAT, INDEX_DEFAULTS, INDEX_NAME, next_row, read_index, shard_path, write_index


def _fingerprint(seqs: list[list[int]]) -> str:
    """sha256 of the (truncated) token ids of consecutive rows, with each row's length, as hex."""
    digest = hashlib.sha256()
    for seq in seqs:
        digest.update(len(seq).to_bytes(4, "little"))
        digest.update(torch.tensor(seq, dtype=torch.int32).numpy().tobytes())
    return digest.hexdigest()


def row_ids(dataset, row: int, max_length: int) -> list[int]:
    """The token ids of `dataset[row]` as stored: at most `max_length`."""
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
        seqs = [row_ids(dataset, i, max_length) for i in range(shard["start"], shard["end"])]
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
            if index.get(key, INDEX_DEFAULTS.get(key)) != settings[key]:
                raise ValueError(
                    f"{out} holds features made with {key}={index.get(key)!r}, not {settings[key]!r}: use another "
                    "--out folder (or the same settings to resume)."
                )
        while drop_extra_rows and index["shards"] and index["shards"][-1]["end"] > len(dataset):
            shard_path(out, index["shards"][-1]).unlink(missing_ok=True)
            index["shards"].pop()
            write_index(out, index)
        _check_stored_rows(out, index, dataset)
        if index["num_rows"] != len(dataset):
            index["num_rows"] = len(dataset)
            write_index(out, index)
    else:
        index = {**settings, "shards": []}
        write_index(out, index)
    remove_leftovers(out, (".shard-*.tmp", SAFETENSORS_TEMPORARY))  # of a killed shard write
    return index


class ShardWriter:
    """Collects the tensors of consecutive rows and publishes them as shards: each shard file is renamed into place,
    then the index is rewritten to include it (both atomically)."""

    def __init__(self, out: Path, index: dict[str, Any]) -> None:
        self.out, self.index = out, index
        self.end = next_row(index)
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
        write_index(self.out, self.index)
        self.end = end
        self.pending, self.pending_bytes, self.pending_seqs = {}, 0, []
