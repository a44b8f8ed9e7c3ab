"""File-system helpers shared by the writers (exports, checkpoints, caches, feature shards)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


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
