"""Export a DFlash drafter as a Hub-ready folder.

    >>> dflash_hf.export(drafter, "out/my-drafter", target=target, metrics=bench_rows)
    >>> dflash_hf.export(drafter, "out/my-drafter-official", target=target, format="official")  # SGLang / vLLM
    >>> dflash_hf.export(drafter, "out/my-drafter-speculators", target=target, format="speculators")  # vLLM speculators
    >>> dflash_hf.export(drafter, "out/my-drafter.gguf", target="smollm2-135m", format="gguf")  # llama.cpp

The folder holds `config.json` (with `auto_map`), `model.safetensors`, the remote code (which imports only torch and
transformers) and a `README.md` model card rendered from `dflash_hf.hub_cards`; the speculators layout holds its
config, weights (with the draft vocabulary's head rows, `d2t` and `t2d`) and the card, no remote code
(`dflash_hf.hub.speculators`). It is written into a hidden staging
folder next to `out_dir` and renamed into place only when complete, so an interrupted export never leaves a folder
that looks finished. The GGUF format is one file for llama.cpp, written by `dflash_hf.hub.gguf`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import metadata_load, try_to_load_from_cache
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

from ..fileio import atomic_write_folder, set_ordinary_mode, shard_size_bytes
from ..hub_cards import render_model_card
from ..modeling import DFlashConfig, DFlashDraftModel
from ..random_targets import is_random_target, random_config
from ..target.adapter import TargetAdapter
from ..target.support import check_target_config
from ..targets import TARGETS, is_hub_id, resolve_target_dir
from .gguf import write_gguf
from .layout import DFLASH_HF_AUTO_MAP, foreign_entries, remote_code
from .official import official_state_dict, to_official_config
from .speculators import check_speculators_target, speculators_state_dict, to_speculators_config

EXPORT_FORMATS = ("dflash-hf", "official", "speculators", "gguf")
_LICENSE_FIELDS = ("license", "license_name", "license_link")


def _target_config(target: PreTrainedModel | PreTrainedConfig | str | os.PathLike) -> tuple[PreTrainedConfig, str]:
    """Return the target's config and its name or path (a named target: its Hub id, config from the local cache; a
    random target: its shape's config)."""
    if isinstance(target, (str, os.PathLike)) and os.fspath(target) in TARGETS:
        spec = TARGETS[os.fspath(target)]
        return AutoConfig.from_pretrained(resolve_target_dir(spec.name)), spec.hub_id or spec.name
    if is_random_target(target):
        return random_config(target), target
    if isinstance(target, PreTrainedModel):
        config = target.config
    elif isinstance(target, PreTrainedConfig):
        config = target
    elif isinstance(target, (str, os.PathLike)):
        check_target_config(target)
        config = AutoConfig.from_pretrained(str(target))
    else:
        raise ValueError(
            f"`target` must be the target model, its config, or its Hub id / local path; got {type(target).__name__}."
        )
    name = config.name_or_path or (str(target) if isinstance(target, (str, os.PathLike)) else "")
    return config, name


def _target_model(target: PreTrainedModel | PreTrainedConfig | str | os.PathLike) -> PreTrainedModel:
    """The target model itself (its LM head rows go into a speculators export): given, or loaded from its folder."""
    if isinstance(target, PreTrainedModel):
        return target
    if isinstance(target, PreTrainedConfig):
        raise ValueError(
            "The speculators layout stores the target's LM head rows of the draft vocabulary, so it needs the target's "
            "weights: pass the target model, its local folder or Hub id (or a named target), not only its config."
        )
    name = os.fspath(target)
    if is_random_target(name):
        raise ValueError(
            f"The speculators layout stores the target's LM head rows, and those of {name!r} depend on the device and "
            "dtype it was built in: pass the target model itself, or export another format."
        )
    path = resolve_target_dir(name) if name in TARGETS else name
    return AutoModelForCausalLM.from_pretrained(path, dtype="auto")


def _check_pairing(drafter: DFlashDraftModel, target: Any, text_config: PreTrainedConfig) -> PreTrainedModel:
    """Raise a `ValueError` unless `drafter` was built for the target (sizes, vocabulary, tapped layers); returns the
    target model (built on the meta device where only its config was given)."""
    if not isinstance(target, PreTrainedModel):
        with torch.device("meta"):  # shapes only: no memory, no weights
            target = AutoModelForCausalLM.from_config(text_config)
    TargetAdapter.for_drafter(target, drafter)
    return target


