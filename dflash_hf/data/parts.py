"""The parts of a make-data folder: one gzipped JSONL file of rows per finished batch, append-only.

Each part is written atomically (temporary name + rename) and never rewritten, so a folder resumes after its last
finished part and grows by new ones (plain `.jsonl` parts are read too). Reading checks every row: a damaged part,
or one made with another target (token ids outside its vocabulary), is named with the way out.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Any

from ..fileio import atomic_write

# how to recover from a part that cannot be resumed
_PART_FIX = (
    "move it out of the parts folder and rerun make-data with the same settings (parts are append-only: the rerun "
    "makes its rows again), or pass a new --out folder."
)


def part_files(parts_dir: Path) -> list[Path]:
    """The finished parts of a make-data folder in order: `part-NNNNNN.jsonl.gz`, or plain `.jsonl` (older folders)."""
    return sorted([*parts_dir.glob("part-*.jsonl.gz"), *parts_dir.glob("part-*.jsonl")], key=lambda path: path.name)


def part_path(parts_dir: Path, number: int) -> Path:
    """The file of part `number`."""
    return parts_dir / f"part-{number:06d}.jsonl.gz"


def next_part_number(parts_dir: Path) -> int:
    """The number after the highest finished part's (a missing part's number is never given again)."""
    numbers = [int(match.group(1)) for part in part_files(parts_dir) if (match := re.match(r"part-(\d+)\.", part.name))]
    return max(numbers, default=-1) + 1


def read_parts(parts_dir: Path, vocab_size: int | None = None) -> list[dict]:
    """The records of every finished part, in part order; a `ValueError` naming the part when one is damaged or (with
    `vocab_size`, the target's) holds token ids outside the target's vocabulary."""
    records = []
    for part in part_files(parts_dir):
        records.extend(_part_record(part, line_no, line, vocab_size) for line_no, line in _part_lines(part))
    return records


def write_part(path: Path, records: list[dict]) -> None:
    """Write one finished part atomically, gzipped with a fixed header (the same records give the same bytes); parts
    are append-only, so an existing part is never replaced."""
    if path.exists() or path.is_symlink():
        raise ValueError(f"{path} exists: make-data parts are append-only and never rewritten; move it away to retry.")
    data = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")
    atomic_write(path, lambda temporary: temporary.write_bytes(gzip.compress(data, mtime=0)))


def _part_lines(part: Path) -> list[tuple[int, str]]:
    """The non-blank lines of a part file with their numbers; a `ValueError` naming it when it cannot be read."""
    try:
        with (gzip.open if part.suffix == ".gz" else open)(part, "rt", encoding="utf-8") as fh:
            lines = list(fh)
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as err:  # truncated, not gzip, not UTF-8
        raise ValueError(f"{part} cannot be read ({err}): the part is damaged; {_PART_FIX}") from err
    return [(line_no, line) for line_no, line in enumerate(lines, start=1) if line.strip()]


def _part_record(part: Path, line_no: int, line: str, vocab_size: int | None) -> dict:
    """The record on line `line_no` of `part`, once it is a make-data row of the target's vocabulary `vocab_size`."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{part}:{line_no} is not valid JSON: the part is damaged; {_PART_FIX}") from err
    problem = _record_problem(record, vocab_size)
    if problem is not None:
        raise ValueError(f"{part}:{line_no}: {problem}; {_PART_FIX}")
    return record


def _record_problem(record: Any, vocab_size: int | None) -> str | None:
    """What keeps `record` from being a make-data row (`id`, `input_ids` of the vocabulary `vocab_size`,
    `prompt_length` within them), or `None`."""
    if not isinstance(record, dict):
        return f"the record is a JSON {type(record).__name__}, not an object (the part is damaged)"
    if not isinstance(record.get("id"), str):
        return "the record has no string `id` (the part is damaged)"
    ids = record.get("input_ids")
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
        return f"record {record['id']!r} has no `input_ids` list of token ids (the part is damaged)"
    length = record.get("prompt_length")
    if type(length) is not int or not 0 <= length <= len(ids):
        return f"record {record['id']!r} has no `prompt_length` in 0..{len(ids)} (the part is damaged)"
    low, high = min(ids, default=0), max(ids, default=0)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        vocabulary = (
            "token ids are never negative" if low < 0 else f"its {vocab_size} token ids are 0..{vocab_size - 1}"
        )
        return (
            f"record {record['id']!r} holds token id {low if low < 0 else high}, outside the target's vocabulary "
            f"({vocabulary}): the part was made with another target"
        )
    return None
