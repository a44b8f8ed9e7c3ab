"""Model card templates for exported DFlash drafters (installed as `dflash_hf.hub_cards`), and their renderer.

`card.md` is the shared template; `family_<family>.md` adds notes for Qwen, LLaMA and Gemma targets and
`format_<format>.md` explains the checkpoint layout. Templates use `string.Template` placeholders (`$name`).

Nothing in a card is made up: the results table is filled only from measured metrics handed to the renderer, and
without them the card says that no measurements are included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from importlib import resources
from string import Template
from typing import Any

from huggingface_hub import ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from dflash_hf.target.support import TARGET_FAMILIES  # target `model_type` -> family part (`family_<name>.md`)

# every metric row must carry these; `benchmark`, `block_size` and `temperature` are optional columns
REQUIRED_METRICS = ("tau", "speedup", "hardware", "date")
OPTIONAL_METRICS = ("benchmark", "block_size", "temperature")
FORMAT_NAMES = {
    "dflash-hf": "dflash-hf (`model_type: dflash`)",
    "official": "official DFlash (SGLang / vLLM)",
    "speculators": "speculators DFlash (vLLM)",
}


def _template(name: str) -> Template:
    return Template(resources.files(__package__).joinpath(name).read_text(encoding="utf-8"))


def normalize_metrics(metrics: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Validate measured benchmark rows for the results table and return them as a list of dicts.

    Each row needs `tau` (tokens committed per target verify step, >= 1), `speedup` (wall-clock, against plain
    greedy decoding of the same target), `hardware` and `date`; `benchmark`, `block_size` and `temperature` are
    optional. A single mapping, a list of mappings or a mapping with a `results` list are accepted.
    """
    if metrics is None:
        return []
    if isinstance(metrics, Mapping):
        metrics = metrics["results"] if "results" in metrics else [metrics]
    rows = []
    for index, row in enumerate(metrics):
        if not isinstance(row, Mapping):
            raise ValueError(f"metrics row {index} is a {type(row).__name__}, expected a mapping of measured values.")
        missing = [name for name in REQUIRED_METRICS if row.get(name) in (None, "")]
        if missing:
            raise ValueError(
                f"metrics row {index} lacks {', '.join(missing)}: every row needs measured `tau`, `speedup`, "
                "`hardware` and `date` (cards only report measurements, so nothing is filled in)."
            )
        for name in ("tau", "speedup"):
            value = row[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"metrics row {index}: `{name}` must be a finite number, got {value!r}.")
        if row["tau"] < 1:
            raise ValueError(
                f"metrics row {index}: `tau` is tokens committed per verify step and is at least 1, got {row['tau']}."
            )
        if row["speedup"] <= 0:
            raise ValueError(f"metrics row {index}: `speedup` must be positive, got {row['speedup']}.")
        rows.append({name: row[name] for name in REQUIRED_METRICS + OPTIONAL_METRICS if row.get(name) is not None})
    return rows


