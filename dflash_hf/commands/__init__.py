"""Sub-commands of the `dflash-hf` CLI (see `dflash_hf.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cli_settings import add_fields
from ..mkl_choice import MKL_MODES
from ..runtime import available_cpus
from ..targets import DEFAULT_TARGET, target_names


def load_models(
    target: str,
    drafter_dir: Path | None,
    device: torch.device,
    dtype: str = "float32",
    max_block: int = 16,
    verify_tokens: int | None = None,
):
    """Load `(target, tokenizer, drafter, precision)` on `device`, the drafter in the target's dtype, without loading
    bars. `precision` says which dtype was used and why. `drafter_dir=None` (a random target without `--drafter`):
    an untrained drafter of the DFlash paper's shape for the target (`random_targets.random_drafter`).

    `verify_tokens` is the widest verify the caller will run (a block of `max_block` plus a prompt-lookup branch;
    default `max_block`). `dtype="auto"`: bfloat16 on CUDA; on a CPU that computes bf16 natively, the precision that
    runs such a DFlash cycle faster, measured once per machine (`dflash_hf.precision`); float32 on other CPUs. A
    reduced-precision target on CPU is made row-exact for verifies of up to `verify_tokens` tokens
    (`target.row_exact.install_if_needed`); asked for explicitly where that is not bit-exact, it is kept and the
    reason says so.
    """
    from transformers.utils import logging as hf_logging

    from ..drafters import load_drafter
    from ..fileio import cache_dir
    from ..precision import measured_choice
    from ..random_targets import random_drafter
    from ..runtime import inference_dtype
    from ..target import row_exact
    from ..targets import load_target

    verify_tokens = max_block if verify_tokens is None else verify_tokens
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading bars would interleave with the output; cache builds show their own
    try:
        chosen, reason = inference_dtype(dtype, device)
        native_bf16 = dtype == "auto" and device.type == "cpu" and chosen != torch.float32
        if native_bf16 and drafter_dir is not None:  # measure which precision pays
            return measured_choice(target, drafter_dir, device, max_block, verify_tokens, cache_dir())
        model, tokenizer = load_target(target, dtype=chosen, device=device)
        exact = row_exact.install_if_needed(model, verify_tokens)
        if exact is not None:
            reason += "; block verification checked bit-exact" if exact else "; block verification NOT bit-exact here"
        drafter = random_drafter(model) if drafter_dir is None else load_drafter(drafter_dir, model)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model, tokenizer, drafter, f"{str(model.dtype).replace('torch.', '')} ({reason})"


@contextlib.contextmanager
def hidden_progress_bars(hide: bool) -> Iterator[None]:
    """With `hide`, run the block with the progress bars of Transformers (model loading), `datasets` (saving and
    mapping datasets) and huggingface_hub (downloads) off (a command's `--quiet`); each library's setting is restored
    afterwards."""
    if not hide:
        yield
        return
    import datasets
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    with contextlib.ExitStack() as restore:
        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore.callback(hf_logging.enable_progress_bar)
        if not datasets.are_progress_bars_disabled():
            datasets.disable_progress_bars()
            restore.callback(datasets.enable_progress_bars)
        if not are_progress_bars_disabled():
            disable_progress_bars()  # a plain call: older huggingface_hub releases have no context manager
            restore.callback(enable_progress_bars)
        yield


@dataclass(kw_only=True)
class TapSettings:
    """Which target features a features folder stores (cache-features, make-data --features-out)."""

    target_layer_ids: list[int] | None = field(
        default=None, metadata={"type": int, "nargs": "+", "help": "Tapped layers (default: spread)."}
    )
    num_target_features: int = field(default=5, metadata={"help": "Number of taps if no ids are given."})
    drafter: str | None = field(default=None, metadata={"help": "Take the tapped layers from this drafter's config."})
    final_hidden: bool = field(
        default=True,
        metadata={
            "help": "Do not store the target's final hidden states (the distillation teacher; H values per token)."
        },
    )


def add_tap_arguments(parser: argparse.ArgumentParser) -> None:
    """`--target-layer-ids`, `--num-target-features`, `--drafter` and `--no-final-hidden` ([`TapSettings`])."""
    add_fields(parser, TapSettings)


def target_layer_ids_of(args: TapSettings | argparse.Namespace, target) -> list[int]:
    """The tapped layers asked for by [`TapSettings`]: explicit ids, a drafter's, or spread ones."""
    from ..drafters import drafter_source
    from ..modeling import DFlashConfig, default_target_layer_ids

    if args.drafter:
        return list(DFlashConfig.from_pretrained(drafter_source(args.drafter)).target_layer_ids)
    if args.target_layer_ids is not None:
        return list(args.target_layer_ids)
    text = target.config.get_text_config(decoder=True)
    return default_target_layer_ids(int(text.num_hidden_layers), args.num_target_features)


def comma_separated_ints(text: str) -> list[int]:
    """`argparse` type of flags such as `--block-sizes 4,8,16`: at least one integer, each >= 1."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 4,8,16, got {text!r}") from err
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 4,8,16, got {text!r}")
    return values


def comma_separated_floats(text: str) -> list[float]:
    """`argparse` type of flags such as `--temperatures 0.7,1.0`: at least one finite number, each > 0, each naming
    its own bench rows."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 0.7,1.0, got {text!r}") from err
    if not values or not all(0 < value < math.inf for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers such as 0.7,1.0, got {text!r}")
    return distinct_row_values(values, text)


def distinct_row_values(values: list[float], text: str) -> list[float]:
    """`values` (`-0` as `0`) when no two name the same bench row (`f"{value:g}"`); an `ArgumentTypeError` naming
    the repeated one otherwise."""
    values = [value + 0.0 for value in values]
    names = [f"{value:g}" for value in values]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"{', '.join(repeated)} given more than once in {text!r}: list each value once"
        )
    return values


