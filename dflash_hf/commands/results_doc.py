"""`dflash-hf results-doc`: write the results document from the bench and profile JSONs under a folder.

Renders every `bench.json` (as `dflash-hf bench --readme-section` does) and every `profile.json` under FOLDER into one
Markdown file. With `--check` nothing is written: the command fails when the file differs from what it would write.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    """Run `results-doc`; returns the exit code (1 with `--check` when the document is out of date)."""
    from ..bench.results_doc import render_results
    from ..fileio import atomic_write_text

    text = render_results(args.folder, args.out)
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != text:
            print(
                f"error: {args.out} is not what `dflash-hf results-doc {args.folder} --out {args.out}` writes from "
                f"the JSONs under {args.folder}: rerun it without --check.",
                file=sys.stderr,
            )
            return 1
        print(f"{args.out} is up to date")
        return 0
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `results-doc` sub-command to `subparsers`."""
    parser = subparsers.add_parser(
        "results-doc",
        help="write docs/results.md from the bench.json and profile.json files under a folder",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument("folder", type=Path, help="folder searched for bench.json and profile.json (e.g. docs/bench)")
    parser.add_argument(
        "--out", type=Path, default=Path("docs/results.md"), help="file to write (default: %(default)s)"
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs from the output")
    parser.set_defaults(func=run)
