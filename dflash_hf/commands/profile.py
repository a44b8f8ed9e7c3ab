"""`dflash-hf profile`: what a target forward of k tokens and a drafter forward cost here, per precision.

Loads the target and drafter in each requested precision in turn and times, on a cached context, the target's
forward for each token count and the drafter's for each block size (see `dflash_hf.bench.profile`). Prints a table
and writes `profile.json` and `profile.png` (cost relative to a 1-token step vs tokens per forward) into `--out`.
`dflash-hf bench` measures the same profile for the precision it runs in.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from .. import mkl_choice, runtime
from ..bench.profile import DEFAULT_TOKEN_COUNTS, measure_costs, plot_profiles
from ..bench.run import hardware_info
from ..fileio import atomic_write, atomic_write_text
from . import (
    add_cpu_arguments,
    add_model_arguments,
    comma_separated_ints,
    device_of,
    drafter_dir_of,
    load_models,
    setup_cpu,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `profile` sub-command."""
    parser = subparsers.add_parser(
        "profile",
        help="Time target forwards of k tokens and drafter forwards per block size, in each precision.",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    add_model_arguments(parser, dtype=False)
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="Comma-separated precisions to profile (default: float32,bfloat16).",
    )
    parser.add_argument(
        "--tokens",
        type=comma_separated_ints,
        default=list(DEFAULT_TOKEN_COUNTS),
        help="Token counts of the target forwards (default: 1,2,4,8,16).",
    )
    parser.add_argument(
        "--inexact",
        action="store_true",
        help="Also time reduced-precision target forwards without row-exact verification (not exact: what such a "
        "verify would cost; the engine never runs it).",
    )
    parser.add_argument("--context", type=int, default=256, help="Cached context tokens (default: 256).")
    parser.add_argument("--repeats", type=int, default=5, help="Timed repeats per forward (median; default: 5).")
    add_cpu_arguments(parser)
    parser.add_argument("--device", default="cpu", help="Device for both models (default: cpu).")
    parser.add_argument("--out", type=Path, default=Path("profile-results"), help="Output folder.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the `profile` sub-command; returns the exit code."""
    dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    unknown = sorted(set(dtypes) - {"float32", "bfloat16"})
    if unknown or not dtypes:
        raise ValueError(f"--dtypes takes float32 and/or bfloat16, got {args.dtypes!r}.")
    if args.context < 1 or args.repeats < 1:
        raise ValueError("--context and --repeats must be >= 1.")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a folder: pass a folder path.")
    device = device_of(args.device)
    setup_cpu(args, device)
    drafter_dir = drafter_dir_of(args.target, args.drafter)
    profiles = []
    for dtype in dtypes:
        target, _, drafter, precision = load_models(args.target, drafter_dir, device, dtype, max(args.tokens))
        profile = measure_costs(target, drafter, tuple(args.tokens), args.context, args.repeats)
        profile["precision"] = precision
        profiles.append(profile)
        if args.inexact and target.dtype != torch.float32 and profile["row_exact"]:
            stock = measure_costs(
                target, drafter, tuple(args.tokens), args.context, args.repeats, row_exact_verify=False
            )
            stock["precision"] = f"{profile['dtype']} without row-exact verification (NOT exact)"
            stock["dtype"] += ", not exact"
            profiles.append(stock)
        del target, drafter
    if device.type == "cpu":
        print(f"kernels: {runtime.mkl_mode()} ({mkl_choice.reason()})")
    for profile in profiles:
        print(f"{profile['precision']}:")
        print(_cost_line("target", profile, "target_ms", "target_relative", "{} tok"))
        if "stock_attention_ms" in profile:
            print(_cost_line("target in Transformers' sdpa", profile, "stock_attention_ms", "stock_attention_relative"))
        if "floor_relative" in profile:
            print(_cost_line("matmuls alone (floor)", profile, "matmul_ms", "floor_relative"))
            print(_cost_line("drafter matmuls alone", profile, "drafter_matmul_ms", "drafter_matmul_relative", "B={}"))
        print(_cost_line("drafter", profile, "drafter_ms", "drafter_relative", "B={}"))
        if "rollback_ms" in profile:
            print(_cost_line("rollback after a verify", profile, "rollback_ms", "rollback_relative"))
    args.out.mkdir(parents=True, exist_ok=True)
    drafter_name = "random" if drafter_dir is None else str(drafter_dir)
    document = {"hardware": hardware_info(device), "drafter": drafter_name, "profiles": profiles}
    atomic_write_text(args.out / "profile.json", json.dumps(document, indent=1) + "\n")
    _write_plot(profiles, args.out / "profile.png")
    print(f"wrote {args.out / 'profile.json'}, {args.out / 'profile.png'}")
    return 0


def _cost_line(label: str, profile: dict, ms_key: str, relative_key: str, name: str = "{} tok") -> str:
    """One printed line of the profile: each count's (or block size's) ms and its cost relative to a 1-token step."""
    return f"  {label}: " + "  ".join(
        f"{name.format(k)} {v:6.1f} ms ({profile[relative_key][k]:.2f}x)" for k, v in profile[ms_key].items()
    )


def _write_plot(profiles: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    plot_profiles(profiles, figure.add_subplot())
    atomic_write(path, functools.partial(figure.savefig, format="png", dpi=120))
