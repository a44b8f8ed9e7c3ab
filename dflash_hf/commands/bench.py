"""`dflash-hf bench`: compare plain greedy, prompt lookup, the native Transformers DFlash path and our engine.

Runs every method on the same prompts with the same settings in one process (greedy, batch 1), prints a Markdown
table and writes `bench.json`, `bench.md` (the README results section) and PNG plots into `--out`. Every output is
compared token by token with plain greedy decoding; any difference is reported with the prompt index and makes the
command exit with status 1 unless `--allow-mismatch`. `--readme-section BENCH_JSON` prints the README results section
of an earlier run instead. See docs/design.md ("Benchmark") for how every number is derived.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from .. import bench
from ..drafters import load_drafter, resolve_drafter_dir
from ..engine.checks import MAX_LOOKUP_TOKENS
from ..modeling import DFlashConfig
from . import (
    add_cpu_arguments,
    add_model_arguments,
    comma_separated_floats,
    comma_separated_ints,
    device_of,
    load_models,
    setup_cpu,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` sub-command."""
    # long only because it declares every flag, one `add_argument` each
    parser = subparsers.add_parser(
        "bench",
        help="Benchmark greedy, prompt lookup, native Transformers DFlash and dflash-hf (fixed and adaptive blocks).",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--compare-drafter",
        type=tagged_drafter,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="Also run our engine's rows with this drafter (repeatable), labelled [NAME], against the same plain "
        "greedy on the same prompts: drafters side by side in one run (e.g. an ablation).",
    )
    parser.add_argument(
        "--prompts",
        default="humaneval",
        help="One prompt set or several, comma-separated: gsm8k, math500, mbpp, mt-bench (from --prompts-dir offline, "
        "else from the Hub through datasets), humaneval, sharegpt (the ShareGPT held-out split as this version of "
        "make-data computes it), suite (the DFlash paper's gsm8k,math500,mbpp,mt-bench,humaneval; tau per benchmark "
        "is reported), a make-data folder (exactly its held_out.jsonl: use the folder the drafter was trained on), or "
        "a .json/.jsonl file of prompts or chat messages (default: humaneval).",
    )
    parser.add_argument(
        "--prompts-dir",
        type=Path,
        default=None,
        help="Folder of <benchmark>.jsonl files (rows with a `prompt`) for the named benchmarks, read instead of the "
        "Hub (default: $DFLASH_HF_BENCH_PROMPTS).",
    )
    parser.add_argument("--num-prompts", type=int, default=10, help="Number of prompts per set (default: 10).")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Most new tokens per prompt (default: 128).")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="Skip longer prompts (default: 512 tokens).")
    parser.add_argument(
        "--min-prompt-tokens",
        type=int,
        default=1,
        help="Skip shorter prompts: a long-context run, e.g. prompts longer than a sliding window (default: 1).",
    )
    parser.add_argument(
        "--block-sizes",
        type=comma_separated_ints,
        default=list(bench.DEFAULT_BLOCK_SIZES),
        help="Fixed block sizes of our engine; those above the drafter's are left out (default: 4,8,16).",
    )
    parser.add_argument("--no-adaptive", action="store_true", help="Leave out the adaptive block size.")
    parser.add_argument(
        "--no-draft-tree", action="store_true", help='Leave out the draft-tree rows (candidates="tree").'
    )
    parser.add_argument(
        "--no-lookup-branch",
        action="store_true",
        help="Leave out dflash-hf with a prompt-lookup branch in every verify (candidates='dflash+lookup').",
    )
    parser.add_argument(
        "--lookup-tokens",
        type=comma_separated_ints,
        default=[],
        help="Also run the lookup-branch row with branches of at most these many tokens (e.g. 3; default: only the "
        "engine's default, 7 or the block size - 1 if more).",
    )
    parser.add_argument(
        "--temperatures",
        type=comma_separated_floats,
        default=[],
        help="Also benchmark sampling at these temperatures: plain sampling and dflash-hf with each draft proposal "
        "(argmax, sample), compared in speed with plain sampling (e.g. 0.7,1.0; default: none).",
    )
    parser.add_argument(
        "--sampling-block-size", type=int, default=4, help="Block size of the sampling rows (default: 4)."
    )
    parser.add_argument(
        "--skip",
        default="",
        help="Comma-separated methods to leave out: prompt_lookup, native_dflash, greedy_engine_kernels (plain greedy "
        "always runs).",
    )
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (default: 10).")
    parser.add_argument(
        "--warmup-tokens", type=int, default=16, help="Untimed warm-up tokens per method (default: 16; 0: none)."
    )
    parser.add_argument(
        "--no-chat-template", action="store_true", help="Tokenize prompts as plain text even if a template exists."
    )
    add_cpu_arguments(parser)
    parser.add_argument("--device", default="cpu", help="Device for both models (default: cpu).")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="Output folder (default: bench-results)."
    )
    parser.add_argument(
        "--allow-mismatch", action="store_true", help="Exit with status 0 even if an output differs from greedy."
    )
    parser.add_argument("--no-progress", action="store_true", help="Hide the progress bars.")
    _add_llama_cpp_arguments(parser)
    parser.add_argument(
        "--readme-section",
        type=Path,
        default=None,
        metavar="BENCH_JSON",
        help="Print the README results section of an earlier run's bench.json and exit (runs nothing).",
    )
    parser.add_argument(
        "--plots-prefix",
        default=None,
        help="With --readme-section: path of the plot folder as seen from the README (default: the JSON's folder).",
    )
    parser.set_defaults(func=run)


