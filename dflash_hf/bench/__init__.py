"""Benchmark DFlash against its peers on one target, one drafter and one prompt set, in one process.

`methods` defines what is compared (one row each), `runners` how each method runs a prompt and is measured
(`target_watch` for Transformers' own), `run` decodes, `results` compares and sums up, `report` writes `bench.json`
and `bench.md`, `plots` the plots. How every number is derived: docs/design.md, "Benchmark".

    >>> from dflash_hf import bench
    >>> from dflash_hf.bench import load_bench_prompts
    >>> prompts, _ = load_bench_prompts("humaneval", tokenizer, num_prompts=10)
    >>> result = bench.run_bench(target, drafter, prompts, max_new_tokens=128)
    >>> print(bench.markdown_table(result))
    >>> bench.write_outputs(result, "bench-out")            # bench.json, bench.md and the PNG plots
    >>> print(bench.render_markdown("bench-out/bench.json"))  # README results section
"""

from .methods import (
    DEFAULT_BLOCK_SIZES,
    BenchMethod,
    default_methods,
    drafter_methods,
    oracle_methods,
    sampling_methods,
    widest_verify,
)
from .plots import PLOT_NAMES, write_plots
from .prompts import PROMPT_SETS, BenchPrompt, load_bench_prompts
from .report import (
    JSON_NAME,
    MARKDOWN_NAME,
    benchmark_table,
    card_metrics,
    llama_cpp_table,
    markdown_table,
    render_markdown,
    write_outputs,
)
from .results import (
    BENCH_FORMAT,
    BenchResult,
    MethodResult,
    MethodSummary,
    Mismatch,
    PromptResult,
)
from .run import exactness_required, hardware_info, run_bench
from .runners import MethodRun

__all__ = [
    "BENCH_FORMAT",
    "DEFAULT_BLOCK_SIZES",
    "JSON_NAME",
    "MARKDOWN_NAME",
    "PLOT_NAMES",
    "PROMPT_SETS",
    "BenchMethod",
    "BenchPrompt",
    "BenchResult",
    "MethodResult",
    "MethodSummary",
    "Mismatch",
    "PromptResult",
    "MethodRun",
    "default_methods",
    "drafter_methods",
    "oracle_methods",
    "widest_verify",
    "sampling_methods",
    "exactness_required",
    "hardware_info",
    "benchmark_table",
    "card_metrics",
    "llama_cpp_table",
    "load_bench_prompts",
    "markdown_table",
    "render_markdown",
    "run_bench",
    "write_outputs",
    "write_plots",
]