@dataclass(kw_only=True)
class CpuSettings:
    """How the commands that run models on the CPU use it (see [`setup_cpu`])."""

    threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads for torch, at most the CPUs available to this process (default: all "
            f"{available_cpus()})."
        },
    )
    mkl_mode: str = field(
        default="auto",
        metadata={
            "choices": MKL_MODES,
            "help": "MKL's code path for float32 matmuls: auto (the default) takes the one measured fastest on this "
            "machine for decoding's few-row matmuls (MKL's default or one of its MKL_CBWR modes; timed once, about "
            "10 s, the verdict kept in the dflash-hf cache), cnr sets MKL_CBWR=AUTO, default leaves MKL alone. A "
            "MKL_CBWR in the environment is kept.",
        },
    )


def add_cpu_arguments(parser: argparse.ArgumentParser) -> None:
    """`--threads` and `--mkl-mode` ([`CpuSettings`])."""
    add_fields(parser, CpuSettings)


def drafter_dir_of(target: str, drafter: Path | None) -> Path | None:
    """The drafter folder of `--target` / `--drafter` ([`resolve_drafter_dir`]); `None` for a random target without
    `--drafter`, which [`load_models`] gives a random drafter."""
    from ..drafters import resolve_drafter_dir
    from ..random_targets import is_random_target

    return None if drafter is None and is_random_target(target) else resolve_drafter_dir(target, drafter)


def trained_block_size(drafter_dir: Path | None) -> int:
    """The block size the drafter of [`drafter_dir_of`] was trained on (`None`: the random drafter's)."""
    from ..modeling import DFlashConfig
    from ..random_targets import RANDOM_DRAFTER_BLOCK

    return RANDOM_DRAFTER_BLOCK if drafter_dir is None else int(DFlashConfig.from_pretrained(drafter_dir).block_size)


def device_of(name: str | None) -> torch.device:
    """The device `--device name` asks for (`None`: cuda when available, else cpu); a `ValueError` naming the fix
    when it is no device, or one this machine lacks."""
    from ..runtime import default_device

    name = name or default_device()
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N.") from err
    if device.type == "meta":
        raise ValueError("--device meta holds no values to compute with: use cpu, cuda or cuda:N.")
    if device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as err:  # noqa: BLE001 - each backend says "absent" its own way (AssertionError, RuntimeError)
            reason = " ".join(str(err).split()) or type(err).__name__
            raise ValueError(f"--device {name}: this machine cannot use it ({reason}); use --device cpu.") from err
    return device


def setup_cpu(args: CpuSettings | argparse.Namespace, device: torch.device) -> int | None:
    """Apply `--mkl-mode` (before any matmul runs) and `--threads` on a CPU device; returns the thread count (`None`
    on other devices)."""
    from ..mkl_choice import select_mkl_mode

    if args.threads is not None and not 1 <= args.threads <= available_cpus():
        raise ValueError(
            f"--threads must be between 1 and {available_cpus()} (the CPUs available to this process), got "
            f"{args.threads}."
        )
    if device.type != "cpu":
        return None
    threads = args.threads or available_cpus()
    select_mkl_mode(args.mkl_mode, threads)
    torch.set_num_threads(threads)
    return threads


@dataclass(kw_only=True)
class ModelSettings:
    """The target and the drafter of the commands that run both."""

    target: str = field(
        default=DEFAULT_TARGET,
        metadata={
            "help": f"Named target ({target_names()}; random:* are public models' shapes with random weights, built on "
            f"the device), model folder or Hub id (default: {DEFAULT_TARGET})."
        },
    )
    drafter: Path | None = field(
        default=None, metadata={"help": "DFlash drafter folder (default: the drafter bundled for a named target)."}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "float32", "bfloat16"],
            "help": "Precision of both models (default: auto = bfloat16 on CUDA; on CPUs with native bf16 (AMX-BF16 / "
            "AVX512-BF16) the one that runs a DFlash cycle faster, measured once per machine with exact (row-exact) "
            "bf16 verification, else float32). Plain greedy decoding, the reference for exactness and speed, runs in "
            "the same precision.",
        },
    )


def add_model_arguments(parser: argparse.ArgumentParser, dtype: bool = True) -> None:
    """`--target`, `--drafter` and (with `dtype`) `--dtype` ([`ModelSettings`])."""
    add_fields(parser, ModelSettings, exclude=() if dtype else ("dtype",))