def _add_llama_cpp_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--llama-cpp*` flags: llama.cpp's rows beside the engine's."""
    parser.add_argument(
        "--llama-cpp",
        type=Path,
        default=None,
        metavar="BIN_DIR",
        help="Also run llama.cpp (its build/bin folder with llama-server; llama-bench and llama-quantize used when "
        "there): plain greedy and with the drafter exported as GGUF (--spec-type draft-dflash), on the same prompts, "
        "and the target's forward costs in plain steps; rows in the report and bench.json.",
    )
    parser.add_argument(
        "--llama-cpp-target",
        default=None,
        help="The target's GGUF for llama.cpp (default: the named target's packaged GGUF).",
    )
    parser.add_argument(
        "--llama-cpp-requantize",
        default=None,
        metavar="TYPE",
        help="Serve the target's GGUF requantized to TYPE by llama-quantize (e.g. F16, Q8_0, Q4_0; default: as it is).",
    )
    parser.add_argument(
        "--llama-cpp-draft-tokens",
        type=comma_separated_ints,
        default=None,
        help="llama.cpp's --spec-draft-n-max, one DFlash row per value, e.g. 1,3,7 (default: the drafter's block "
        "size - 1).",
    )
    parser.add_argument(
        "--llama-cpp-p-min",
        type=float,
        default=0.0,
        help="llama.cpp's --spec-draft-p-min: a draft stops at the first token the drafter gives less probability "
        "(default: 0, every drafted token).",
    )
    parser.add_argument(
        "--llama-cpp-ngram",
        action="store_true",
        help="Also run llama.cpp's own n-gram lookup (ngram-simple) alone and in front of the DFlash drafter.",
    )
    parser.add_argument(
        "--llama-cpp-gguf-type",
        default="f32",
        help="Weight type of the drafter's GGUF for llama.cpp: f32 (default), f16, bf16 or q8_0.",
    )


def tagged_drafter(text: str) -> tuple[str, Path]:
    """`argparse` type of `--compare-drafter NAME=DIR`: the row tag (letters, digits, `-`, `_`, `.`) and the folder."""
    name, sep, folder = text.partition("=")
    if not sep or not folder or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(
            f"expected NAME=DIR with a NAME of letters, digits, '-', '_' or '.', such as markov=runs/m/final, got {text!r}"
        )
    return name, Path(folder)


def _command_line(args: argparse.Namespace, threads: int | None) -> str:
    """The full command with every setting spelled out, so that it reproduces this run.

    `--drafter` appears only as given: the target's bundled default is left implicit, so the recorded command names no
    path of the machine that ran it.
    """
    argv = ["dflash-hf", "bench", "--target", str(args.target)]
    if args.drafter is not None:
        argv += ["--drafter", str(args.drafter)]
    for name, folder in args.compare_drafter:
        argv += ["--compare-drafter", f"{name}={folder}"]
    argv += [
        "--prompts", str(args.prompts),
        "--num-prompts", str(args.num_prompts),
        "--max-new-tokens", str(args.max_new_tokens),
        "--max-prompt-tokens", str(args.max_prompt_tokens),
        "--min-prompt-tokens", str(args.min_prompt_tokens),
        "--block-sizes", ",".join(map(str, args.block_sizes)),
        "--prompt-lookup-tokens", str(args.prompt_lookup_tokens),
        "--warmup-tokens", str(args.warmup_tokens),
        "--device", str(args.device),
        "--dtype", str(args.dtype),
        "--out", str(args.out),
    ]  # fmt: skip
    if args.prompts_dir is not None:
        argv += ["--prompts-dir", str(args.prompts_dir)]
    if args.llama_cpp is not None:
        argv += ["--llama-cpp", str(args.llama_cpp), "--llama-cpp-gguf-type", args.llama_cpp_gguf_type]
        if args.llama_cpp_target is not None:
            argv += ["--llama-cpp-target", str(args.llama_cpp_target)]
        if args.llama_cpp_requantize is not None:
            argv += ["--llama-cpp-requantize", str(args.llama_cpp_requantize)]
        if args.llama_cpp_draft_tokens is not None:
            argv += ["--llama-cpp-draft-tokens", ",".join(map(str, args.llama_cpp_draft_tokens))]
        if args.llama_cpp_p_min > 0:
            argv += ["--llama-cpp-p-min", f"{args.llama_cpp_p_min:g}"]
        if args.llama_cpp_ngram:
            argv += ["--llama-cpp-ngram"]
    if threads is not None:
        argv += ["--threads", str(threads), "--mkl-mode", str(args.mkl_mode)]
    if args.lookup_tokens:
        argv += ["--lookup-tokens", ",".join(map(str, args.lookup_tokens))]
    if args.temperatures:
        argv += ["--temperatures", ",".join(f"{t:g}" for t in args.temperatures)]
        argv += ["--sampling-block-size", str(args.sampling_block_size)]
    argv += [
        flag
        for flag, on in (
            ("--no-adaptive", args.no_adaptive),
            ("--no-lookup-branch", args.no_lookup_branch),
            ("--no-draft-tree", args.no_draft_tree),
            ("--no-chat-template", args.no_chat_template),
        )
        if on
    ]
    if args.skip:
        argv += ["--skip", args.skip]
    return shlex.join(argv)


def _check(args: argparse.Namespace) -> None:
    for flag, value, low in (
        ("--num-prompts", args.num_prompts, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--max-prompt-tokens", args.max_prompt_tokens, 1),
        ("--min-prompt-tokens", args.min_prompt_tokens, 1),
        ("--prompt-lookup-tokens", args.prompt_lookup_tokens, 1),
        ("--warmup-tokens", args.warmup_tokens, 0),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}.")
    for count in args.lookup_tokens or ():
        if not 1 <= count <= MAX_LOOKUP_TOKENS:
            raise ValueError(f"--lookup-tokens must be between 1 and {MAX_LOOKUP_TOKENS}, got {count}.")
    if args.min_prompt_tokens > args.max_prompt_tokens:
        raise ValueError(
            f"--min-prompt-tokens {args.min_prompt_tokens} exceeds --max-prompt-tokens {args.max_prompt_tokens}: no "
            "prompt could be used."
        )
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a folder: pass a folder path.")
    if args.llama_cpp is not None and not (args.llama_cpp / "llama-server").is_file():
        raise ValueError(f"--llama-cpp {args.llama_cpp} holds no llama-server: pass llama.cpp's build/bin folder.")
    if not 0.0 <= args.llama_cpp_p_min < 1.0:
        raise ValueError(f"--llama-cpp-p-min must lie in [0, 1), got {args.llama_cpp_p_min}.")
    unknown = {name for name in args.skip.split(",") if name} - set(SKIPPABLE)
    if unknown:
        raise ValueError(f"--skip takes {', '.join(SKIPPABLE)} (comma-separated), got {sorted(unknown)}.")
    names = [name for name, _ in args.compare_drafter]
    if len(set(names)) != len(names):
        raise ValueError(f"--compare-drafter names must differ (they tag the rows), got {names}.")


SKIPPABLE = ("prompt_lookup", "native_dflash", "greedy_engine_kernels")


def _methods(args: argparse.Namespace, target, drafter, compared: dict[str, Path]) -> list[bench.BenchMethod]:
    """The run's rows: the default methods less `--skip`, the engine rows of each compared drafter, and the sampling
    rows of `--temperatures`."""
    engine = dict(
        block_sizes=args.block_sizes,
        adaptive=not args.no_adaptive,
        lookup_branch=not args.no_lookup_branch,
        lookup_tokens=args.lookup_tokens,
        draft_tree=not args.no_draft_tree,
    )
    skipped = set(args.skip.split(","))
    methods = bench.default_methods(target, drafter, prompt_lookup_num_tokens=args.prompt_lookup_tokens, **engine)
    methods = [method for method in methods if method.name not in skipped]
    for name, folder in compared.items():
        methods += bench.drafter_methods(target, load_drafter(folder, target), name, **engine)
    if args.temperatures:
        methods += bench.sampling_methods(target, drafter, args.temperatures, args.sampling_block_size)
    return methods


def _compared_drafters(args: argparse.Namespace) -> dict[str, Path]:
    """The `--compare-drafter` folders by name, each checked before any model loads: a drafter folder, with a
    trained block size that some `--block-sizes` value fits."""
    compared = {}
    for name, folder in args.compare_drafter:
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"--compare-drafter {name}={folder}: no DFlash drafter there (no config.json); pass a folder saved by "
                "`dflash-hf train` or `DFlashDraftModel.save_pretrained`."
            )
        compared[name] = resolve_drafter_dir(args.target, folder)
        trained = int(DFlashConfig.from_pretrained(folder).block_size)
        if not any(size <= trained for size in args.block_sizes):
            raise ValueError(
                f"--compare-drafter {name}={folder}: none of the block sizes {args.block_sizes} fits its trained block "
                f"size {trained}; add a block size <= {trained} to --block-sizes."
            )
    return compared


def _llama_cpp(args: argparse.Namespace, drafter, prompts, tokenizer, threads: int) -> dict:
    """llama.cpp's rows on the bench prompts (the drafter exported as GGUF into a temporary folder, against the GGUF
    llama.cpp serves) and the target's forward costs."""
    import tempfile

    from ..bench import llama_cpp
    from ..hub.gguf import target_gguf_file, write_gguf

    target = args.llama_cpp_target or args.target
    draft_tokens = args.llama_cpp_draft_tokens or [int(drafter.config.block_size) - 1]
    with tempfile.TemporaryDirectory(prefix="dflash-hf-llama-cpp-") as scratch, target_gguf_file(target) as gguf:
        served = Path(gguf)
        if args.llama_cpp_requantize:
            served = llama_cpp.requantize(
                args.llama_cpp,
                gguf,
                args.llama_cpp_requantize,
                Path(scratch) / f"target-{args.llama_cpp_requantize}.gguf",
            )
        drafter_gguf = write_gguf(
            drafter, Path(scratch) / "drafter.gguf", target=served, gguf_type=args.llama_cpp_gguf_type
        )
        dflash = [llama_cpp.dflash_setup(drafter_gguf, n, threads, args.llama_cpp_p_min) for n in draft_tokens]
        setups = list(dflash)
        if args.llama_cpp_ngram:
            setups += [llama_cpp.ngram_setup(max(draft_tokens))]
            setups += [llama_cpp.ngram_setup(n, drafter=setup) for n, setup in zip(draft_tokens, dflash)]
        rows = llama_cpp.run_llama_cpp(args.llama_cpp, served, setups, prompts, tokenizer, args.max_new_tokens, threads)
        depth = round(sum(len(p.input_ids) for p in prompts) / len(prompts) + args.max_new_tokens / 2)
        costs = llama_cpp.forward_costs(args.llama_cpp, served, threads, depth, [1, 2, *(n + 1 for n in draft_tokens)])
    settings = {
        "binary_dir": str(args.llama_cpp),
        "target_gguf": Path(gguf).name
        + (f" requantized to {args.llama_cpp_requantize}" if args.llama_cpp_requantize else ""),
        "gguf_type": args.llama_cpp_gguf_type,
        "draft_tokens": draft_tokens,
        "p_min": args.llama_cpp_p_min,
        "threads": threads,
    }
    return llama_cpp.rows_to_json(rows, settings, costs)


def run(args: argparse.Namespace) -> int:
    """Run the `bench` sub-command; returns the exit code (1 when an output differs from greedy)."""
    if args.readme_section is not None:
        print(bench.render_markdown(args.readme_section, plots_prefix=args.plots_prefix), end="")
        return 0
    _check(args)
    drafter_dir = resolve_drafter_dir(args.target, args.drafter)
    device = device_of(args.device)
    threads = setup_cpu(args, device)

    compared = _compared_drafters(args)
    trained = [int(DFlashConfig.from_pretrained(d).block_size) for d in (drafter_dir, *compared.values())]
    max_block = trained[0]  # the block the main drafter's cycle runs (a measured --dtype auto verdict times it)
    widest = max(
        bench.widest_verify(
            args.block_sizes, size, not args.no_lookup_branch, args.lookup_tokens, not args.no_draft_tree
        )
        for size in trained
    )
    target, tokenizer, drafter, precision = load_models(args.target, drafter_dir, device, args.dtype, max_block, widest)
    prompts, prompt_info = bench.load_bench_prompts(
        args.prompts,
        tokenizer,
        num_prompts=args.num_prompts,
        max_prompt_tokens=args.max_prompt_tokens,
        use_chat_template=False if args.no_chat_template else None,
        min_prompt_tokens=args.min_prompt_tokens,
        prompts_dir=args.prompts_dir,
    )
    methods = _methods(args, target, drafter, compared)
    result = bench.run_bench(
        target,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        methods=methods,
        warmup_tokens=args.warmup_tokens,
        settings={
            "target": str(args.target),
            "drafter": str(drafter_dir),
            "compared_drafters": {name: str(folder) for name, folder in compared.items()},
            "prompts": str(args.prompts),
            "prompt_set": prompt_info,
            "threads": threads,
            "device": str(device),
            "precision": precision,
        },
        progress=not args.no_progress,
    )
    if args.llama_cpp is not None:
        result.llama_cpp = _llama_cpp(args, drafter, prompts, tokenizer, threads or 1)
    result.command = _command_line(args, threads)
    paths = bench.write_outputs(result, args.out)
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
        return 0 if args.allow_mismatch else 1
    return 0
