"""The settings of `dflash-hf bench` (its flags, `--config FILE.yaml` keys and recorded command) and their checks."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..bench.methods import DEFAULT_BLOCK_SIZES
from ..engine.checks import MAX_LOOKUP_TOKENS
from . import CpuSettings, ModelSettings, comma_separated_floats, comma_separated_ints
from .settings import field_of

SKIPPABLE = ("prompt_lookup", "native_dflash", "greedy_engine_kernels")
LLAMA_CPP = {"with": "llama_cpp"}  # recorded only with --llama-cpp


class TaggedDrafter(NamedTuple):
    """A `--compare-drafter NAME=DIR`: the rows' tag and the drafter folder."""

    name: str
    folder: Path

    def __str__(self) -> str:
        return f"{self.name}={self.folder}"


def tagged_drafter(text: str) -> TaggedDrafter:
    """`argparse` type of `--compare-drafter NAME=DIR`: the row tag (letters, digits, `-`, `_`, `.`) and the folder."""
    name, sep, folder = text.partition("=")
    if not sep or not folder or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(
            f"expected NAME=DIR with a NAME of letters, digits, '-', '_' or '.', such as markov=runs/m/final, got {text!r}"
        )
    return TaggedDrafter(name, Path(folder))


@dataclass(kw_only=True)
class BenchSettings:
    """What `dflash-hf bench` runs, in the order its recorded command names it."""

    target: str = field_of(ModelSettings, "target")
    drafter: Path | None = field_of(ModelSettings, "drafter")
    compare_drafter: list[TaggedDrafter] = field(
        default_factory=list,
        metadata={
            "type": tagged_drafter,
            "action": "append",
            "metavar": "NAME=DIR",
            "help": "Also run our engine's rows with this drafter (repeatable), labelled [NAME], against the same "
            "plain greedy on the same prompts: drafters side by side in one run (e.g. an ablation).",
        },
    )
    prompts: str = field(
        default="humaneval",
        metadata={
            "help": "One prompt set or several, comma-separated: gsm8k, math500, mbpp, mt-bench (from --prompts-dir "
            "offline, else from the Hub through datasets), humaneval, sharegpt (the ShareGPT held-out split as this "
            "version of make-data computes it), suite (the DFlash paper's gsm8k,math500,mbpp,mt-bench,humaneval; tau "
            "per benchmark is reported), a make-data folder (exactly its held_out.jsonl: use the folder the drafter "
            "was trained on), or a .json/.jsonl file of prompts or chat messages (default: humaneval)."
        },
    )
    prompts_dir: Path | None = field(
        default=None,
        metadata={
            "help": "Folder of <benchmark>.jsonl files (rows with a `prompt`) for the named benchmarks, read instead "
            "of the Hub (default: $DFLASH_HF_BENCH_PROMPTS)."
        },
    )
    num_prompts: int = field(default=10, metadata={"help": "Number of prompts per set (default: 10)."})
    max_new_tokens: int = field(default=128, metadata={"help": "Most new tokens per prompt (default: 128)."})
    max_prompt_tokens: int = field(default=512, metadata={"help": "Skip longer prompts (default: 512 tokens)."})
    min_prompt_tokens: int = field(
        default=1,
        metadata={
            "help": "Skip shorter prompts: a long-context run, e.g. prompts longer than a sliding window (default: 1)."
        },
    )
    block_sizes: list[int] = field(
        default_factory=lambda: list(DEFAULT_BLOCK_SIZES),
        metadata={
            "type": comma_separated_ints,
            "help": "Fixed block sizes of our engine; those above the drafter's are left out (default: 4,8,16).",
        },
    )
    adaptive: bool = field(default=True, metadata={"help": "Leave out the adaptive block size."})
    draft_tree: bool = field(default=True, metadata={"help": 'Leave out the draft-tree rows (candidates="tree").'})
    lookup_branch: bool = field(
        default=True,
        metadata={
            "help": "Leave out dflash-hf with a prompt-lookup branch in every verify (candidates='dflash+lookup')."
        },
    )
    lookup_tokens: list[int] = field(
        default_factory=list,
        metadata={
            "type": comma_separated_ints,
            "help": "Also run the lookup-branch row with branches of at most these many tokens (e.g. 3; default: only "
            "the engine's default, 7 or the block size - 1 if more).",
        },
    )
    temperatures: list[float] = field(
        default_factory=list,
        metadata={
            "type": comma_separated_floats,
            "help": "Also benchmark sampling at these temperatures: plain sampling and dflash-hf with each draft "
            "proposal (argmax, sample), compared in speed with plain sampling (e.g. 0.7,1.0; default: none).",
        },
    )
    sampling_block_size: int = field(
        default=4, metadata={"with": "temperatures", "help": "Block size of the sampling rows (default: 4)."}
    )
    skip: str = field(
        default="",
        metadata={
            "help": "Comma-separated methods to leave out: prompt_lookup, native_dflash, greedy_engine_kernels (plain "
            "greedy always runs)."
        },
    )
    prompt_lookup_tokens: int = field(default=10, metadata={"help": "prompt_lookup_num_tokens (default: 10)."})
    warmup_tokens: int = field(
        default=16, metadata={"help": "Untimed warm-up tokens per method (default: 16; 0: none)."}
    )
    chat_template: bool = field(
        default=True, metadata={"help": "Tokenize prompts as plain text even if a template exists."}
    )
    dtype: str = field_of(ModelSettings, "dtype")
    threads: int | None = field_of(CpuSettings, "threads")
    mkl_mode: str = field_of(CpuSettings, "mkl_mode", {"with": "threads"})
    device: str = field(default="cpu", metadata={"help": "Device for both models (default: cpu)."})
    out: Path = field(default=Path("bench-results"), metadata={"help": "Output folder (default: bench-results)."})
    allow_mismatch: bool = field(
        default=False,
        metadata={"recorded": False, "help": "Exit with status 0 even if an output differs from greedy."},
    )
    progress: bool = field(default=True, metadata={"recorded": False, "help": "Hide the progress bars."})
    llama_cpp: Path | None = field(
        default=None,
        metadata={
            "metavar": "BIN_DIR",
            "help": "Also run llama.cpp (its build/bin folder with llama-server; llama-bench and llama-quantize used "
            "when there): plain greedy and with the drafter exported as GGUF (--spec-type draft-dflash), on the same "
            "prompts, and the target's forward costs in plain steps; rows in the report and bench.json.",
        },
    )
    llama_cpp_target: str | None = field(
        default=None,
        metadata={**LLAMA_CPP, "help": "The target's GGUF for llama.cpp (default: the named target's packaged GGUF)."},
    )
    llama_cpp_requantize: str | None = field(
        default=None,
        metadata={
            **LLAMA_CPP,
            "metavar": "TYPE",
            "help": "Serve the target's GGUF requantized to TYPE by llama-quantize (e.g. F16, Q8_0, Q4_0; default: as "
            "it is).",
        },
    )
    llama_cpp_draft_tokens: list[int] | None = field(
        default=None,
        metadata={
            **LLAMA_CPP,
            "type": comma_separated_ints,
            "help": "llama.cpp's --spec-draft-n-max, one DFlash row per value, e.g. 1,3,7 (default: the drafter's "
            "block size - 1).",
        },
    )
    llama_cpp_p_min: float = field(
        default=0.0,
        metadata={
            **LLAMA_CPP,
            "help": "llama.cpp's --spec-draft-p-min: a draft stops at the first token the drafter gives less "
            "probability (default: 0, every drafted token).",
        },
    )
    llama_cpp_ngram: bool = field(
        default=False,
        metadata={
            **LLAMA_CPP,
            "help": "Also run llama.cpp's own n-gram lookup (ngram-simple) alone and in front of the DFlash drafter.",
        },
    )
    llama_cpp_gguf_type: str = field(
        default="f32",
        metadata={
            **LLAMA_CPP,
            "help": "Weight type of the drafter's GGUF for llama.cpp: f32 (default), f16, bf16 or q8_0.",
        },
    )
    readme_section: Path | None = field(
        default=None,
        metadata={
            "recorded": False,
            "metavar": "BENCH_JSON",
            "help": "Print the README results section of an earlier run's bench.json and exit (runs nothing).",
        },
    )
    plots_prefix: str | None = field(
        default=None,
        metadata={
            "recorded": False,
            "help": "With --readme-section: path of the plot folder as seen from the README (default: the JSON's "
            "folder).",
        },
    )


