"""`dflash-hf train` (and `examples/train.py`): train a DFlash drafter with [`DFlashTrainer`].

Every `DFlashTrainingConfig` / `TrainingArguments` option is a flag (`--per_device_train_batch_size 4`,
`--gradient_accumulation_steps 8`, `--bf16`, `--save_steps 500`, `--resume_from_checkpoint last`, ...). As in TRL's
scripts (`TrlParser`), `--config recipe.yaml` reads a recipe (`examples/recipes/`) and flags override it. Runs on one
device as is and on several under `accelerate launch` (the Trainer sets up DDP; CPU runs use gloo):

    accelerate launch --num_processes 2 examples/train.py --target smollm2-135m --data data/smollm2 \\
        --output_dir runs/smollm2 --block_size 16 --num_draft_layers 3

Checkpoints (`checkpoint-N/`: drafter safetensors, optimizer, scheduler, RNG states, trainer state) are written by
the Trainer; `--resume_from_checkpoint last` (or a checkpoint path) continues the same run. The final drafter is
written with the Hub exporter (`dflash_hf.export`) to `--export_dir` (default `OUTPUT_DIR/final`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cli_settings import read_config
from ..target.support import text_config

TRAIN_EXPORT_FORMATS = ("dflash-hf", "official")  # what `train` writes itself; `dflash-hf export` writes the rest


@dataclass
class DFlashScriptArguments:
    """What to train on: the target, the data and where the final drafter goes."""

    target: str = field(
        metadata={"help": "Target: named (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, ...), a folder or a Hub id."}
    )
    data: str = field(
        metadata={
            "help": "A `dflash-hf make-data` folder (or a datasets folder with input_ids, loss_mask); several folders "
            "separated by commas are trained on together (e.g. regenerated + teacher-forced data)."
        }
    )
    eval_data: str | None = field(default=None, metadata={"help": "Optional evaluation set (same layout as --data)."})
    drafter: str | None = field(default=None, metadata={"help": "Start from this drafter instead of a new one."})
    target_dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16."})
    export_dir: str | None = field(
        default=None, metadata={"help": "Final Hub-ready drafter (default OUTPUT_DIR/final)."}
    )
    export_format: str = field(
        default="dflash-hf",
        metadata={
            "help": "'dflash-hf' or 'official' (SGLang/vLLM layout); the other layouts (speculators, gguf) come from "
            "`dflash-hf export` of the trained drafter."
        },
    )
    base_model: str | None = field(
        default=None, metadata={"help": "Hub id of the target for the model card (needed when --target is a folder)."}
    )


def _base_model(script: "DFlashScriptArguments") -> str | None:
    from dflash_hf.targets import TARGETS, is_hub_id

    if script.base_model:
        return script.base_model
    if script.target in TARGETS:
        return TARGETS[script.target].hub_id
    if is_hub_id(script.target):
        return script.target
    raise ValueError(
        f"--target {script.target!r} names no Hub id (a local folder or a random target): pass --base_model org/name (the target's Hub id, written "
        "into the exported model card) so the final export does not fail after training."
    )


def _trl_parser():
    from trl import TrlParser

    from dflash_hf.trainers import DFlashTrainingConfig

    return TrlParser((DFlashScriptArguments, DFlashTrainingConfig), prog="dflash-hf train")


def register(subparsers) -> None:
    """Add the `train` sub-command to `subparsers` (its flags are parsed by `TrlParser` in `run`)."""
    parser = subparsers.add_parser(
        "train",
        add_help=False,
        help="Train a DFlash drafter (TrainingArguments flags, --config recipe.yaml; works under `accelerate launch`).",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("-h", "--help", action="store_true", dest="train_help")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Parse the `train` flags (after the sub-command) with TRL's parser: `--config FILE.yaml` gives the recipe,
    flags on the command line override it; a recipe that is no YAML is a `ValueError` naming the file."""
    import yaml

    parser = _trl_parser()
    argv = _checked_recipe_argv(list(getattr(args, "train_argv", [])))
    if getattr(args, "train_help", False):
        parser.print_help()
        return 0
    try:
        script, config = parser.parse_args_and_config(argv)
    except (yaml.YAMLError, UnicodeDecodeError) as err:  # only the `--config` file is read as YAML
        recipe = argv[argv.index("--config") + 1]
        raise ValueError(
            f"--config {recipe} is not a valid YAML recipe ({err}): fix the file, or start from one of "
            "examples/recipes/."
        ) from err
    train(script, config)
    return 0


