"""The features folder format of `dflash-hf cache-features`: its `index.json`, read back and checked.

    FEATURES_DIR/
        index.json                 # format, target, target_layer_ids, width, row count, shards [{file, start, end, lengths, fingerprint}]
        shard-00000.safetensors    # per row: "{row}" (length, k * H) and, with final hidden states, "{row}.final" (length, H)
        ...

Every shard entry names its own file inside the folder; the entries cover consecutive rows from `first_row`, and
each file holds every row's tensors at the recorded width. Readers rely on all of it, so [`read_index`] checks it
before anything is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from ..fileio import atomic_write_text, path_inside, read_json
from ..target.support import text_config

FEATURES_FORMAT = "dflash-hf-features/1"
INDEX_NAME = "index.json"
_INDEX_FIX = "the index is not one `dflash-hf cache-features` writes; recreate the features folder."


def write_index(out: Path, index: dict[str, Any]) -> None:
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
INDEX_DEFAULTS = {"final_hidden": False, "first_row": 0}  # indexes written before these settings existed


def _check_index_settings(path: Path, index: dict[str, Any]) -> None:
    """Raise a `ValueError` naming `path` unless the settings of `index` have the types its readers rely on."""
    for key, (valid, wanted) in _INDEX_FIELDS.items():
        value = index.get(key, INDEX_DEFAULTS.get(key))
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


def next_row(index: dict[str, Any]) -> int:
    """The row after the last indexed shard's (`first_row` when none is indexed yet)."""
    return index["shards"][-1]["end"] if index["shards"] else int(index.get("first_row", 0))


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
        "target_model_type": text_config(target).model_type,
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "hidden_size": adapter.hidden_size,
        "width": adapter.hidden_size * len(target_layer_ids),
        "dtype": "bfloat16",
        "max_length": int(max_length),
        "final_hidden": bool(final_hidden),
        "num_rows": num_rows,
        "first_row": int(first_row),
    }
