"""Reports of a bench result: the Markdown tables, the README results section and a model card's rows, and the
files a run writes (`bench.json`, `bench.md`, the plots of `dflash_hf.bench.plots`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..fileio import atomic_write_text
from .plots import PLOT_NAMES, write_plots
from .results import BenchResult, as_document

JSON_NAME = "bench.json"
KERNEL_BASELINE = "greedy_engine_kernels"
STATIC_BASELINE = "greedy_static"
# the further baselines a run may hold, each a column of every method's speedup over it
BASELINE_COLUMNS = {KERNEL_BASELINE: "vs greedy with engine kernels", STATIC_BASELINE: "vs static-cache greedy"}
MARKDOWN_NAME = "bench.md"


def _fmt(value: float | None, digits: int = 2, suffix: str = "", empty: str = "n/a") -> str:
    return empty if value is None else f"{value:.{digits}f}{suffix}"


def _exact_cell(summary: dict[str, Any]) -> str:
    """The table's "exact" cell: yes; NO with the tokens identical to greedy's, the first position where an output
    differs and the prompts; or n/a for sampled outputs (not compared token by token)."""
    if summary["exact"] is None:
        return "n/a (sampled)"
    if summary["exact"]:
        return "yes"
    prompts = ", ".join(map(str, summary["mismatched_prompts"]))
    if summary.get("identical_tokens") is None:  # a result written before the counts were recorded
        return f"**NO** (prompts {prompts})"
    return (
        f"**NO**: {summary['identical_tokens']}/{summary['reference_tokens']} tokens as greedy, first differs at "
        f"{summary['first_mismatch']} (prompts {prompts})"
    )


def _slot_cell(summary: dict[str, Any]) -> str:
    """Acceptance rates of draft slots 1-3 in percent (`-` for a method without draft slots)."""
    rates = summary.get("acceptance_rate_by_slot") or []
    return " / ".join(f"{100 * rate:.0f}" for rate in rates[:3]) + " %" if rates else "-"


def markdown_table(result: BenchResult | dict[str, Any] | str | os.PathLike) -> str:
    """The per-method results as a Markdown table (from a result, its JSON document, or the path of `bench.json`).

    When the run has plain greedy decoding with the engine's kernels, a column gives every method's speedup over
    that baseline too (the gain from speculation alone), and so does plain greedy with a static cache (compiled where
    Transformers compiles it: the fast baseline of a GPU); when a method verified a prompt-lookup branch, a last column
    says in how many cycles that branch was the accepted one. A run that recorded the tokens verified per cycle also
    shows the mean verify width and the acceptance rate of draft slots 1-3. A run that measured a cost profile gives
    the cost model's speedup of every drafting method beside the measured one (`predicted`)."""
    document = as_document(result)
    rates = {m["name"]: m["summary"]["tokens_per_s"] for m in document["methods"]}
    baselines = [(name, heading) for name, heading in BASELINE_COLUMNS.items() if rates.get(name)]
    lookups = any(m["summary"].get("lookup_win_rate") is not None for m in document["methods"])
    widths = any(m["summary"].get("mean_verify_width") is not None for m in document["methods"])
    predicted = any(m["summary"].get("predicted_speedup") is not None for m in document["methods"])
    extra = ("".join(f" {heading} |" for _, heading in baselines), "---:|" * len(baselines))
    if lookups:
        extra = (extra[0] + " lookup branch won |", extra[1] + "---:|")
    columns = (" verify width | slots 1/2/3 accepted |", "---:|---:|") if widths else ("", "")
    model = (" predicted |", "---:|") if predicted else ("", "")
    lines = [
        "| Method | mean block |"
        + columns[0]
        + " tau | tokens/s | speedup |"
        + model[0]
        + " draft ms/cycle | verify ms/cycle | exact |"
        + extra[0],
        "|---|---:|" + columns[1] + "---:|---:|---:|" + model[1] + "---:|---:|---|" + extra[1],
    ]
    for method in document["methods"]:
        summary = method["summary"]
        exact = _exact_cell(summary)
        cells = ""
        if widths:
            cells = f" {_fmt(summary.get('mean_verify_width'), 1, empty='-')} | {_slot_cell(summary)} |"
        model_cell = f" {_fmt(summary.get('predicted_speedup'), suffix='x', empty='-')} |" if predicted else ""
        line = (
            f"| {method['label']} | {_fmt(summary['mean_block_size'], 1, empty='-')} |{cells} {_fmt(summary['tau'])} "
            f"| {_fmt(summary['tokens_per_s'])} "
            f"| {_fmt(summary['speedup'], suffix='x')} |{model_cell} {_fmt(summary['draft_ms_per_cycle'], 1)} "
            f"| {_fmt(summary['verify_ms_per_cycle'], 1)} | {exact} |"
        )
        for name, _ in baselines:
            rate = summary["tokens_per_s"]
            line += f" {_fmt(rate / rates[name] if rate else None, suffix='x')} |"
        if lookups:
            rate = summary.get("lookup_win_rate")
            line += f" {'-' if rate is None else f'{100 * rate:.0f}% of cycles'} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def benchmark_table(result: BenchResult | dict[str, Any] | str | os.PathLike) -> str | None:
    """Tau per benchmark for each method, as the DFlash paper's table has it (plus the mean over the benchmarks and the
    tokens/s and speedup of the whole run); `None` for a run of one prompt set."""
    document = as_document(result)
    by_benchmark = document.get("by_benchmark")
    if not by_benchmark:
        return None
    names = list(_benchmark_cells(by_benchmark))
    lines = [
        "| Method | " + " | ".join(f"{name} tau" for name in names) + " | mean tau | tokens/s | speedup |",
        "|---|" + "---:|" * (len(names) + 3),
    ]
    for method in document["methods"]:
        cells = by_benchmark.get(method["name"], {})
        taus = [cells.get(name, {}).get("tau") for name in names]
        known = [tau for tau in taus if tau is not None]
        mean = sum(known) / len(known) if known else None
        summary = method["summary"]
        lines.append(
            f"| {method['label']} | " + " | ".join(_fmt(tau) for tau in taus) + f" | {_fmt(mean)} "
            f"| {_fmt(summary['tokens_per_s'])} | {_fmt(summary['speedup'], suffix='x')} |"
        )
    return "\n".join(lines) + "\n"


