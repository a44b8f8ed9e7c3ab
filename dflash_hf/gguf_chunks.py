"""GGUF files shipped on PyPI as plain byte chunks: one package a chunk, concatenated and checked before use.

Such packages carry no checksum of their own, so a [`ChunkedGGUF`] pins every package version and the assembled
file's size and sha256: [`ChunkedGGUF.assemble`] refuses a missing part, a part of another version and a file of the
wrong size or hash, each with a `ValueError` naming the fix (also for a destination it cannot write), and writes
nothing under the final name unless it is the exact file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.utils import tqdm  # hidden with the Hub's bars (`--quiet`)

from .fileio import atomic_write


def package_folder(module: str) -> Path | None:
    """Folder of an installed package, found without importing it (weight packages may import heavy plugins), or
    `None` when it is not installed."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed_version(distribution: str) -> str | None:
    """Installed version of a pip distribution, or `None` when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class ChunkPart:
    """One chunk package: its pip distribution, its import name and the chunk file inside it."""

    distribution: str
    module: str
    file: str

    def path(self) -> Path | None:
        """The chunk file of the installed package, or `None` when it is missing."""
        folder = package_folder(self.module)
        path = None if folder is None else folder / self.file
        return path if path is not None and path.is_file() else None

    def version(self) -> str | None:
        return installed_version(self.distribution)


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split over pinned chunk packages.

    Attributes:
        file_name: Name of the assembled file.
        version: The version every chunk package must have.
        parts: The chunks in file order.
        size: Size in bytes of the assembled file.
        sha256: Hex digest of the assembled file.
        extra: The `dflash-hf` extra that installs the chunk packages (named in the error of a missing one).
    """

    file_name: str
    version: str
    parts: tuple[ChunkPart, ...]
    size: int
    sha256: str
    extra: str

    @classmethod
    def numbered(
        cls,
        file_name: str,
        distribution: str,
        module: str,
        count: int,
        version: str,
        size: int,
        sha256: str,
        extra: str,
    ) -> "ChunkedGGUF":
        """Chunks `<distribution>N` (module `<module>N`, file `data/partNN.bin`) for N = 1..count."""
        parts = tuple(
            ChunkPart(f"{distribution}{n}", f"{module}{n}", f"data/part{n:02d}.bin") for n in range(1, count + 1)
        )
        return cls(file_name, version, parts, size, sha256, extra)

    def requirements(self) -> list[str]:
        """The pinned requirements of the chunk packages (`name==version`)."""
        return [f"{part.distribution}=={self.version}" for part in self.parts]

    def _fix(self) -> str:
        return f'install the pinned chunks: `pip install "dflash-hf[{self.extra}]"`'

    def part_paths(self) -> list[Path]:
        """The installed chunk files in order; a `ValueError` naming the first missing or mismatched package."""
        paths = []
        for number, part in enumerate(self.parts, start=1):
            version = part.version()
            path = part.path()
            if path is None or version is None:
                raise ValueError(
                    f"Part {number} of {len(self.parts)} of {self.file_name} is missing (package `{part.distribution}`, "
                    f"file {part.file}): {self._fix()}."
                )
            if version != self.version:
                raise ValueError(
                    f"Part {number} of {self.file_name} is `{part.distribution}` {version}, not the pinned "
                    f"{self.version}: {self._fix()}."
                )
            paths.append(path)
        return paths

    def assemble(self, folder: str | os.PathLike, progress: bool = True) -> Path:
        """Concatenate the chunks into `folder/file_name` after checking the result's size and sha256; returns the
        path. The file is hashed as it is written and renamed into place only when it is the exact file; an intact
        file already there is reused (its hash is checked again)."""
        final = Path(folder) / self.file_name
        if final.is_file() and final.stat().st_size == self.size and sha256_of([final]) == self.sha256:
            return final
        paths = self.part_paths()
        total = sum(path.stat().st_size for path in paths)
        if total != self.size:
            raise ValueError(
                f"The chunks of {self.file_name} add up to {total:,} bytes, not {self.size:,}: a chunk is damaged; "
                f'reinstall them: `pip install --force-reinstall "dflash-hf[{self.extra}]"`.'
            )

        def write(temporary: Path) -> None:
            digest = _concatenate(paths, temporary, f"Assembling {self.file_name}" if progress else None)
            if digest != self.sha256:
                raise ValueError(
                    f"The chunks of {self.file_name} assemble to sha256 {digest}, not {self.sha256}: a chunk is "
                    f"damaged or of another upload; reinstall them: "
                    f'`pip install --force-reinstall "dflash-hf[{self.extra}]"`.'
                )

        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(final, write)
        except OSError as err:  # read-only or full disk, a folder at the file's name, a file at the folder's
            raise ValueError(
                f"Cannot write {final} ({err.strerror or err}): {final.parent} must be a writable folder with "
                f"{self.size:,} bytes free and no folder named {self.file_name}; fix that, or choose another folder "
                "(named targets: set DFLASH_HF_CACHE)."
            ) from err
        return final


def _read(paths: list[Path], desc: str | None) -> Iterator[bytes]:
    """The bytes of the files of `paths` one after another, in blocks (a progress bar when `desc` is given)."""
    total = sum(path.stat().st_size for path in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=desc is None) as bar:
        for path in paths:
            with path.open("rb") as handle:
                while block := handle.read(1 << 22):
                    bar.update(len(block))
                    yield block


def _concatenate(paths: list[Path], destination: Path, desc: str | None = None) -> str:
    """Write the files of `paths` one after another into the new file `destination`; returns the sha256 written."""
    digest = hashlib.sha256()
    with destination.open("xb") as out:
        for block in _read(paths, desc):
            digest.update(block)
            out.write(block)
    return digest.hexdigest()


def sha256_of(paths: list[Path], desc: str | None = None) -> str:
    """The sha256 of the files of `paths` read one after another (a progress bar when `desc` is given)."""
    digest = hashlib.sha256()
    for block in _read(paths, desc):
        digest.update(block)
    return digest.hexdigest()
