"""`dflash-hf bench`: compare plain greedy, prompt lookup, the native Transformers DFlash path and our engine.

Runs every method on the same prompts with the same settings in one process (greedy, batch 1), prints a Markdown
table and writes `bench.json`, `bench.md` (the README results section) and PNG plots into `--out`. Every output is
compared token by token with plain greedy decoding: the table gives each row's tokens identical to it and the first
position where they differ. In float32, and in any precision on CPU, a difference is an error (`MISMATCH` lines, exit
status 1 unless `--allow-mismatch`); in reduced precision on a GPU it is reported only. `--readme-section BENCH_JSON`
prints the README results section of an earlier run instead. See docs/design.md ("Benchmark") for how every number is
derived.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .. import bench
from ..cli_settings import add_settings, command_line, field_of, settings_of
from ..drafters import load_drafter, resolve_drafter_dir
from ..engine.checks import MAX_LOOKUP_TOKENS
from ..modeling import DFlashConfig
from ..random_targets import RANDOM_DRAFTER_BLOCK, RANDOM_DRAFTER_LAYERS
from . import (
    CpuSettings,
    ModelSettings,
    comma_separated_floats,
    comma_separated_ints,
    device_of,
    distinct_row_values,
    drafter_dir_of,
    load_models,
    setup_cpu,
    trained_block_size,
)

SKIPPABLE = ("prompt_lookup", "native_dflash", "greedy_engine_kernels", "greedy_static", "dflash")
ENGINE_ROWS = "dflash"  # --skip's name for the engine rows of the run's drafter (dflash_*)
_WITH_LLAMA_CPP = {"with": "llama_cpp"}  # recorded only with --llama-cpp


class TaggedDrafter(NamedTuple):
    """A `--compare-drafter NAME=DIR`: the rows' tag and the drafter folder."""

    name: str
    folder: Path

    def __str__(self) -> str:
        return f"{self.name}={self.folder}"