def llama_cpp_table(result: BenchResult | dict[str, Any] | str | os.PathLike) -> str | None:
    """llama.cpp's rows (plain `llama-server` and each speculative one) as a Markdown table, with the target's forward
    costs below it when they were measured; `None` when the run had none."""
    part = as_document(result).get("llama_cpp")
    if not part:
        return None
    settings = part["settings"]
    lines = [
        f"llama.cpp ({settings['binary_dir']}, target `{settings['target_gguf']}`, drafter as GGUF "
        f"{settings['gguf_type']}, {settings['threads']} threads): tokens/s are llama.cpp's own decode timings.",
        "",
        "| llama.cpp | tokens/s | speedup vs llama.cpp plain | accepted per drafted token | identical to plain |",
        "|---|---:|---:|---:|---|",
    ]
    for row in part["rows"]:
        lines.append(
            f"| {row['label']} | {_fmt(row['tokens_per_s'])} | {_fmt(row['speedup_vs_plain'], suffix='x')} "
            f"| {_fmt(row['acceptance'], 3, empty='-')} | {_identical(row)} |"
        )
    costs = part.get("costs")
    if costs:
        steps = ", ".join(
            f"{k} tokens {v:.2f}" for k, v in sorted(costs["forward_steps"].items(), key=lambda kv: int(kv[0]))
        )
        lines += [
            "",
            f"Target forward costs (llama-bench, {costs['depth']} cached tokens): a plain step {costs['step_ms']:.1f} ms; "
            f"a forward over k new tokens in plain steps: {steps}. A verify of n_max drafted tokens is a forward over "
            "n_max + 1 tokens: each verify costs at least that many plain steps, before the draft's own time.",
        ]
    return "\n".join(lines) + "\n"


def _identical(row: dict[str, Any]) -> str:
    if row["identical_to_plain"] is None:
        return "-"
    if row["identical_to_plain"]:
        return "yes"
    same = row.get("completions_identical")
    return "**NO**" if same is None else f"**NO** ({same} of the completions)"