def _cell(value: Any) -> str:
    """`value` as one Markdown table cell: on one line, its `|` escaped."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _check_repo_id(repo_id: str) -> None:
    """Raise a `ValueError` unless `repo_id` is a Hub repo id `org/name` (it goes verbatim into the card's code)."""
    try:
        validate_repo_id(repo_id)
        valid = repo_id.count("/") == 1
    except HFValidationError:
        valid = False
    if not valid:
        raise ValueError(
            f"repo_id {repo_id!r} is not a Hub repo id of the form org/name (letters, digits, '-', '_', '.'): pass "
            "the id the drafter will be published under (`--repo-id org/name`)."
        )


def _results_section(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return (
            "No measurements are included with this export. Measure `tau` (tokens per target verify step) and the "
            "wall-clock speedup over plain decoding on your hardware, e.g. with `dflash-hf bench`."
        )
    optional = [name for name in OPTIONAL_METRICS if any(name in row for row in rows)]
    headers = {"benchmark": "Benchmark", "block_size": "Block size", "temperature": "Temperature"}
    columns = [headers[name] for name in optional] + ["tau", "Speedup", "Hardware", "Date"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_cell(row.get(name, "")) for name in optional]
        cells += [f"{row['tau']:.2f}", f"{row['speedup']:.2f}x", _cell(row["hardware"]), _cell(row["date"])]
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "Measured with this drafter; `tau` is the mean number of tokens committed per target verify step and the "
        "speedup is wall-clock against plain decoding of the same target on the same hardware.\n\n" + "\n".join(lines)
    )


def _training_section(training: Mapping[str, Any] | None) -> str:
    if not training:
        return "Training details (data, steps, hyper-parameters) were not recorded with this export."
    return "\n".join(f"- `{key}`: {' '.join(str(value).split())}" for key, value in training.items())  # one line each


def render_model_card(
    config: Any,
    *,
    base_model: str,
    num_parameters: int,
    target_config: Any,
    repo_id: str | None = None,
    format: str = "dflash-hf",
    metrics: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    training: Mapping[str, Any] | None = None,
    license: Mapping[str, str] | None = None,
    dtype: str | None = None,
) -> str:
    """Render the `README.md` of an exported drafter.

    Args:
        config: The drafter's [`DFlashConfig`].
        base_model: Hub id of the target model (`base_model` in the front matter).
        num_parameters: Number of drafter parameters.
        target_config: The target's text config; its `model_type` selects the family notes and tag.
        repo_id: Hub id `org/name` the drafter will be published under, for the usage snippets (a placeholder path
            otherwise); anything else is a `ValueError`.
        format: `"dflash-hf"`, `"official"` or `"speculators"`, the checkpoint layout.
        metrics: Measured benchmark rows (see [`normalize_metrics`]); without them no results are shown.
        training: Recorded training facts (data size, steps, hyper-parameters, wall time), listed as given.
        license: License fields of the target's card (`license`, optionally `license_name`, `license_link`).
        dtype: Precision of the stored weights (default: the config's `dtype`, else float32).
    """
    if format not in FORMAT_NAMES:
        raise ValueError(f"Unknown checkpoint format {format!r}; choose one of {sorted(FORMAT_NAMES)}.")
    if repo_id is not None:
        _check_repo_id(repo_id)
    target_model_type = target_config.model_type
    family = TARGET_FAMILIES.get(target_model_type)
    rope = dict(config.rope_parameters or {})
    card_data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["dflash", "speculative-decoding", family or target_model_type],
        **dict(license or {}),
    )
    values = {
        "base_model": base_model,
        "base_model_url": f"https://huggingface.co/{base_model}",
        "repo_id": repo_id or "path/to/this/drafter",
        "target_model_type": target_model_type,
        "num_target_layers": target_config.num_hidden_layers,
        "num_hidden_layers": config.num_hidden_layers,
        "block_size": config.block_size,
        "num_masked": config.block_size - 1,
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "hidden_size": config.hidden_size,
        "num_parameters": f"{num_parameters / 1e6:.1f}M",
        "dtype": dtype or config.to_dict().get("dtype") or "float32",
        "format_name": FORMAT_NAMES[format],
        "rope_type": rope.get("rope_type", "default"),
        "rope_theta": rope.get("rope_theta"),
    }
    values.update(
        front_matter=card_data.to_yaml(),
        title=f"DFlash drafter for {base_model}",
        format_note=_template(f"format_{format}.md").substitute(values).strip(),
        family_part=_template(f"family_{family}.md").substitute(values).strip() if family else "",
        training=_training_section(training),
        results=_results_section(normalize_metrics(metrics)),
    )
    return _template("card.md").substitute(values)


__all__ = ["OPTIONAL_METRICS", "REQUIRED_METRICS", "TARGET_FAMILIES", "normalize_metrics", "render_model_card"]
