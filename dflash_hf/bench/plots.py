"""The PNG plots of a bench result: speedup by method, accepted lengths, acceptance by block slot and, when
measured, the forward-cost profile."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from ..fileio import atomic_write
from .profile import plot_profiles
from .results import BenchResult, as_document

PLOT_NAMES = {
    "speedup": "speedup.png",
    "accepted_lengths": "accepted_lengths.png",
    "acceptance_by_slot": "acceptance_by_slot.png",
    "cost_profile": "cost_profile.png",
}


def _plot_speedup(document: dict[str, Any], axes) -> None:
    methods = [m for m in document["methods"] if m["summary"]["speedup"] is not None]
    labels = [m["label"] for m in methods]
    values = [m["summary"]["speedup"] for m in methods]
    colors = [
        "tab:gray" if m["summary"]["exact"] is None else "tab:blue" if m["summary"]["exact"] else "tab:red"
        for m in methods
    ]
    bars = axes.barh(range(len(methods)), values, color=colors)
    axes.set_yticks(range(len(methods)), labels)
    axes.invert_yaxis()
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.bar_label(bars, labels=[f"{v:.2f}x" for v in values], padding=3)
    axes.set_xlabel(
        "speedup over plain greedy, sampled rows over plain sampling (tokens/s ratio); red: differs from greedy"
    )
    axes.set_xlim(0, max(values + [1.0]) * 1.2)
    axes.set_title("Speedup by method")


def _speculative(document: dict[str, Any]) -> list[dict[str, Any]]:
    reference = document["methods"][0]["name"]
    return [m for m in document["methods"] if m["name"] != reference]


def _plot_accepted_lengths(document: dict[str, Any], axes) -> None:
    methods = _speculative(document)
    longest = max((len(m["summary"]["accepted_length_histogram"]) for m in methods), default=1)
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        histogram = method["summary"]["accepted_length_histogram"]
        cycles = max(method["summary"]["cycles"], 1)
        xs = [int(n) + (i - (len(methods) - 1) / 2) * width for n in histogram]
        axes.bar(xs, [count / cycles for count in histogram.values()], width=width, label=method["label"])
    axes.set_xticks(range(1, longest + 1))
    axes.set_xlabel("tokens committed per target forward (accepted drafts + 1)")
    axes.set_ylabel("fraction of cycles")
    axes.set_title("Accepted lengths")
    if methods:
        axes.legend(fontsize="small")


def _plot_acceptance_by_slot(document: dict[str, Any], axes) -> None:
    methods = [m for m in _speculative(document) if m["block_size"] is not None]
    for i, method in enumerate(methods):
        rates = method["summary"]["acceptance_rate_by_slot"]
        axes.plot(
            range(1, len(rates) + 1),
            rates,
            marker="os^vDP"[i % 6],
            linestyle=("-", "--", ":")[i % 3],
            label=method["label"],
        )
    axes.set_xlabel("draft slot (1 = first drafted token)")
    axes.set_ylabel("fraction of cycles with the slot accepted")
    axes.set_ylim(0, 1.05)
    axes.set_title("Acceptance rate by block slot")
    if methods:
        axes.legend(fontsize="small")


def write_plots(result: BenchResult | dict[str, Any] | str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write the PNG plots (speedup by method, accepted-length histogram, acceptance by slot and, when measured, the
    cost profile); returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    document = as_document(result)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    plots = [
        ("speedup", _plot_speedup),
        ("accepted_lengths", _plot_accepted_lengths),
        ("acceptance_by_slot", _plot_acceptance_by_slot),
    ]
    if document.get("cost_profile"):
        plots.append(("cost_profile", lambda doc, axes: plot_profiles([doc["cost_profile"]], axes)))
    for key, draw in plots:
        figure = Figure(figsize=(8, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        draw(document, figure.add_subplot())
        path = out / PLOT_NAMES[key]
        atomic_write(path, functools.partial(figure.savefig, format="png", dpi=120))
        paths.append(path)
    return paths