def render_markdown(
    result: BenchResult | dict[str, Any] | str | os.PathLike,
    plots_prefix: str | None = None,
    heading: str = "## Results",
) -> str:
    """README results section: table, plot references, hardware, date and the exact command, from a bench result.

    Args:
        result: A [`BenchResult`], its JSON document, or the path of a `bench.json`.
        plots_prefix: Path of the plot folder as seen from the README (default: the folder of `bench.json` when a
            path is given, else the current folder).
        heading: The section heading line.
    """
    document = as_document(result)
    if plots_prefix is None:
        plots_prefix = str(Path(result).parent) if isinstance(result, (str, os.PathLike)) else "."
    prefix = plots_prefix.rstrip("/") + "/" if plots_prefix not in ("", ".") else ""
    settings, hardware = document["settings"], document["hardware"]
    source = _prompt_source(settings)
    lengths = [p["prompt_tokens"] for p in document.get("prompts", [])]
    if lengths:
        source += f" ({min(lengths)}-{max(lengths)} prompt tokens)"
    drafter = drafter_name(str(settings.get("drafter", "given")))
    drafter = (
        f"the bundled drafter `{drafter}`" if drafter.startswith("dflash_hf/bundled/") else f"the drafter `{drafter}`"
    )
    compared = settings.get("compared_drafters") or {}
    others = (
        " Rows tagged [NAME] run the engine with another drafter: "
        + "; ".join(f"[{name}] `{drafter_name(str(folder))}`" for name, folder in compared.items())
        + "."
        if compared
        else ""
    )
    decoding = "greedy"
    if any(method.get("sampled") for method in document["methods"]):
        decoding += " (sampled rows: at the temperature each row names)"
    lines = [
        heading,
        "",
        f"{settings.get('target', settings.get('target_model_type'))} with {drafter} "
        f"(trained block size {settings['drafter_block_size']}): "
        f"{settings['num_prompts']} prompts of {source}, {decoding}, at most {settings['max_new_tokens']} new tokens, "
        f"batch 1, {settings.get('precision') or settings['dtype']}.{others}",
        "",
        markdown_table(document).rstrip("\n"),
        "",
        *(["Tau per benchmark:", "", table.rstrip("\n"), ""] if (table := benchmark_table(document)) else []),
        *([llama.rstrip("\n"), ""] if (llama := llama_cpp_table(document)) else []),
        "Speedup is tokens/s over plain greedy `target.generate` in the same process on the same prompts (sampled rows: "
        "over plain sampling `target.generate(do_sample=True)` at the same temperature); tau is tokens committed per "
        "target forward after the prefill; exact means every output equals plain greedy's, token for token (sampled "
        "outputs are random: their losslessness is a distribution property, checked by the test suite); where one "
        "differs, the cell gives the tokens before each prompt's first difference, summed, and the earliest one."
        + (
            " Predicted is the cost model's speedup of the row's own cycles, tau / (verify + draft) in 1-token target "
            "steps of the cost profile below: the gap to the measured speedup is the engine's own overhead (and the "
            "prefill)."
            if any(m["summary"].get("predicted_speedup") is not None for m in document["methods"])
            else ""
        ),
        "",
        f"![Speedup by method]({prefix}{PLOT_NAMES['speedup']})",
        f"![Accepted lengths]({prefix}{PLOT_NAMES['accepted_lengths']})",
        f"![Acceptance rate by block slot]({prefix}{PLOT_NAMES['acceptance_by_slot']})",
        *cost_lines(document.get("cost_profile"), prefix),
        "",
        hardware_line(hardware),
        f"Date: {document['date']}.",
    ]
    if document.get("command"):
        lines += ["", "Command:", "", "```bash", document["command"], "```"]
    if not document["exact"]:
        if document.get("exact_required", True):
            lines += ["", f"**Warning: {len(document['mismatches'])} output(s) differ from plain greedy decoding.**"]
        else:
            lines += [
                "",
                f"{len(document['mismatches'])} output(s) differ from plain greedy decoding in {settings['dtype']} on "
                f"{hardware['device']}, where every committed token is the target's argmax of its own verify forward "
                "(README, Guarantees).",
            ]
    return "\n".join(lines) + "\n"


