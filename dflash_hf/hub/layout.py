"""What `dflash-hf export` writes, per format: its files, `auto_map` and remote code.

`push` validates a folder against it ([`layout_problems`]: whoever loads a pushed drafter with
`trust_remote_code=True` runs its Python files, so they must be this package's own), and `export --overwrite`
recognises an earlier export by it ([`foreign_entries`]).
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from typing import Any

from ..drafters import CONFIG_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from ..fileio import read_json
from ..modeling import DFlashConfig, DFlashDraftModel
from .official import OFFICIAL_ARCHITECTURE, OFFICIAL_AUTO_MAP, OFFICIAL_MODEL_TYPE, OFFICIAL_MODELING_FILE
from .speculators import SPECULATORS_ARCHITECTURES, is_speculators_config_dict

CARD_NAME = "README.md"
CONFIGURATION_FILE = "configuration_dflash.py"
MODELING_FILE = "modeling_dflash.py"
DFLASH_HF_AUTO_MAP = {
    "AutoConfig": "configuration_dflash.DFlashConfig",
    "AutoModel": "modeling_dflash.DFlashDraftModel",
}
# format -> the `auto_map` its config.json holds (`None`: none, the speculators layout has no remote code)
AUTO_MAPS: dict[str, dict[str, str] | None] = {
    "dflash-hf": DFLASH_HF_AUTO_MAP,
    "official": OFFICIAL_AUTO_MAP,
    "speculators": None,
}
# the shards `save_pretrained` writes for weights above its shard size
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_EXPORT_NAMES = {
    CONFIG_NAME,
    CARD_NAME,
    WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    CONFIGURATION_FILE,
    MODELING_FILE,
    OFFICIAL_MODELING_FILE,
}


def remote_code(format: str) -> dict[str, Path]:
    """The remote-code files an export of `format` holds, by name: this package's sources they are copies of."""
    if AUTO_MAPS[format] is None:
        return {}
    modeling_file = OFFICIAL_MODELING_FILE if format == "official" else MODELING_FILE
    return {
        CONFIGURATION_FILE: Path(inspect.getfile(DFlashConfig)),
        modeling_file: Path(inspect.getfile(DFlashDraftModel)),
    }


def format_of(config: dict[str, Any]) -> str | None:
    """The export format whose `config.json` `config` is (`dflash-hf`, `official`, `speculators`), else `None`."""
    if is_speculators_config_dict(config):
        return "speculators"
    if config.get("model_type") == DFlashConfig.model_type:
        return "dflash-hf"
    if config.get("model_type") == OFFICIAL_MODEL_TYPE and config.get("architectures") == [OFFICIAL_ARCHITECTURE]:
        return "official"
    return None


def expected_architectures(format: str, config: dict[str, Any]) -> list[str]:
    """The `architectures` of an export of `format` whose `config.json` is `config` (speculators: by its
    `speculators_model_type`, a Markov head makes it speculators' DSpark model)."""
    if format == "speculators":
        return [SPECULATORS_ARCHITECTURES[config["speculators_model_type"]]]
    return [DFlashDraftModel.__name__]


def expected_files(format: str, weights: list[str]) -> set[str]:
    """The files of an export of `format` whose weights are `weights` (one file, or shards with their index; none:
    the one file is expected)."""
    weights = weights or [WEIGHTS_NAME]
    index = {WEIGHTS_INDEX_NAME} if weights != [WEIGHTS_NAME] else set()
    return {CONFIG_NAME, CARD_NAME, *weights, *index, *remote_code(format)}


def layout_problems(
    folder: str | os.PathLike, format: str, config: dict[str, Any], names: set[str], weights: list[str]
) -> list[str]:
    """How the folder `folder` (its files `names`, its `config.json` object `config`, its weight files `weights`)
    differs from an export of `format`: missing and unexpected files, other `architectures` or `auto_map`, edited
    remote code."""
    expected = expected_files(format, weights)
    code = remote_code(format)
    problems = [
        f"`auto_map` points at {name}, which is missing" if name in code else f"{name} is missing"
        for name in sorted(expected - names)
    ]
    unexpected = sorted(names - expected)
    if unexpected:
        problems.append(f"it holds files an export does not write ({', '.join(unexpected)})")
    architectures = expected_architectures(format, config)
    if config.get("architectures") != architectures:
        problems.append(f"`architectures` is {config.get('architectures')!r}, an export writes {architectures!r}")
    auto_map = AUTO_MAPS[format]
    if config.get("auto_map") != auto_map:
        problems.append(f"`auto_map` is {config.get('auto_map')!r}, an export writes {auto_map!r}")
    problems += [
        f"{name} is not the remote code of this dflash-hf version"
        for name, source in sorted(code.items())
        if name in names and (Path(folder) / name).read_bytes() != source.read_bytes()
    ]
    return problems


def foreign_entries(folder: str | os.PathLike) -> list[str]:
    """What replacing `folder` would lose beyond an earlier export, sorted: nothing for an empty folder or one
    holding only the files of an export (with a DFlash `config.json`), else every entry (hidden ones included) that
    no export writes, or all of them when `config.json` is no DFlash drafter's."""
    folder = Path(folder)
    entries = {
        entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else ""): entry
        for entry in sorted(folder.iterdir())
    }
    foreign = [
        name
        for name, entry in entries.items()
        if entry.is_symlink() or not entry.is_file() or not (name in _EXPORT_NAMES or SHARD_NAME.fullmatch(name))
    ]
    try:
        config = read_json(folder / CONFIG_NAME, "") if (folder / CONFIG_NAME).is_file() else None
    except ValueError:
        config = None
    if entries and (not isinstance(config, dict) or format_of(config) is None):
        return list(entries)
    return foreign


__all__ = [
    "AUTO_MAPS",
    "DFLASH_HF_AUTO_MAP",
    "expected_architectures",
    "expected_files",
    "foreign_entries",
    "format_of",
    "layout_problems",
    "remote_code",
]