def _target_license(target_name: str, base_model: str) -> dict[str, str]:
    """License fields of the target's model card, read from a local folder or the local Hub cache (no network)."""
    candidates = [os.path.join(target_name, "README.md")] if target_name and os.path.isdir(target_name) else []
    candidates.append(try_to_load_from_cache(base_model, "README.md"))
    for readme in candidates:
        if isinstance(readme, str) and os.path.isfile(readme):
            metadata = metadata_load(readme) or {}
            fields = {key: str(metadata[key]) for key in _LICENSE_FIELDS if metadata.get(key)}
            if fields:
                return fields
    return {}


def _write_speculators_folder(
    drafter: DFlashDraftModel, target: PreTrainedModel, base_model: str, folder: Path, card: str
) -> None:
    """Write the speculators layout into the (empty, staging) `folder`: config, weights and card, no remote code."""
    config = to_speculators_config(drafter.config, target, base_model)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(speculators_state_dict(drafter, target), folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "README.md").write_text(card, encoding="utf-8")
    set_ordinary_mode(folder)


def _write_folder(
    drafter: DFlashDraftModel,
    folder: Path,
    format: str,
    card: str,
    max_shard_size: int | str | None,
    target: PreTrainedModel,
) -> None:
    """Write the dflash-hf or official layout into the (empty, staging) `folder`."""
    options = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    renamed = official_state_dict(drafter) if format == "official" else None
    drafter.save_pretrained(folder, **options, **({} if renamed is None else {"state_dict": renamed}))
    # the remote code always comes from this package's sources, whatever class `drafter` was loaded as
    for stray in folder.glob("*.py"):
        stray.unlink()
    for name, source in remote_code(format).items():
        shutil.copy(source, folder / name)
    config_path = folder / "config.json"
    if format == "official":
        config = to_official_config(drafter.config, target)
    else:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config.update(architectures=["DFlashDraftModel"], auto_map=dict(DFLASH_HF_AUTO_MAP))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (folder / "README.md").write_text(card, encoding="utf-8")
    set_ordinary_mode(folder)


def _write_atomically(out_dir: Path, overwrite: bool, write: Callable[[Path], None]) -> None:
    """Refuse an existing `out_dir` unless `overwrite` and it holds an earlier export (nothing else would be lost),
    then write it with [`fileio.atomic_write_folder`]."""
    if out_dir.exists() and not overwrite:
        raise ValueError(f"{out_dir} already exists; choose another folder or pass overwrite=True (`--overwrite`).")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a folder.")
    foreign = foreign_entries(out_dir) if out_dir.exists() else []
    if foreign:
        more = f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""
        raise ValueError(
            f"{out_dir} is not an earlier export: overwriting it would delete {', '.join(foreign[:8])}{more}. "
            "Overwrite replaces only a folder `dflash-hf export` wrote: choose another folder, or move those away."
        )
    atomic_write_folder(out_dir, write)


def _check_arguments(
    drafter: DFlashDraftModel, format: str, gguf_type: str | None, max_shard_size: int | str | None
) -> None:
    """Raise a `ValueError` for an unknown format, a drafter that is no DFlash drafter, a `gguf_type` given to a
    format other than GGUF, or a `max_shard_size` given to a one-file format or of no positive size."""
    if format not in EXPORT_FORMATS:
        raise ValueError(f"Unknown export format {format!r}; choose one of {', '.join(EXPORT_FORMATS)}.")
    if getattr(drafter.config, "model_type", None) != DFlashConfig.model_type:
        raise ValueError(f"`export` writes DFlash drafters (`DFlashDraftModel`), got {type(drafter).__name__}.")
    if gguf_type is not None and format != "gguf":
        raise ValueError(
            f"gguf_type (`--gguf-type`) {gguf_type!r} applies to format='gguf' only, not to {format!r}, whose weights "
            "keep the drafter's dtype: drop it, or export with format='gguf' (`--format gguf`)."
        )
    if max_shard_size is not None and format in ("speculators", "gguf"):
        raise ValueError(
            f"max_shard_size (`--max-shard-size`) applies to the dflash-hf and official formats, not to {format!r}, "
            "which is written as one file: drop it, or export another format."
        )
    if max_shard_size is not None:
        shard_size_bytes(max_shard_size, "max_shard_size (`--max-shard-size`)")


