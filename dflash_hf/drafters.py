"""The home of drafter folders: the drafters bundled with the package, resolving a `--drafter` argument to a folder
(or a Hub id), the checks of a folder's files, and loading a drafter for a target.

The checks run before Transformers reads a folder: a damaged or hostile folder ends in a `ValueError` naming the file
and the fix, not in a traceback, a read outside the folder or a silent cast.

    >>> check_drafter_folder("out/my-drafter")  # config.json and weights of any export layout
    >>> drafter = load_drafter(resolve_drafter_dir("smollm2-135m", None), target)  # the bundled drafter
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from transformers import PreTrainedModel

from .fileio import path_inside, read_json
from .modeling import DFlashDraftModel
from .target.support import check_built_for
from .targets import TARGETS, is_hub_id

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# the draft layers' sizes, under the same names in every layout's config
DRAFT_LAYER_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
# sizes and ids of every layout's config (also nested: `dflash_config`, speculators' `transformer_layer_config`)
INTEGER_FIELDS = (
    "vocab_size",
    "draft_vocab_size",
    *DRAFT_LAYER_SIZES,
    "max_position_embeddings",
    "block_size",
    "num_target_layers",
    "mask_token_id",
)
LAYER_ID_FIELDS = ("target_layer_ids", "aux_hidden_state_layer_ids")
# the draft vocabulary's id maps are the only tensors that are not floating point
INTEGER_TENSORS = ("d2t", "t2d")
_FIX = "re-export the drafter with `dflash-hf export`, or restore the folder from its source."


def _fields(config: dict[str, Any], depth: int = 3) -> Iterator[tuple[str, Any]]:
    """`(key, value)` of `config` and of the objects nested in it, `depth` levels down."""
    for key, value in config.items():
        yield key, value
        if isinstance(value, dict) and depth > 1:
            yield from _fields(value, depth - 1)


def read_config_dict(folder: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` object of a drafter folder, once its sizes are known to be integers (`ValueError` naming
    the file and the field otherwise)."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"No DFlash drafter at {folder} (no {CONFIG_NAME}): {_FIX}")
    config = read_json(path, _FIX)
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not a config object: {_FIX}")
    for key, value in _fields(config):
        if key in INTEGER_FIELDS and value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "mask_token_id" else 1):
                raise ValueError(f"{path}: `{key}` must be a positive integer, got {value!r}: {_FIX}")
        if key in LAYER_ID_FIELDS and value is not None:
            if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                raise ValueError(f"{path}: `{key}` must be a list of layer numbers, got {value!r}: {_FIX}")
    return config


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The weight files of a drafter folder, relative to it: `model.safetensors`, or the shards that
    `model.safetensors.index.json` names (each checked to be a file inside the folder)."""
    folder = Path(folder)
    index_path = folder / WEIGHTS_INDEX_NAME
    if not index_path.is_file():
        return [WEIGHTS_NAME] if (folder / WEIGHTS_NAME).is_file() else []
    index = read_json(index_path, _FIX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path} has no `weight_map` of tensor names to shard files: {_FIX}")
    shards = sorted(set(weight_map.values()), key=str)
    for shard in shards:
        path = path_inside(folder, shard, f"{index_path} (a shard)", _FIX)
        if Path(shard).name != shard or not shard.endswith(".safetensors") or not path.is_file():
            raise ValueError(
                f"{index_path} names the shard {shard!r}, which is no safetensors file of {folder}: {_FIX}"
            )
    return shards


def check_weights(folder: str | os.PathLike, files: list[str]) -> None:
    """Raise a `ValueError` unless the tensors of every safetensors file of `files` (relative to `folder`) are
    floating point (the `d2t` / `t2d` id maps excepted): integer weights would be cast silently. A file safetensors
    cannot read is left to the loader, which names it."""
    for name in files:
        path = Path(folder) / name
        try:
            with safe_open(path, framework="pt") as handle:
                dtypes = {key: handle.get_slice(key).get_dtype() for key in handle.keys()}
        except SafetensorError:
            continue
        integers = sorted(key for key, dtype in dtypes.items() if "F" not in dtype and key not in INTEGER_TENSORS)
        if integers:
            found = ", ".join(f"{key} ({dtypes[key]})" for key in integers[:3]) + (", ..." if len(integers) > 3 else "")
            raise ValueError(
                f"{path} holds {len(integers)} non-floating-point weight tensors ({found}), which loading would cast "
                f"to floats without a word: {_FIX}"
            )