def check(settings: BenchSettings) -> None:
    """A `ValueError` naming the flag and the fix for settings no run can use."""
    for flag, value, low in (
        ("--num-prompts", settings.num_prompts, 1),
        ("--max-new-tokens", settings.max_new_tokens, 1),
        ("--max-prompt-tokens", settings.max_prompt_tokens, 1),
        ("--min-prompt-tokens", settings.min_prompt_tokens, 1),
        ("--prompt-lookup-tokens", settings.prompt_lookup_tokens, 1),
        ("--warmup-tokens", settings.warmup_tokens, 0),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}.")
    for count in settings.lookup_tokens:
        if not 1 <= count <= MAX_LOOKUP_TOKENS:
            raise ValueError(f"--lookup-tokens must be between 1 and {MAX_LOOKUP_TOKENS}, got {count}.")
    if settings.min_prompt_tokens > settings.max_prompt_tokens:
        raise ValueError(
            f"--min-prompt-tokens {settings.min_prompt_tokens} exceeds --max-prompt-tokens "
            f"{settings.max_prompt_tokens}: no prompt could be used."
        )
    if settings.out.exists() and not settings.out.is_dir():
        raise ValueError(f"--out {settings.out} exists and is not a folder: pass a folder path.")
    if settings.llama_cpp is not None and not (settings.llama_cpp / "llama-server").is_file():
        raise ValueError(f"--llama-cpp {settings.llama_cpp} holds no llama-server: pass llama.cpp's build/bin folder.")
    if not 0.0 <= settings.llama_cpp_p_min < 1.0:
        raise ValueError(f"--llama-cpp-p-min must lie in [0, 1), got {settings.llama_cpp_p_min}.")
    unknown = {name for name in settings.skip.split(",") if name} - set(SKIPPABLE)
    if unknown:
        raise ValueError(f"--skip takes {', '.join(SKIPPABLE)} (comma-separated), got {sorted(unknown)}.")
    names = [tagged.name for tagged in settings.compare_drafter]
    if len(set(names)) != len(names):
        raise ValueError(f"--compare-drafter names must differ (they tag the rows), got {names}.")
