"""The make-data output folder: the settings that started it, its rows, and how training reads it back.

    OUT/
        dataset/          # `datasets.load_from_disk`: id, input_ids, loss_mask (1 on response tokens), prompt_length
        manifest.json     # target, source, counts, settings, held-out ids
        held_out.jsonl    # held-out prompts (id, prompt) for evaluation
        parts/            # one gzipped JSONL per finished batch (`dflash_hf.data.parts`: append-only, kept for
                          # resuming and growing the set, small enough to keep in a repository)

`parts/settings.json` records the settings of the first run; a rerun resumes only with the same ones. `dataset/`,
`held_out.jsonl` and `manifest.json` are rebuilt from the parts at the end of every run, each atomically.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..fileio import atomic_write_folder, atomic_write_text, read_json, remove_leftovers
from .parts import read_parts
from .prompts import DEFAULT_SOURCE, MANIFEST_NAME, Prompt

SETTINGS_NAME = "settings.json"
FORMAT = "dflash-hf-data/1"


def check_output_folder(path: str | os.PathLike, flag: str = "--out") -> None:
    """Raise a `ValueError` when `path`, or the nearest part of it that exists, is not a folder."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a folder; pass a folder to create or resume.")


def folder_settings(
    target_name: str | None,
    target_model_type: str | None,
    source: str,
    max_new_tokens: int,
    max_prompt_tokens: int,
    held_out_fraction: float,
    seed: int,
    use_chat_template: bool,
    responses: str,
    turn: int,
    prompt_order: str,
    from_server: bool,
    build: tuple[str, str] = ("float32", "cpu"),
) -> dict[str, Any]:
    """The settings a make-data folder records: a rerun must repeat them to resume it. `build`: the dtype and device
    type the target generates in (two builds of one target answer differently at near ties; a `random:` target's
    weights differ)."""
    settings = {
        "target": target_name,
        "target_model_type": target_model_type,
        "source": source,
        "max_new_tokens": int(max_new_tokens),
        "max_prompt_tokens": int(max_prompt_tokens),
        "held_out_fraction": float(held_out_fraction),
        "seed": int(seed),
        "chat_template": bool(use_chat_template),
        "decoding": "greedy" if responses == "regenerate" else "source replies (teacher-forced)",
    }
    if turn != 1:  # recorded only when set, so folders made before the option resume unchanged
        settings["turn"] = int(turn)
    if prompt_order != "source":
        settings["prompt_order"] = prompt_order
    if from_server:  # a served model's greedy answers are its own (another engine, maybe quantized)
        settings["responses_from"] = "server"
    dtype, device = build  # recorded where they are not the float32 CPU build the older folders were made in
    if dtype != "float32":
        settings["dtype"] = dtype
    if device != "cpu":
        settings["device"] = device
    return settings


def made_rows(out: Path, settings: dict[str, Any], vocab_size: int) -> list[dict]:
    """The rows already made in `out` (none in a new folder), once the folder is known to have been started with
    `settings`; reads only."""
    _check_settings(out, settings)
    parts = out / "parts"
    return read_parts(parts, vocab_size) if parts.is_dir() else []


def start_parts(out: Path, settings: dict[str, Any]) -> None:
    """Create `out/parts` recording `settings` (a new folder), and clear what a killed part write left there."""
    (out / "parts").mkdir(parents=True, exist_ok=True)
    if not (out / "parts" / SETTINGS_NAME).is_file():
        atomic_write_text(out / "parts" / SETTINGS_NAME, json.dumps(settings, indent=1))
    remove_leftovers(out / "parts", (".part-*.tmp",))


def _compared(key: str, value: Any) -> Any:
    """A recorded setting as resuming compares it: a `source` or `target` naming an existing path is resolved, so the
    same file or folder named by an absolute or a relative path is the same setting (`sharegpt` stays a name)."""
    if key in ("source", "target") and isinstance(value, str) and value != DEFAULT_SOURCE and Path(value).exists():
        return Path(value).resolve()
    return value


