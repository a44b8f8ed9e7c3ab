"""Pickle-free Trainer checkpoints: optimizer, scheduler, scaler, RNG states and training arguments.

A plain `transformers.Trainer` checkpoint holds pickles next to the safetensors weights (`optimizer.pt`,
`scheduler.pt`, `scaler.pt`, `rng_state*.pth`, `training_args.bin`). [`DFlashTrainer`] writes them in this module's
format instead, so a checkpoint folder holds only safetensors and JSON:

- optimizer: `optimizer.json` (param groups, non-tensor values) and `optimizer.safetensors` (its tensors);
- LR scheduler: `scheduler.json`; gradient scaler (fp16 only): `scaler.json`;
- RNG states (python, numpy, torch CPU and CUDA): `rng_state.json` + `rng_state.safetensors`, or
  `rng_state_{rank}.*` per process in distributed runs (the Trainer's naming);
- training arguments: `training_args.json` (`TrainingArguments.to_json_string`).

A checkpoint is written under a hidden staging name (`.checkpoint-N.partial`) and renamed to `checkpoint-N` once
complete, and old checkpoints are moved aside before they are deleted, so a kill never leaves a `checkpoint-N` that
looks complete but is not. [`last_complete_checkpoint`] finds the newest complete one (a folder written otherwise,
e.g. by an older version, counts only with its weights and a readable `trainer_state.json`, the Trainer's last file).

A state object (a `state_dict()`, an RNG snapshot) is stored as a JSON tree in which every tensor or numpy array is
a reference into a flat safetensors file (keys are the tree paths, e.g. `optimizer.state.0.exp_avg`); tuples and
dicts with integer keys (optimizer state is keyed by parameter index) are tagged so that they read back as they were
written. Nothing here unpickles: resuming from a checkpoint folder that holds pickle files (a plain Trainer's or an
older run's) is refused with a `ValueError`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import TrainingArguments
from transformers.trainer_callback import TrainerState
from transformers.trainer_pt_utils import set_rng_state_for_device
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from dflash_hf.fileio import PICKLE_SUFFIXES, discard, set_ordinary_mode

OPTIMIZER_NAME = "optimizer"
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header
SCHEDULER_NAME = "scheduler"
SCALER_NAME = "scaler"
TRAINING_ARGS_NAME = "training_args.json"
TRAINER_STATE_NAME = "trainer_state.json"
STAGING_SUFFIX = ".partial"

_TENSOR, _ARRAY, _TUPLE, _INT_KEYS = "__tensor__", "__ndarray__", "__tuple__", "__int_keys__"


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON tree of `value`; tensors and numpy arrays are moved into `tensors` under their tree path."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous()
        return {_TENSOR: path}
    if isinstance(value, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(value))
        return {_ARRAY: path}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _encode(v, f"{path}.{k}", tensors) for k, v in value.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {_INT_KEYS: {str(k): _encode(v, f"{path}.{k}", tensors) for k, v in value.items()}}
        raise TypeError(f"Cannot store a dict with keys {list(value)[:5]} at `{path}` without pickle.")
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"Cannot store a {type(value).__name__} at `{path}` without pickle.")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `_encode`."""
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        return tensors[value[_TENSOR]]
    if _ARRAY in value:
        return tensors[value[_ARRAY]].numpy()
    if _TUPLE in value:
        return tuple(_decode(v, tensors) for v in value[_TUPLE])
    if _INT_KEYS in value:
        return {int(k): _decode(v, tensors) for k, v in value[_INT_KEYS].items()}
    return {k: _decode(v, tensors) for k, v in value.items()}