def _base_model(base_model: str | None, target_name: str) -> str:
    """The card's `base_model`: the one given, else the target's name when that is no local path; a `ValueError`
    unless it is a Hub id."""
    if base_model is None and target_name and not os.path.exists(target_name):
        base_model = target_name
    if base_model is None or not is_hub_id(base_model):
        raise ValueError(
            f"Cannot tell the target's Hub id from {base_model or target_name or 'the target'!r} (the card's "
            "`base_model`): pass base_model='org/name' (`--base-model org/name`)."
        )
    return base_model


def export(
    drafter: DFlashDraftModel,
    out_dir: str | os.PathLike,
    *,
    target: PreTrainedModel | PreTrainedConfig | str | os.PathLike,
    metrics: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    format: str = "dflash-hf",
    base_model: str | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    training: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    gguf_type: str | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write `drafter` as a Hub-ready folder: config, safetensors weights, remote code and a model card.

    Args:
        drafter: The DFlash drafter to export.
        out_dir: Folder to create. It appears only once complete (atomic rename); nothing is left behind on error.
        target: The target the drafter was built for: the model, its config, or its Hub id / local path (only the
            config is read). The drafter is checked against it (hidden size, vocabulary, tapped layers).
        metrics: Measured benchmark rows for the card's results table (`tau`, `speedup`, `hardware`, `date`; see
            `dflash_hf.hub_cards.normalize_metrics`). Without them the card says no measurements are included.
        format: `"dflash-hf"` (`model_type: dflash`, `AutoConfig`/`AutoModel` remote code), `"official"` (the z-lab
            layout read by SGLang and vLLM: Qwen3-style config with `dflash_config`, remote code in `dflash.py`) or
            `"speculators"` (vLLM's speculators layout, with the reduced draft vocabulary that its converter of the
            official layout drops; needs the target's weights, refuses targets it cannot express such as Gemma) or
            `"gguf"` (one `.gguf` file for llama.cpp's DFlash drafting, no card: `target` is then a named target or
            the target's GGUF file, see `dflash_hf.hub.gguf.write_gguf`).
        base_model: Hub id of the target for the card's `base_model`; defaults to the target's name when it is a Hub
            id.
        repo_id: Hub id the drafter will be published under, used in the card's usage snippets.
        license: License of the card; defaults to the target card's license when it is available locally.
        training: Recorded training facts (data size, steps, hyper-parameters, wall time) listed in the card.
        overwrite: Replace an existing `out_dir` that holds an earlier export (only once the new export is
            complete); a folder holding anything an export does not write is refused, naming what would be lost.
        gguf_type: For `format="gguf"`, the type of the draft body's weight matrices (`f32`, `f16`, `bf16`, `q8_0`;
            default `f32`); refused with the other formats, which keep the drafter's own dtype.
        max_shard_size: For `format="dflash-hf"` and `"official"`, the largest weight file (`save_pretrained`'s
            `max_shard_size`, e.g. `"15MB"`; default: its default): larger weights are written as shards with an index.

    Returns:
        The path of the written folder.
    """
    _check_arguments(drafter, format, gguf_type, max_shard_size)
    if format == "gguf":
        return write_gguf(
            drafter, out_dir, target=target, gguf_type="f32" if gguf_type is None else gguf_type, overwrite=overwrite
        )
    target_config, target_name = _target_config(target)
    text_config = target_config.get_text_config(decoder=True)
    if format == "speculators":
        target = _target_model(target)
    paired = _check_pairing(drafter, target, text_config)
    if format == "speculators":
        check_speculators_target(drafter.config, target)
    base_model = _base_model(base_model, target_name)
    card = render_model_card(
        drafter.config,
        base_model=base_model,
        num_parameters=drafter.num_parameters(),
        target_config=text_config,
        repo_id=repo_id,
        format=format,
        metrics=metrics,
        training=training,
        license={"license": license} if license else _target_license(target_name, base_model),
        dtype=str(drafter.dtype).removeprefix("torch."),
    )
    out_dir = Path(out_dir)

    def write(staging: Path) -> None:
        if format == "speculators":
            _write_speculators_folder(drafter, target, base_model, staging, card)
        else:
            _write_folder(drafter, staging, format, card, max_shard_size, paired)

    _write_atomically(out_dir, overwrite, write)
    return out_dir


__all__ = ["DFLASH_HF_AUTO_MAP", "EXPORT_FORMATS", "export"]