def check_drafter_folder(folder: str | os.PathLike) -> dict[str, Any]:
    """Check a local drafter folder before it is loaded ([`read_config_dict`], [`weight_files`], [`check_weights`]);
    returns its config object."""
    config = read_config_dict(folder)
    check_weights(folder, weight_files(folder))
    return config


def bundled_drafter_dir(target_name: str) -> Path:
    """Folder of the drafter shipped inside the package for a named target (it may not exist)."""
    return Path(__file__).resolve().parent / "bundled" / f"dflash-{target_name}"


@dataclass(frozen=True)
class EngineDefaults:
    """The engine settings of a bundled pair: what `dflash-hf generate` runs with the bundled drafter when no flag
    says otherwise. Chosen from the pair's committed bench runs ([`BUNDLED_BENCH_RUNS`]): of the engine's rows, the one
    whose slowest speedup over plain greedy across those runs is the highest (`tests/test_drafters.py` checks the
    choice against the runs), so a drafter that does not pay yet on its own runs its target no slower than plain
    decoding: the adaptive block size takes plain steps where a block loses."""

    block_size: int | str
    candidates: str


BUNDLED_ENGINE_DEFAULTS: dict[str, EngineDefaults] = {
    "smollm2-135m": EngineDefaults(block_size=4, candidates="dflash+lookup"),
    "gemma3-270m": EngineDefaults(block_size=4, candidates="dflash+lookup"),
    "qwen2.5-coder-0.5b": EngineDefaults(block_size="adaptive", candidates="dflash"),
}
"""[`EngineDefaults`] of each target with a bundled drafter."""

# the bench runs (under docs/bench/) each pair's defaults were chosen from
BUNDLED_BENCH_RUNS: dict[str, tuple[str, ...]] = {
    "smollm2-135m": ("draft-tree/humaneval", "draft-tree/sharegpt", "draft-tree/suite"),
    "gemma3-270m": ("gemma3-270m/humaneval", "gemma3-270m/sharegpt"),
    "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b/suite", "qwen2.5-coder-0.5b/sharegpt"),
}


def engine_defaults(target: str, drafter: str | os.PathLike | None) -> EngineDefaults | None:
    """The bundled pair's [`EngineDefaults`] when `drafter` is `None` (the bundled drafter of the named `target`),
    else `None`: another drafter runs with the engine's own defaults."""
    return BUNDLED_ENGINE_DEFAULTS.get(str(target)) if drafter is None else None


def resolve_drafter_dir(target: str, drafter: Path | None) -> Path:
    """The drafter folder to use: `drafter` when given, else the one bundled for the named `target`.

    Raises a `ValueError` naming the fix when the folder holds no drafter, or one whose files fail
    [`check_drafter_folder`].
    """
    if drafter is not None:
        if not (Path(drafter) / CONFIG_NAME).is_file():
            raise ValueError(
                f"No DFlash drafter at {drafter} (no config.json): pass --drafter PATH to a folder saved with "
                "DFlashDraftModel.save_pretrained."
            )
        check_drafter_folder(drafter)
        return Path(drafter)
    folder = bundled_drafter_dir(str(target))
    if str(target) not in TARGETS or not (folder / CONFIG_NAME).is_file():
        raise ValueError(
            f"No bundled drafter for target {target!r} in this installation ({folder} is missing): pass "
            "--drafter PATH to a DFlash drafter folder."
        )
    return folder


def drafter_source(name: str | Path) -> str:
    """`name` as a drafter to load: a local folder, once its files pass [`check_drafter_folder`], or a Hub id; a
    `ValueError` for a name that is neither."""
    if Path(name).exists():
        check_drafter_folder(name)
    elif not is_hub_id(name):
        raise ValueError(
            f"No drafter folder at {name}, and {str(name)!r} is no Hub id (org/name): pass a folder saved by "
            "`dflash-hf train` (or `DFlashDraftModel.save_pretrained`), or the Hub id of a drafter."
        )
    return str(name)


def load_drafter(drafter_dir: str | os.PathLike, target: PreTrainedModel) -> DFlashDraftModel:
    """The DFlash drafter of `drafter_dir` in `target`'s dtype on its device, in eval mode; a `ValueError` naming the
    problem when it was built for another target (`target.support.check_built_for`)."""
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=target.dtype).to(target.device).eval()
    check_built_for(drafter.config, target)
    return drafter


__all__ = [
    "BUNDLED_BENCH_RUNS",
    "BUNDLED_ENGINE_DEFAULTS",
    "EngineDefaults",
    "bundled_drafter_dir",
    "check_drafter_folder",
    "check_weights",
    "drafter_source",
    "engine_defaults",
    "load_drafter",
    "read_config_dict",
    "resolve_drafter_dir",
    "weight_files",
]