def _check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Refuse to resume a folder that was started with other settings than `settings`."""
    path = out / "parts" / SETTINGS_NAME
    if not path.is_file():
        return
    fix = f"move it away and rerun make-data with the settings that started {out} (it records them again)."
    old = read_json(path, fix)
    if not isinstance(old, dict):
        raise ValueError(f"{path} holds a JSON {type(old).__name__}, not the settings make-data records: {fix}")
    keys = [*settings, *(k for k in old if k not in settings)]  # a setting recorded only when set counts too
    diff = {k: (old.get(k), settings.get(k)) for k in keys if _compared(k, old.get(k)) != _compared(k, settings.get(k))}
    if diff:
        detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"{out} was started with other settings ({detail}); rerun with the same settings to resume, or pass "
            "a new --out folder."
        )


def write_dataset(out: Path, records: list[dict]) -> None:
    """(Re)build `OUT/dataset` from the part records, atomically."""
    import datasets

    rows = {
        "id": [r["id"] for r in records],
        "input_ids": [r["input_ids"] for r in records],
        "loss_mask": [[0] * r["prompt_length"] + [1] * (len(r["input_ids"]) - r["prompt_length"]) for r in records],
        "prompt_length": [r["prompt_length"] for r in records],
    }
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "prompt_length": datasets.Value("int32"),
        }
    )
    data = datasets.Dataset.from_dict(rows, features=features)
    atomic_write_folder(out / "dataset", lambda staging: data.save_to_disk(str(staging)))


def publish(out: Path, done: list[dict], held: list[Prompt], manifest: dict[str, Any], generated: int) -> None:
    """(Re)write the dataset, the held-out prompts and the manifest of a make-data folder from its part records
    `done`, of which this run made `generated`. A run that made none on a folder whose manifest counts them all only
    rebuilt the dataset: the file keeps the record of the run that made the rows (a checkout stays clean)."""
    write_dataset(out, done)
    rows = ({"id": p.id, "prompt": p.text, **({"history": p.history} if p.history else {})} for p in held)
    atomic_write_text(out / "held_out.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    previous = read_manifest(out)
    if generated == 0 and previous is not None and previous["counts"]["samples"] == len(done):
        manifest = previous
    atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=1))


def manifest_of(
    settings: dict[str, Any],
    run_settings: dict[str, Any],
    source_counts: dict[str, int],
    run_counts: dict[str, int],
    done: list[dict],
    held: list[Prompt],
    seconds: float,
) -> dict[str, Any]:
    """The manifest of a make-data folder: target, source, settings, counts (the source's prompts, the folder's rows,
    what this run made and skipped) and held-out ids, and the seconds this run generated for."""
    return {
        "format": FORMAT,
        "target": settings["target"],
        "target_model_type": settings["target_model_type"],
        "source": settings["source"],
        "settings": {**settings, **run_settings},
        "counts": {
            **source_counts,
            "samples": len(done),
            **run_counts,
            "response_tokens": sum(len(r["input_ids"]) - r["prompt_length"] for r in done),
            "total_tokens": sum(len(r["input_ids"]) for r in done),
        },
        "held_out_ids": [p.id for p in held],
        "generation_seconds_this_run": round(seconds, 2),
    }


def read_manifest(path: str | os.PathLike) -> dict | None:
    """The manifest of a make-data folder, or `None` for a plain `datasets` folder."""
    manifest = Path(path) / MANIFEST_NAME
    return json.loads(manifest.read_text()) if manifest.is_file() else None


def load_training_data(path: str | os.PathLike):
    """Load a `make-data` folder (or a plain `datasets` folder with `input_ids` and `loss_mask`)."""
    import datasets

    path = Path(path)
    folder = path / "dataset" if (path / MANIFEST_NAME).is_file() else path
    try:
        data = datasets.load_from_disk(str(folder))
    except FileNotFoundError as err:
        raise ValueError(
            f"{path} is neither a `dflash-hf make-data` output folder nor a `datasets` folder; make one with "
            "`dflash-hf make-data --target T --out DIR`."
        ) from err
    if isinstance(data, datasets.DatasetDict):
        data = data["train"] if "train" in data else next(iter(data.values()))
    missing = [c for c in ("input_ids", "loss_mask") if c not in data.column_names]
    if missing:
        raise ValueError(f"{folder} lacks the column(s) {missing}; make the dataset with `dflash-hf make-data`.")
    return data
