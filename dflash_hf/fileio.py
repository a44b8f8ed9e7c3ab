"""File-system helpers shared by the writers (exports, checkpoints, caches, feature shards), and where the dflash-hf
cache lives."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# pickled weight files: never written, uploaded or opened (the drafter's remote code keeps its own list: it must run
# without this package)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# the temporary file safetensors' `save_file` writes next to its target and renames (a killed write leaves it)
SAFETENSORS_TEMPORARY = ".tmp??????"
CACHE_ENV = "DFLASH_HF_CACHE"  # the environment variable naming the dflash-hf cache folder ([`cache_dir`])


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


def _private_folder(path: Path, suffix: str) -> Path:
    """A new folder `.NAME.<random>.<pid>@<host><suffix>` beside `path`, created exclusively and private to this user
    (mode 0700), so no other entry planted in the parent folder (a link at a guessable name) is ever written through;
    its name says which process writes it ([`remove_leftovers`] keeps it while that process runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = f".{os.getpid()}@{socket.gethostname()}"
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=writer + suffix, dir=path.parent))


def _writer_gone(name: str) -> bool:
    """Whether the process named in the name of a private folder of [`_private_folder`] has ended: it ran on this
    machine and no longer does. A name without a writer (safetensors' own temporary) counts as gone; a writer on
    another machine, or on a system where this cannot be told, is taken as running."""
    match = re.fullmatch(r".*\.(\d+)@(.*)\.[a-z]+", name)
    if match is None:
        return True
    pid = int(match[1])
    if match[2] != socket.gethostname() or os.name == "nt" or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except (ProcessLookupError, OverflowError):
        return True
    except PermissionError:  # another user's process
        return False
    return False


def _remove(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a folder."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Write the file `path` through a temporary file `NAME` inside a new private folder beside it
    (`.NAME.<random>.<pid>@<host>.tmp`): `write(temporary)` fills it, it is flushed to disk and renamed into place, so
    `path` is either absent, the old file or the complete new one. A link at `path` is replaced, never written through; leftovers of a killed
    earlier write of `path` are removed first (another write of `path` still running keeps its own, and the last to
    finish gives `path`)."""
    path = Path(path)
    remove_leftovers(path.parent, (f".{glob.escape(path.name)}.*.*@*.tmp",))  # of a killed earlier write (only its own)
    folder = _private_folder(path, ".tmp")
    temporary = folder / path.name
    try:
        write(temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        temporary.chmod(FILE_MODE)
        os.replace(temporary, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """[`atomic_write`] of a UTF-8 text file."""
    atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def atomic_write_folder(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Write the folder `path` through a new private staging folder beside it: `write(staging)` fills it, then it
    replaces `path` (an old `path` is moved aside first and put back if the swap fails), so `path` is either absent,
    the old folder or the complete new one. Leftovers of an interrupted earlier write are removed first (another
    write of `path` still running keeps its own)."""
    path = Path(path)
    name = glob.escape(path.name)
    remove_leftovers(path.parent, (f".{name}.*partial", f".{name}.*previous"))
    staging = _private_folder(path, ".partial")
    staging.chmod(0o777 & ~_umask())  # it becomes `path`: the mode of an ordinary new folder
    holder = _private_folder(path, ".previous")
    previous = holder / path.name
    try:
        write(staging)
        if path.exists() or path.is_symlink():
            os.replace(path, previous)
        os.replace(staging, path)
    except BaseException:
        _remove(staging)
        if (previous.exists() or previous.is_symlink()) and not path.exists():
            os.replace(previous, path)
        raise
    finally:
        _remove(holder)


def path_inside(folder: str | os.PathLike, name: str, named_by: str, fix: str) -> Path:
    """`folder / name`, once it is known to resolve (links followed) to a path inside `folder`; else a `ValueError`
    saying that `named_by` names a path outside the folder, and `fix`."""
    folder = Path(folder)
    root = folder.resolve()
    resolved = (folder / name).resolve() if isinstance(name, str) and name else root
    if resolved == root or not resolved.is_relative_to(root):
        raise ValueError(f"{named_by} names {name!r}, which is not a path inside {folder}: {fix}")
    return folder / name


def read_json(path: str | os.PathLike, fix: str) -> Any:
    """The JSON value of the UTF-8 file `path`; a `ValueError` naming the file and `fix` when it is not valid JSON
    (also when it is not UTF-8 or nested too deeply to decode)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): {fix}") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): {fix}") from err
    except RecursionError as err:
        raise ValueError(f"{path} is nested too deeply to be a JSON file this package writes: {fix}") from err


def remove_leftovers(folder: str | os.PathLike, patterns: Iterable[str]) -> None:
    """Delete the entries of `folder` matching the glob `patterns` (files, links and the private folders of
    [`atomic_write`]): temporary files of a killed earlier write. A private folder whose writer still runs is kept."""
    for pattern in patterns:
        for leftover in Path(folder).glob(pattern):
            if _writer_gone(leftover.name):
                _remove(leftover)


def shard_size_bytes(size: int | str, named_by: str) -> int:
    """`size` in bytes as `save_pretrained` reads it (bytes, or digits with a unit: `"15MB"`, `"1.5GB"`); a
    `ValueError` naming `named_by` (the option) unless it is a positive size."""
    from huggingface_hub.serialization._base import parse_size_to_int  # the parser of `save_pretrained`

    value, reason = (size if isinstance(size, int) and not isinstance(size, bool) else None), ""
    if isinstance(size, str):
        try:
            value = parse_size_to_int(size)
        except (ValueError, OverflowError) as err:
            reason = f" ({err})"
    if value is None or value < 1:
        raise ValueError(
            f"{named_by} {size!r} is no size: give a positive number with a unit KB, MB, GB or TB, e.g. 15MB{reason}."
        )
    return value


def cache_dir() -> Path:
    """Root of the dflash-hf cache: `$DFLASH_HF_CACHE`, else `$XDG_CACHE_HOME/dflash-hf`, else `~/.cache/dflash-hf`."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dflash-hf"
