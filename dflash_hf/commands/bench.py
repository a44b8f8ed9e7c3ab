"""`dflash-hf bench`: compare plain greedy, prompt lookup, the native Transformers DFlash path and our engine.

Runs every method on the same prompts with the same settings in one process (greedy, batch 1), prints a Markdown
table and writes `bench.json`, `bench.md` (the README results section) and PNG plots into `--out`. Every output is
compared token by token with plain greedy decoding; any difference is reported with the prompt index and makes the
command exit with status 1 unless `--allow-mismatch`. `--readme-section BENCH_JSON` prints the README results section
of an earlier run instead. See docs/design.md ("Benchmark") for how every number is derived.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from .. import bench
from ..drafters import load_drafter, resolve_drafter_dir
from ..modeling import DFlashConfig
from . import device_of, load_models, setup_cpu
from .bench_settings import BenchSettings, check
from .settings import add_settings, command_line, settings_of


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
    """The run's rows: the default methods less `--skip`, the engine rows of each compared drafter, and the sampling
    rows of `--temperatures`."""
    engine = dict(
        block_sizes=settings.block_sizes,
        adaptive=settings.adaptive,
        lookup_branch=settings.lookup_branch,
        lookup_tokens=settings.lookup_tokens,
        draft_tree=settings.draft_tree,
    )
    skipped = set(settings.skip.split(","))
    methods = bench.default_methods(target, drafter, prompt_lookup_num_tokens=settings.prompt_lookup_tokens, **engine)
    methods = [method for method in methods if method.name not in skipped]
    for name, folder in compared.items():
        methods += bench.drafter_methods(target, load_drafter(folder, target), name, **engine)
    if settings.temperatures:
        methods += bench.sampling_methods(target, drafter, settings.temperatures, settings.sampling_block_size)
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
    """llama.cpp's rows on the bench prompts (the drafter exported as GGUF into a temporary folder, against the GGUF
    llama.cpp serves) and the target's forward costs."""
    import tempfile

    from ..bench import llama_cpp
    from ..hub.gguf import target_gguf_file, write_gguf

    target = settings.llama_cpp_target or settings.target
    draft_tokens = settings.llama_cpp_draft_tokens or [int(drafter.config.block_size) - 1]
    with tempfile.TemporaryDirectory(prefix="dflash-hf-llama-cpp-") as scratch, target_gguf_file(target) as gguf:
        served = Path(gguf)
        if settings.llama_cpp_requantize:
            served = llama_cpp.requantize(
                settings.llama_cpp,
                gguf,
                settings.llama_cpp_requantize,
                Path(scratch) / f"target-{settings.llama_cpp_requantize}.gguf",
            )
        drafter_gguf = write_gguf(
            drafter, Path(scratch) / "drafter.gguf", target=served, gguf_type=settings.llama_cpp_gguf_type
        )
        dflash = [llama_cpp.dflash_setup(drafter_gguf, n, threads, settings.llama_cpp_p_min) for n in draft_tokens]
        setups = list(dflash)
        if settings.llama_cpp_ngram:
            setups += [llama_cpp.ngram_setup(max(draft_tokens))]
            setups += [llama_cpp.ngram_setup(n, drafter=setup) for n, setup in zip(draft_tokens, dflash)]
        rows = llama_cpp.run_llama_cpp(
            settings.llama_cpp, served, setups, prompts, tokenizer, settings.max_new_tokens, threads
        )
        depth = round(sum(len(p.input_ids) for p in prompts) / len(prompts) + settings.max_new_tokens / 2)
        costs = llama_cpp.forward_costs(
            settings.llama_cpp, served, threads, depth, [1, 2, *(n + 1 for n in draft_tokens)]
        )
    part = {
        "binary_dir": str(settings.llama_cpp),
        "target_gguf": Path(gguf).name
        + (f" requantized to {settings.llama_cpp_requantize}" if settings.llama_cpp_requantize else ""),
        "gguf_type": settings.llama_cpp_gguf_type,
        "draft_tokens": draft_tokens,
        "p_min": settings.llama_cpp_p_min,
        "threads": threads,
    }
    return llama_cpp.rows_to_json(rows, part, costs)


def _bench(settings: BenchSettings) -> tuple[bench.BenchResult, int | None]:
    """Load the models and prompts, and run every row (and llama.cpp's); the result and the CPU threads used."""
    drafter_dir = resolve_drafter_dir(settings.target, settings.drafter)
    device = device_of(settings.device)
    threads = setup_cpu(settings, device)
    compared = _compared_drafters(settings)
    trained = [int(DFlashConfig.from_pretrained(d).block_size) for d in (drafter_dir, *compared.values())]
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
            "drafter": str(drafter_dir),
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
    check(settings)
    result, threads = _bench(settings)
    result.command = _command_line(settings, threads)
    paths = bench.write_outputs(result, settings.out)
    print(bench.markdown_table(result), end="", flush=True)
    for table in (bench.benchmark_table(result), bench.llama_cpp_table(result)):
        if table:
            print("\n" + table, end="", flush=True)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}", flush=True)
    if not result.exact:
        print(
            f"error: {len(result.mismatches)} output(s) differ from plain greedy decoding (see MISMATCH lines and "
            f"{paths['json']}); pass --allow-mismatch to exit with status 0 anyway.",
            file=sys.stderr,
        )
        return 0 if settings.allow_mismatch else 1
    return 0