def _resolve_resume(value, output_dir: str):
    """The checkpoint to resume from: `last` is the newest *complete* `checkpoint-N` (incomplete ones are named)."""
    from dflash_hf.trainers.checkpoint_io import check_complete_checkpoint, last_complete_checkpoint

    if value is None or value is False:
        return None
    if value is True or str(value).lower() in ("last", "latest", "true", "auto"):
        last, skipped = last_complete_checkpoint(output_dir)
        for folder in skipped:
            print(f"skipping incomplete checkpoint {folder}", file=sys.stderr)
        if last is None and str(value).lower() != "auto":
            raise ValueError(
                f"--resume_from_checkpoint {value}: no complete checkpoint-* folder in {output_dir}; drop the flag to "
                "start a new run (or use 'auto' to resume only when a checkpoint exists)."
            )
        return last
    if not os.path.isdir(value):
        raise ValueError(f"--resume_from_checkpoint {value!r} is not a checkpoint folder.")
    check_complete_checkpoint(value)
    return value


def _checked_recipe_argv(argv: list[str]) -> list[str]:
    """`argv` with its `--config` recipe checked as every command's settings file is (`cli_settings.read_config`: a
    regular file of at most 1 MiB holding a mapping, nesting bounded; one error line otherwise) before TRL's parser
    reads it, and `--config=FILE` spelled `--config FILE`, the form that parser takes."""
    words = []
    for word in argv:
        words += word.split("=", 1) if word.startswith("--config=") else [word]
    places = [i for i, word in enumerate(words) if word == "--config"]
    if len(places) > 1:
        raise ValueError("--config is given more than once: name one recipe (flags override its keys).")
    if places:
        if places[0] + 1 >= len(words):
            raise ValueError("--config needs a recipe file: --config FILE.yaml.")
        read_config(words[places[0] + 1])
    return words


def train(script: DFlashScriptArguments, config) -> dict:
    """Run training end to end; returns a summary (also written to `OUTPUT_DIR/train_summary.json`)."""
    from dflash_hf.data.make import load_training_data, read_manifest
    from dflash_hf.fileio import atomic_write_text
    from dflash_hf.targets import load_target
    from dflash_hf.trainers import DFlashTrainer

    if script.export_format not in TRAIN_EXPORT_FORMATS:
        raise ValueError(
            f"--export_format must be 'dflash-hf' or 'official', got {script.export_format!r}: export the trained "
            "drafter in other layouts with `dflash-hf export`."
        )
    base_model = _base_model(script)
    _follow_log_level(config)
    folders = [p.strip() for p in script.data.split(",") if p.strip()]
    data = _concatenated([load_training_data(folder) for folder in folders])
    eval_data = load_training_data(script.eval_data) if script.eval_data else None
    resume = _resolve_resume(config.resume_from_checkpoint, config.output_dir)
    device = str(config.device)
    target, tokenizer = load_target(script.target, dtype=script.target_dtype, device=device)
    manifests = [read_manifest(folder) for folder in folders]
    for folder, manifest in zip(folders, manifests):
        if manifest and manifest.get("target_model_type") not in (None, text_config(target).model_type):
            raise ValueError(
                f"{folder} was generated by a `{manifest['target_model_type']}` target ({manifest.get('target')}) "
                f"but --target is a `{text_config(target).model_type}`: the drafter must learn the target's own outputs; "
                "regenerate the data with `dflash-hf make-data --target ...`."
            )
    trainer = DFlashTrainer(
        model=script.drafter,
        args=config,
        target=target,
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
    )
    started = time.time()
    result = trainer.train(resume_from_checkpoint=resume)
    wall = time.time() - started
    train_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    last = train_logs[-1] if train_logs else {}
    summary = {
        "global_step": trainer.state.global_step,
        "train_loss": result.training_loss,
        "last_log": last,
        "wall_seconds": round(wall, 1),
        "samples": len(trainer.train_dataset),
        "world_size": trainer.args.world_size,
        "stopped_at_time_limit": trainer.time_limit is not None and trainer.time_limit.stopped_early,
        **_throughput(trainer, result),
    }
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        drafter = trainer.accelerator.unwrap_model(trainer.model)
        export_dir = script.export_dir or os.path.join(config.output_dir, "final")
        data_name = " + ".join(_data_name(folder, manifest) for folder, manifest in zip(folders, manifests))
        training_facts = trainer.training_facts(result, last, wall, data_name)
        summary["export_dir"] = str(
            _export(drafter, export_dir, target, script, training_facts, base_model, config.max_shard_size)
        )
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(config.output_dir) / "train_summary.json", json.dumps(summary, indent=1, default=str))
        print(json.dumps({k: summary[k] for k in ("global_step", "train_loss", "export_dir")}))
    trainer.accelerator.wait_for_everyone()
    _end_distributed(trainer)
    return summary