def drafter_name(drafter: str) -> str:
    """A drafter path as a report names it: a bundled drafter by its path inside the package (no machine's checkout
    path), any other as given."""
    drafter = drafter.replace("\\", "/")
    inside = drafter.split("/dflash_hf/bundled/")
    return f"dflash_hf/bundled/{inside[1]}" if len(inside) == 2 else drafter


def card_metrics(
    result: BenchResult | dict[str, Any] | str | os.PathLike, tag: str | None = None
) -> list[dict[str, Any]]:
    """A bench run as rows of a model card's results table (`dflash-hf export --metrics bench.json`): one per greedy
    method that speculated with one drafter of the run (the run's own, or with `tag` the `--compare-drafter` one of
    that name), per benchmark in a run of several prompt sets, with the prompts, precision, exactness, host and
    date. Plain greedy, prompt lookup and sampled rows are left out."""
    document = as_document(result)
    settings, hardware = document["settings"], document["hardware"]
    by_benchmark = document.get("by_benchmark")
    if by_benchmark:  # one row per benchmark and method
        groups = [(name, cell["prompts"]) for name, cell in _benchmark_cells(by_benchmark).items()]
    else:
        groups = [(_prompt_source(settings), settings["num_prompts"])]
    benchmark_of = [prompt.get("benchmark") for prompt in document["prompts"]]
    suffix = "" if tag is None else f"@{tag}"
    rows = []
    for method in document["methods"]:
        summary, name = method["summary"], method["name"]
        if not name.endswith(suffix) or (tag is None and "@" in name):
            continue
        if name.removesuffix(suffix) in ("greedy", *BASELINE_COLUMNS, "prompt_lookup") or summary["exact"] is None:
            continue
        label = method["label"].removesuffix(f" [{tag}]")
        block = (
            f"{method['block_size']}, Transformers' native path"
            if name == "native_dflash"
            else label.removeprefix("dflash-hf ").removeprefix("B=")
        )
        for benchmark, used in groups:
            cell = by_benchmark[name][benchmark] if by_benchmark else summary
            if cell["tau"] is None or not cell["speedup"]:
                continue
            exact = not any(by_benchmark is None or benchmark_of[i] == benchmark for i in summary["mismatched_prompts"])
            rows.append(
                {
                    "benchmark": f"{benchmark}, {used} prompt{'' if used == 1 else 's'}, "
                    f"{settings['max_new_tokens']} new tokens, greedy {settings['dtype']}, exact={exact}",
                    "block_size": block,
                    "tau": round(cell["tau"], 2),
                    "speedup": round(cell["speedup"], 2),
                    "hardware": f"{_cpu(hardware)}{_gpu(hardware)}, {hardware['torch_threads']} threads, "
                    f"torch {hardware['torch']}{_mkl(hardware)}",
                    "date": document["date"][:10],
                }
            )
    return rows