def probabilities(text: str) -> list[float]:
    """`argparse` type of `--oracle 1.0,0.8`: at least one number, each in [0, 1], each naming its own rows."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated probabilities such as 1.0,0.8, got {text!r}"
        ) from err
    if not values or not all(0.0 <= value <= 1.0 for value in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated probabilities in [0, 1] such as 1.0,0.8, got {text!r}"
        )
    return distinct_row_values(values, text)


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
        default_factory=lambda: list(bench.DEFAULT_BLOCK_SIZES),
        metadata={
            "type": comma_separated_ints,
            "help": "Fixed block sizes of our engine; those above the drafter's are left out (default: 4,8,16).",
        },
    )
    adaptive: bool = field(default=True, metadata={"help": "Leave out the adaptive block size."})
    compile: bool = field(
        default=False,
        metadata={
            "help": "Run every engine row with compile=True: the target's keys and values in a static cache, its "
            "verify forwards compiled at fixed widths (CUDA graphs on a GPU); adds greedy_static, the baseline with "
            "the same cache and compiler."
        },
    )
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
    oracle: list[float] = field(
        default_factory=list,
        metadata={
            "type": probabilities,
            "metavar": "P",
            "help": "Also run oracle rows at each of these probabilities (comma-separated, in [0, 1]) and each block "
            "size: our engine whose drafter's forward runs as always but whose drafts replay plain greedy's output on "
            "the same prompt, each slot kept with probability P (tau = (1 - P^B) / (1 - P)): the engine's cost at "
            "real sizes without a trained drafter (e.g. 1.0,0.8; default: none).",
        },
    )
    skip: str = field(
        default="",
        metadata={
            "help": "Comma-separated methods to leave out: prompt_lookup, native_dflash, greedy_engine_kernels, "
            "greedy_static (plain greedy with a static cache, compiled by Transformers: a CUDA target's fast baseline), "
            "dflash (the engine's rows with the run's drafter; oracle rows stay). Plain greedy always runs."
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
        metadata={
            **_WITH_LLAMA_CPP,
            "help": "The target's GGUF for llama.cpp (default: the named target's packaged GGUF).",
        },
    )
    llama_cpp_requantize: str | None = field(
        default=None,
        metadata={
            **_WITH_LLAMA_CPP,
            "metavar": "TYPE",
            "help": "Serve the target's GGUF requantized to TYPE by llama-quantize (e.g. F16, Q8_0, Q4_0; default: as "
            "it is).",
        },
    )
    llama_cpp_draft_tokens: list[int] | None = field(
        default=None,
        metadata={
            **_WITH_LLAMA_CPP,
            "type": comma_separated_ints,
            "help": "llama.cpp's --spec-draft-n-max, one DFlash row per value, e.g. 1,3,7 (default: the drafter's "
            "block size - 1).",
        },
    )
    llama_cpp_p_min: float = field(
        default=0.0,
        metadata={
            **_WITH_LLAMA_CPP,
            "help": "llama.cpp's --spec-draft-p-min: a draft stops at the first token the drafter gives less "
            "probability (default: 0, every drafted token).",
        },
    )
    llama_cpp_ngram: bool = field(
        default=False,
        metadata={
            **_WITH_LLAMA_CPP,
            "help": "Also run llama.cpp's own n-gram lookup (ngram-simple) alone and in front of the DFlash drafter.",
        },
    )
    llama_cpp_gguf_type: str = field(
        default="f32",
        metadata={
            **_WITH_LLAMA_CPP,
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


def _check(settings: BenchSettings) -> None:
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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` sub-command; its flags are the fields of [`BenchSettings`] (also read from `--config`)."""
    parser = subparsers.add_parser(
        "bench",
        help="Benchmark greedy, prompt lookup, native Transformers DFlash and dflash-hf (fixed and adaptive blocks).",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    add_settings(parser, BenchSettings)
    parser.set_defaults(func=run)


def _command_line(settings: BenchSettings | argparse.Namespace, threads: int | None) -> str:
    """The command with every setting spelled out, so that it reproduces this run: the settings, with the thread count
    the run used (none on a GPU).

    `--drafter` appears only as given: the target's bundled default is left implicit, so the recorded command names no
    path of the machine that ran it.
    """
    return command_line("bench", dataclasses.replace(settings_of(settings, BenchSettings), threads=threads))


def _methods(settings: BenchSettings, target, drafter, compared: dict[str, Path]) -> list[bench.BenchMethod]:
    """The run's rows: the default methods less `--skip`, the oracle rows of `--oracle`, the engine rows of each
    compared drafter, and the sampling rows of `--temperatures`."""
    engine = dict(
        block_sizes=settings.block_sizes,
        adaptive=settings.adaptive,
        lookup_branch=settings.lookup_branch,
        lookup_tokens=settings.lookup_tokens,
        draft_tree=settings.draft_tree,
        compile=settings.compile,
    )
    skipped = set(settings.skip.split(","))
    methods = bench.default_methods(target, drafter, prompt_lookup_num_tokens=settings.prompt_lookup_tokens, **engine)
    methods = [
        method
        for method in methods
        if method.name not in skipped and not (ENGINE_ROWS in skipped and method.name.startswith("dflash_"))
    ]
    if settings.oracle:
        methods += bench.oracle_methods(target, drafter, settings.oracle, settings.block_sizes, settings.compile)
    for name, folder in compared.items():
        methods += bench.drafter_methods(target, load_drafter(folder, target), name, **engine)
    if settings.temperatures:
        methods += bench.sampling_methods(
            target, drafter, settings.temperatures, settings.sampling_block_size, settings.compile
        )
    return methods


def _compared_drafters(settings: BenchSettings) -> dict[str, Path]:
    """The `--compare-drafter` folders by name, each checked before any model loads: a drafter folder, with a
    trained block size that some `--block-sizes` value fits."""
    compared = {}
    for name, folder in settings.compare_drafter:
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"--compare-drafter {name}={folder}: no DFlash drafter there (no config.json); pass a folder saved by "
                "`dflash-hf train` or `DFlashDraftModel.save_pretrained`."
            )
        compared[name] = resolve_drafter_dir(settings.target, folder)
        trained = int(DFlashConfig.from_pretrained(folder).block_size)
        if not any(size <= trained for size in settings.block_sizes):
            raise ValueError(
                f"--compare-drafter {name}={folder}: none of the block sizes {settings.block_sizes} fits its trained "
                f"block size {trained}; add a block size <= {trained} to --block-sizes."
            )
    return compared