def save_state(state: Any, folder: str | os.PathLike, name: str) -> None:
    """Write `state` as `folder/name.json`, plus `folder/name.safetensors` when it holds tensors or arrays."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, name, tensors)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tensors:
        save_file(tensors, str(folder / f"{name}.safetensors"), metadata={"format": "pt"})
        set_ordinary_mode(folder / f"{name}.safetensors")
    (folder / f"{name}.json").write_text(json.dumps(tree), encoding="utf-8")


def load_state(folder: str | os.PathLike, name: str) -> Any | None:
    """Read a state written by `save_state`; `None` when `folder/name.json` does not exist."""
    folder = Path(folder)
    tree_file = folder / f"{name}.json"
    if not tree_file.is_file():
        return None
    tensor_file = folder / f"{name}.safetensors"
    tensors = load_file(str(tensor_file)) if tensor_file.is_file() else {}
    return _decode(json.loads(tree_file.read_text(encoding="utf-8")), tensors)


def refuse_pickle_checkpoint(folder: str | os.PathLike) -> None:
    """Raise a `ValueError` when a checkpoint folder holds pickle files (a plain Trainer's or an older run's)."""
    if not Path(folder).is_dir():  # the Trainer reports a missing checkpoint itself
        return
    pickles = sorted(p.name for p in Path(folder).iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"Checkpoint {folder} holds pickle files ({', '.join(pickles)}): it was written by a plain "
            "`transformers.Trainer` or an older dflash-hf, and this project never unpickles. Resuming needs a "
            "pickle-free checkpoint (safetensors + JSON, written by DFlashTrainer); to keep only the weights, start "
            f"a new run from them with `--drafter {folder}`."
        )


def rng_state_name(process_index: int, world_size: int) -> str:
    """`rng_state` for a single process, `rng_state_{rank}` per process otherwise (the Trainer's naming)."""
    return "rng_state" if world_size <= 1 else f"rng_state_{process_index}"


def capture_rng_state(distributed: bool) -> dict[str, Any]:
    """Python, numpy, torch CPU and (when available) CUDA generator states; all CUDA devices when `distributed`."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any], distributed: bool) -> None:
    """Set the generators back to a `capture_rng_state` snapshot."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        set_rng_state_for_device("CUDA", torch.cuda, state, distributed)


def save_training_args(args: TrainingArguments, folder: str | os.PathLike) -> None:
    """Write the training arguments as `folder/training_args.json` (instead of the pickled `training_args.bin`)."""
    Path(folder, TRAINING_ARGS_NAME).write_text(args.to_json_string(), encoding="utf-8")


def staging_folder(run_dir: str | os.PathLike, step: int) -> Path:
    """Hidden folder in which `checkpoint-{step}` is written before it is renamed into place."""
    return Path(run_dir, f".{PREFIX_CHECKPOINT_DIR}-{step}{STAGING_SUFFIX}")


def remove_leftovers(run_dir: str | os.PathLike) -> None:
    """Delete what a killed save or rotation left behind: hidden `.checkpoint-*` staging and stale folders."""
    for leftover in Path(run_dir).glob(f".{PREFIX_CHECKPOINT_DIR}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def publish_checkpoint(written: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the complete checkpoint folder `written` to `final` (replacing an older folder of that name)."""
    discard(final)
    os.replace(written, final)


def rotate_checkpoints(run_dir: str | os.PathLike, save_total_limit: int | None, best: str | None) -> None:
    """Delete the oldest `checkpoint-N` beyond `save_total_limit`, never the newest nor `best` (the Trainer's rule),
    each moved aside first so that a kill never leaves a half-deleted `checkpoint-N`."""
    checkpoints = [Path(path) for path in sort_checkpoints(str(run_dir))]
    if not save_total_limit or save_total_limit <= 0 or not checkpoints:
        return
    protected = {checkpoints[-1]} | ({Path(best)} if best else set())
    remaining, keep = len(checkpoints), max(save_total_limit, len(protected))
    for path in checkpoints:
        if remaining <= keep:
            break
        if path not in protected:
            discard(path)
            remaining -= 1


def _weights_problem(folder: Path) -> str | None:
    """Why `folder` holds no complete drafter weights (one `model.safetensors`, or the shards its index names)."""
    if (folder / SAFE_WEIGHTS_NAME).is_file():
        return None
    try:
        shards = set(json.loads((folder / SAFE_WEIGHTS_INDEX_NAME).read_text(encoding="utf-8"))["weight_map"].values())
    except FileNotFoundError:
        return f"no {SAFE_WEIGHTS_NAME}"
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return f"unreadable {SAFE_WEIGHTS_INDEX_NAME}"
    missing = sorted(str(name) for name in shards if not (folder / str(name)).is_file())
    return f"no {missing[0]} (a shard its index names)" if missing else None


def _safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file `path` is not whole (a header that does not parse, a size other than its header says:
    a write cut short), read from its header alone."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= min(size - 8, _MAX_HEADER_BYTES):
                return f"{path.name} is truncated (no whole header)"
            header = json.loads(handle.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return f"{path.name} has an unreadable header"
    if size != 8 + length + max(ends, default=0):
        return f"{path.name} is truncated ({size} bytes, its header says {8 + length + max(ends, default=0)})"
    return None


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why `folder` is not a complete checkpoint (no weights, a safetensors file cut short, no readable trainer
    state), or `None` when it is."""
    folder = Path(folder)
    problem = _weights_problem(folder)
    if problem is not None:
        return problem
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem is not None:
            return problem
    try:
        TrainerState.load_from_json(str(folder / TRAINER_STATE_NAME))
    except FileNotFoundError:
        return f"no {TRAINER_STATE_NAME}"
    except (OSError, ValueError, TypeError):
        return f"unreadable {TRAINER_STATE_NAME}"
    return None


def last_complete_checkpoint(run_dir: str | os.PathLike) -> tuple[str | None, list[str]]:
    """The newest complete `checkpoint-N` in `run_dir` (or `None`) and the newer incomplete ones it skipped."""
    skipped = []
    for path in reversed(sort_checkpoints(str(run_dir)) if Path(run_dir).is_dir() else []):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path} ({problem})")
    return None, skipped


def check_complete_checkpoint(folder: str | os.PathLike) -> None:
    """Raise a `ValueError` pointing to the newest complete checkpoint when `folder` is incomplete."""
    problem = checkpoint_problem(folder)
    if problem is None:
        return
    previous, _ = last_complete_checkpoint(Path(folder).parent)
    hint = (
        f"resume from {previous} (the newest complete checkpoint, which `--resume_from_checkpoint last` picks)"
        if previous
        else "no complete checkpoint is left next to it: start a new run"
    )
    raise ValueError(f"Checkpoint {folder} is incomplete ({problem}; its save was interrupted): {hint}.")