def _throughput(trainer, result) -> dict:
    """The run's anchor-blocks trained and their rate over the Trainer's `train_runtime` (the training loop, its
    evaluations included; loading the target and the export are not), the rates of the steps after the first
    (`DFlashTrainer.warm_throughput`: compilation and warm-up left out), and the device's peak memory (CUDA)."""
    from dflash_hf.runtime import peak_memory_bytes

    blocks = trainer.anchor_blocks_trained
    runtime = float(result.metrics.get("train_runtime") or 0.0)
    peak = peak_memory_bytes(trainer.args.device)
    return {
        "anchor_blocks": blocks,
        "anchor_blocks_per_second": round(blocks / runtime, 1) if runtime > 0 else None,
        **trainer.warm_throughput(),
        "peak_device_memory_gb": None if peak is None else round(peak / 2**30, 2),
    }


def _end_distributed(trainer) -> None:
    """Tear the process group down while the interpreter is alive (a no-op in a single process).

    Left to the interpreter's exit, gloo's worker threads can abort a finished run ("terminate called without an
    active exception"). And gloo's worker thread releases the last barrier's work object a moment after the barrier
    returns, which needs the GIL: a process group destroyed (threads joined, GIL held) within that moment deadlocks.
    So the main thread first sleeps (GIL released) for a second, then destroys it."""
    if trainer.args.world_size > 1:
        time.sleep(1.0)
    trainer.accelerator.end_training()


def _follow_log_level(config) -> None:
    """Make the package's own loggers (`dflash_hf.*`) report at the Trainer's log level, like Transformers' loggers:
    `--log_level info` shows e.g. the reduced draft vocabulary's coverage."""
    import logging

    logger = logging.getLogger("dflash_hf")
    logger.setLevel(config.get_process_log_level())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[dflash-hf] %(message)s"))
        logger.addHandler(handler)


def _concatenated(parts: list):
    """One training set from several `make-data` datasets (their common columns), in order."""
    if len(parts) == 1:
        return parts[0]
    import datasets

    common = [c for c in parts[0].column_names if all(c in part.column_names for part in parts)]
    return datasets.concatenate_datasets([part.select_columns(common) for part in parts])


def _data_name(folder: str, manifest: dict | None) -> str:
    """How a data folder is named on the model card: its source and how its responses were made."""
    if not manifest:
        return folder
    decoding = manifest.get("settings", {}).get("decoding", "greedy")
    kind = "regenerated" if decoding == "greedy" else "teacher-forced"
    return f"{manifest.get('source')} ({manifest['counts']['samples']} {kind})"


def _export(
    drafter,
    export_dir: str,
    target,
    script: DFlashScriptArguments,
    training: dict,
    base_model: str,
    max_shard_size: str,
) -> Path:
    from dflash_hf.hub.export import export

    return export(
        drafter,
        export_dir,
        target=target,
        format=script.export_format,
        training=training,
        base_model=base_model,
        overwrite=True,
        max_shard_size=max_shard_size,
    )
