"""The cache of a named target: its GGUF read once, dequantized to float32 and stored as a plain safetensors
checkpoint (model, generation config and tokenizer) in `<cache>/targets/<name>`.

The cache is written in a temporary sibling folder and renamed into place only once complete; its last file is
`dflash_hf_cache.json`, which lists the size and sha256 of every file. A folder without that marker, with a file
missing, resized or altered, or built from another version of the source package is never loaded: it is rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .fileio import cache_dir, discard, path_inside, set_ordinary_mode
from .gguf_chunks import installed_version, sha256_of
from .special_tokens import configure_generation

MARKER_FILE = "dflash_hf_cache.json"
_MAX_MARKER_BYTES = 1 << 20  # a marker lists a few files: far below this
CACHE_FORMAT = 1

SourceLoader = Callable[[Path], tuple[PreTrainedModel, PreTrainedTokenizerBase]]
"""Builds the float32 model and its tokenizer for a named target; gets an empty scratch folder it may write into."""


@dataclass(frozen=True)
class TargetSpec:
    """A named target: where its weights come from and how to turn them into a Transformers model.

    Attributes:
        name: Name accepted by [`load_target`] and `dflash-hf generate --target`.
        description: One line for listings and error messages.
        distribution: The pip distribution that ships the weights; its version is recorded in the cache so that an
            upgrade of the package rebuilds the cache.
        load_source: Builds `(model, tokenizer)` in float32 from the packaged weights (the slow step the cache
            saves); receives a scratch folder that is deleted afterwards.
        hub_id: The model's id on the Hugging Face Hub (the `base_model` of exported model cards).
        gguf_file: Finds (or assembles into the scratch folder it receives) the packaged GGUF file, the one
            llama.cpp serves (`dflash-hf export --format gguf` reads its tokenizer and LM head from it).
    """

    name: str
    description: str
    distribution: str
    load_source: SourceLoader
    hub_id: str | None = None
    gguf_file: Callable[[Path], Path] | None = None

    def source_version(self) -> str | None:
        """Installed version of `distribution`, or `None` when it is not installed."""
        return installed_version(self.distribution)


def _source_record(spec: TargetSpec) -> dict[str, str | None]:
    return {"distribution": spec.distribution, "version": spec.source_version()}


def cache_problem(directory: str | Path, spec: TargetSpec) -> str | None:
    """Why the cached folder of `spec` cannot be used (`None` when it is complete and intact).

    Checks the completion marker, the recorded source package version, and the size and sha256 of every file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return "not built yet"
    path = directory / MARKER_FILE
    if not path.exists():
        return "incomplete (no completion marker)"
    if not path.is_file() or path.stat().st_size > _MAX_MARKER_BYTES:  # a FIFO would block the read
        return "unreadable completion marker"
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return "unreadable completion marker"
    if not isinstance(marker, dict) or marker.get("format") != CACHE_FORMAT or marker.get("target") != spec.name:
        return "completion marker of another format or target"
    source = _source_record(spec)
    if source["version"] is not None and marker.get("source") != source:
        return f"built from {marker.get('source')}, installed source is {source}"
    files = marker.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return "completion marker lists no model files"
    for name, expected in files.items():
        try:
            path = path_inside(directory, name, MARKER_FILE, "rebuild the cache.")
        except ValueError:
            return f"completion marker names {name!r}, outside the folder"
        if not isinstance(expected, dict):
            return f"completion marker has no size and sha256 of {name}"
        if not path.is_file():
            return f"missing file {name}"
        if path.stat().st_size != expected.get("size"):
            return f"{name} has the wrong size"
        if sha256_of([path]) != expected.get("sha256"):
            return f"{name} is corrupt (sha256 mismatch)"
    return None


def _prepare_for_saving(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Turn a dequantized GGUF model into a plain checkpoint: drop the quantizer, fix the generation config."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    configure_generation(model, tokenizer)


def _write_marker(directory: Path, spec: TargetSpec) -> None:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_of([path])}
    marker = {
        "format": CACHE_FORMAT,
        "target": spec.name,
        "description": spec.description,
        "source": _source_record(spec),
        "transformers_version": transformers.__version__,
        "files": files,
    }
    # written last: its presence means every file above is complete
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


@contextlib.contextmanager
def _gguf_reader_bar(shown: bool):
    """Transformers' GGUF reader shows a bar per tensor through a plain `tqdm`, which its own progress-bar switch does
    not reach: within this block it is hidden unless `shown`."""
    from transformers import modeling_gguf_pytorch_utils as reader

    if shown:
        yield
        return
    bar = reader.tqdm
    reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        reader.tqdm = bar


def build_cache(spec: TargetSpec, final: Path, progress: bool) -> None:
    """Build the cache of `spec` into `final`, with a progress bar unless `progress` is false."""
    final.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{spec.name}.building-", dir=final.parent))
    try:
        with tqdm(total=3, desc=f"Caching target {spec.name}", unit="step", disable=not progress) as bar:
            scratch = building / "scratch"
            scratch.mkdir()
            output = building / "model"
            bar.set_postfix_str("dequantizing (30-100 s)")
            with _gguf_reader_bar(progress):
                model, tokenizer = spec.load_source(scratch)
            shutil.rmtree(scratch)
            bar.update()
            bar.set_postfix_str("saving safetensors")
            _prepare_for_saving(model, tokenizer)
            model.save_pretrained(output)
            tokenizer.save_pretrained(output)
            set_ordinary_mode(output)
            del model
            bar.update()
            bar.set_postfix_str("checksums")
            _write_marker(output, spec)
            discard(final)
            try:
                output.rename(final)
            except OSError:
                # another process installed its copy between the two calls: keep it if it is intact
                if cache_problem(final, spec) is not None:
                    raise
            bar.update()
    finally:
        shutil.rmtree(building, ignore_errors=True)


def cached_target_dir(spec: TargetSpec, rebuild: bool = False, progress: bool = True) -> Path:
    """`<cache>/targets/<name>` of `spec`, built (or rebuilt: `rebuild`, or not intact) first; `progress` shows the
    build's progress bar."""
    final = cache_dir() / "targets" / spec.name
    if rebuild or cache_problem(final, spec) is not None:
        build_cache(spec, final, progress)
        problem = cache_problem(final, spec)
        if problem is not None:
            raise ValueError(
                f"The freshly built cache at {final} failed verification ({problem}); delete it and retry."
            )
    return final
