"""File-system helpers shared by the writers (exports, checkpoints, caches, feature shards)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# pickled weight files: never written, uploaded or opened (the drafter's remote code keeps its own list: it must run
# without this package)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# What `open(path, "w")` gives a new file. safetensors writes its files 0600 (through a temporary file), which would
# make published weights unreadable to everyone but their owner while the config and card next to them are not.
FILE_MODE = 0o666 & ~_umask()


def set_ordinary_mode(path: str | os.PathLike) -> None:
    """Give the file `path`, or every file under the folder `path`, the ordinary mode `FILE_MODE`."""
    path = Path(path)
    for file in path.rglob("*") if path.is_dir() else [path]:
        if file.is_file() and not file.is_symlink():
            file.chmod(FILE_MODE)


def discard(path: str | os.PathLike) -> None:
    """Move `path` aside (atomic, to a hidden sibling) and delete it, so a half-deleted folder never keeps its name."""
    path = Path(path)
    if not path.exists():
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale-", dir=path.parent))
    path.rename(trash / path.name)
    shutil.rmtree(trash, ignore_errors=True)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Write the file `path` through its hidden sibling `.NAME.tmp`: `write(temporary)` fills it, it is flushed to
    disk and renamed into place, so `path` is either absent, the old file or the complete new one."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        write(temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """[`atomic_write`] of a UTF-8 text file."""
    atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def atomic_write_folder(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Write the folder `path` through its hidden sibling `.NAME.partial`: `write(staging)` fills it, then it replaces
    `path` (an old `path` is moved aside first and put back if the swap fails), so `path` is either absent, the old
    folder or the complete new one. Leftovers of an interrupted earlier write are removed first."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial")
    previous = path.with_name(f".{path.name}.previous")
    for leftover in (staging, previous):
        shutil.rmtree(leftover, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    try:
        write(staging)
        if path.exists():
            os.replace(path, previous)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if previous.exists() and not path.exists():
            os.replace(previous, path)
        raise
    shutil.rmtree(previous, ignore_errors=True)