def _benchmark_cells(by_benchmark: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The per-benchmark cells of a run's first method: the benchmarks' names, in order, and their prompt counts."""
    return next(iter(by_benchmark.values()))


def _prompt_source(settings: dict[str, Any]) -> str:
    """What a run's prompts were, as its settings describe them."""
    return (settings.get("prompt_set") or {}).get("description", settings.get("prompts", "custom prompts"))


def _gpu(hardware: dict[str, Any]) -> str:
    """`, GPU <name>` for a run on a GPU, else empty."""
    return f", GPU {hardware['gpu']}" if hardware.get("gpu") else ""


def _mkl(hardware: dict[str, Any]) -> str:
    """`, <MKL mode>` for a run on a CPU that recorded it, else empty."""
    return f", {hardware['mkl']}" if hardware.get("mkl") and hardware.get("device") == "cpu" else ""


def _cpu(hardware: dict[str, Any]) -> str:
    """The CPU's model, with torch's CPU kernel level and native bf16 feature where the run recorded them."""
    isa = [f"{hardware['cpu_capability']} kernels"] if hardware.get("cpu_capability") else []
    isa += [hardware["native_bf16"]] if hardware.get("native_bf16") else []
    return f"{hardware['cpu']} ({', '.join(isa)})" if isa else hardware["cpu"]


def hardware_line(hardware: dict[str, Any]) -> str:
    """The `Hardware: ...` line of a report: CPU, threads, device (GPU, MKL mode on CPU) and library versions (CUDA's
    on a GPU)."""
    cuda = f", CUDA {hardware['cuda']}" if hardware.get("cuda") else ""
    return (
        f"Hardware: {_cpu(hardware)} ({hardware['torch_threads']} torch threads of {hardware['cpus_available']} "
        f"CPUs available{_gpu(hardware)}, device {hardware['device']}{_mkl(hardware)}); torch {hardware['torch']}{cuda}, "
        f"transformers {hardware['transformers']}, Python {hardware['python']}."
    )


def _cost_row(label: str, counts: list[str], blocks: list[str], target: dict | None, drafter: dict | None, digits: int):
    """One row of the cost table: a value per token count, then one per draft block size ('-' where not measured)."""
    cells = [f"{target[k]:.{digits}f}" if target and k in target else "-" for k in counts]
    cells += [f"{drafter[b]:.{digits}f}" if drafter and b in drafter else "-" for b in blocks]
    return f"| {label} | " + " | ".join(cells) + " |"


def cost_lines(profile: dict[str, Any] | None, prefix: str) -> list[str]:
    """The cost-profile table (target forward per token count, drafter per block size; in Transformers' `sdpa` and
    the matmul floor where measured) and its plot, if measured."""
    if not profile:
        return []
    counts, blocks = list(profile["target_ms"]), list(profile["drafter_ms"])
    stock, floor = "stock_attention_ms" in profile, "floor_relative" in profile
    rows = [
        _cost_row("ms", counts, blocks, profile["target_ms"], profile["drafter_ms"], 1),
        _cost_row("x step", counts, blocks, profile["target_relative"], profile["drafter_relative"], 2),
    ]
    rollback = "rollback_ms" in profile
    if rollback:
        share = {k: v / profile["target_ms"][k] for k, v in profile["rollback_ms"].items()}
        rows.append(_cost_row("rollback after the verify, ms", counts, blocks, profile["rollback_ms"], None, 2))
        rows.append(_cost_row("rollback / verify", counts, blocks, share, None, 3))
    if stock:
        rows.append(_cost_row("ms, Transformers' `sdpa`", counts, blocks, profile["stock_attention_ms"], None, 1))
    if floor:
        rows.append(
            _cost_row("matmuls alone, ms", counts, blocks, profile["matmul_ms"], profile["drafter_matmul_ms"], 1)
        )
        rows.append(
            _cost_row("floor, x step", counts, blocks, profile["floor_relative"], profile["drafter_matmul_relative"], 2)
        )
    row_exact = ", multi-token target forwards row-exact" if profile.get("row_exact") else ""
    notes = [
        "multi-token forwards in the engine's grouped-query attention, and in Transformers' `sdpa` for comparison"
        if stock
        else "",
        "'matmuls alone': the linear layers and LM head on k rows; 'floor': a k-token target forward whose other work "
        "costs what it costs for one token, and a draft that is its matmuls alone"
        if floor
        else "",
        "'rollback': the linear-attention states of a hybrid target brought back to the last accepted token after a "
        "k-token verify that kept k - 1 (the longest re-run a verify needs)"
        if rollback
        else "",
    ]
    notes_text = "; ".join(note for note in notes if note)
    return [
        "",
        f"Forward costs on this machine ({profile['dtype']}, {profile['context_tokens']}-token context{row_exact}), in "
        "ms and relative to one 1-token target step" + (f" ({notes_text})" if notes_text else "") + ":",
        "",
        "| | " + " | ".join([f"{k} tok" for k in counts] + [f"draft B={b}" for b in blocks]) + " |",
        "|---|" + "---:|" * (len(counts) + len(blocks)),
        *rows,
        "",
        f"![Forward cost relative to a 1-token step]({prefix}{PLOT_NAMES['cost_profile']})",
    ]


def write_outputs(result: BenchResult, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `bench.json`, `bench.md` (the README section) and the plots into `out_dir`, each file atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    document = result.to_json()
    paths = {"json": out / JSON_NAME, "markdown": out / MARKDOWN_NAME}
    atomic_write_text(paths["json"], json.dumps(document, indent=1) + "\n")
    atomic_write_text(paths["markdown"], render_markdown(document, "."))
    for path in write_plots(document, out):
        paths[path.stem] = path
    return paths