def _llama_cpp(settings: BenchSettings, drafter, prompts, tokenizer, threads: int) -> dict:
    """llama.cpp's rows on the bench prompts and the target's forward costs ([`bench.llama_cpp.bench_part`])."""
    from ..bench import llama_cpp

    return llama_cpp.bench_part(
        settings.llama_cpp,
        settings.llama_cpp_target or settings.target,
        drafter,
        prompts,
        tokenizer,
        settings.max_new_tokens,
        threads,
        requantize_to=settings.llama_cpp_requantize,
        draft_tokens=settings.llama_cpp_draft_tokens,
        p_min=settings.llama_cpp_p_min,
        ngram=settings.llama_cpp_ngram,
        gguf_type=settings.llama_cpp_gguf_type,
    )


def _bench(settings: BenchSettings) -> tuple[bench.BenchResult, int | None]:
    """Load the models and prompts, and run every row (and llama.cpp's); the result and the CPU threads used."""
    drafter_dir = drafter_dir_of(settings.target, settings.drafter)
    device = device_of(settings.device)
    threads = setup_cpu(settings, device)
    compared = _compared_drafters(settings)
    trained = [trained_block_size(d) for d in (drafter_dir, *compared.values())]
    max_block = trained[0]  # the block the main drafter's cycle runs (a measured --dtype auto verdict times it)
    widest = max(
        bench.widest_verify(
            settings.block_sizes, size, settings.lookup_branch, settings.lookup_tokens, settings.draft_tree
        )
        for size in trained
    )
    target, tokenizer, drafter, precision = load_models(
        settings.target, drafter_dir, device, settings.dtype, max_block, widest
    )
    prompts, prompt_info = bench.load_bench_prompts(
        settings.prompts,
        tokenizer,
        num_prompts=settings.num_prompts,
        max_prompt_tokens=settings.max_prompt_tokens,
        use_chat_template=None if settings.chat_template else False,
        min_prompt_tokens=settings.min_prompt_tokens,
        prompts_dir=settings.prompts_dir,
    )
    result = bench.run_bench(
        target,
        drafter,
        prompts,
        max_new_tokens=settings.max_new_tokens,
        methods=_methods(settings, target, drafter, compared),
        warmup_tokens=settings.warmup_tokens,
        settings={
            "target": str(settings.target),
            "drafter": (
                f"random ({RANDOM_DRAFTER_LAYERS} layers, block {RANDOM_DRAFTER_BLOCK})"
                if drafter_dir is None
                else str(drafter_dir)
            ),
            "compared_drafters": {name: str(folder) for name, folder in compared.items()},
            "prompts": str(settings.prompts),
            "prompt_set": prompt_info,
            "threads": threads,
            "device": str(device),
            "precision": precision,
        },
        progress=settings.progress,
    )
    if settings.llama_cpp is not None:
        result.llama_cpp = _llama_cpp(settings, drafter, prompts, tokenizer, threads or 1)
    return result, threads


def run(args: argparse.Namespace) -> int:
    """Run the `bench` sub-command; returns the exit code (1 when an output differs from greedy)."""
    settings = settings_of(args, BenchSettings)
    if settings.readme_section is not None:
        print(bench.render_markdown(settings.readme_section, plots_prefix=settings.plots_prefix), end="")
        return 0
    _check(settings)
    result, threads = _bench(settings)
    result.command = _command_line(settings, threads)
    paths = bench.write_outputs(result, settings.out)
    print(bench.markdown_table(result), end="", flush=True)
    for table in (bench.benchmark_table(result), bench.llama_cpp_table(result)):
        if table:
            print("\n" + table, end="", flush=True)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}", flush=True)
    if result.failed:
        print(
            f"error: {len(result.mismatches)} output(s) differ from plain greedy decoding (see MISMATCH lines and "
            f"{paths['json']}); pass --allow-mismatch to exit with status 0 anyway.",
            file=sys.stderr,
        )
        return 0 if settings.allow_mismatch else 1
    if not result.exact:
        print(
            f"note: {len(result.mismatches)} output(s) differ from plain greedy decoding in {result.settings['dtype']} "
            f"on {result.settings['device']} (each row's identical tokens and first difference: the table's exact "
            "column); every committed token is the target's argmax of its own verify forward.",
            file=sys.stderr,
        )
    return 0
