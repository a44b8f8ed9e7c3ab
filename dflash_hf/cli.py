"""`dflash-hf` command line: one sub-command per module in `dflash_hf.commands`.

Every sub-command module exposes `register(subparsers)`, which adds its parser and sets `func` (a callable taking
the parsed arguments and returning an exit code); what only a run needs is imported inside it. Bad input (a
`ValueError`, or an `OSError` for a missing or unreadable file) ends with one `error: ...` line and exit code 2. A
command's `--quiet` hides the progress bars of the libraries it runs (`commands.hidden_progress_bars`). A command
whose flags are a settings dataclass (`bench`, `make-data`) also reads them from `--config FILE.yaml`
(`cli_settings.SettingsParser`, the sub-commands' parser class).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from .cli_settings import SettingsParser
from .commands import (
    bench,
    cache_features,
    export,
    generate,
    hidden_progress_bars,
    make_data,
    profile,
    push,
    results_doc,
    train,
)

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what shells report for a command ended by Ctrl-C

# each sub-command's `register`, in the order `dflash-hf --help` lists them
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    make_data.register,
    cache_features.register,
    train.register,
    generate.register,
    export.register,
    push.register,
    bench.register,
    profile.register,
    results_doc.register,
)


def build_parser() -> argparse.ArgumentParser:
    """The `dflash-hf` argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="dflash-hf", description="DFlash block-diffusion speculative decoding for Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=SettingsParser)
    for register in COMMANDS:
        register(subparsers)
    return parser


def _parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser (every sub-command imported) and the parsed `argv`."""
    parser = build_parser()
    if argv and argv[0] == "train":  # `train` parses its own flags (TRL's parser: --config recipe.yaml + overrides)
        args = parser.parse_args(["train", *(["--help"] if {"-h", "--help"} & set(argv[1:]) else [])])
        args.train_argv = argv[1:]
    else:
        args = parser.parse_args(argv)
    return parser, args


def interrupted() -> int:
    """Say that the run was interrupted (one line on stderr) and return the exit code for it."""
    print("error: interrupted", file=sys.stderr)
    return INTERRUPTED_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    """Run `dflash-hf` with `argv`; returns the exit code (2 with one `error:` line on bad input, 130 with one line
    on Ctrl-C, also while the parser is built; Ctrl-C while the commands are imported is `dflash_hf_launcher`'s)."""
    try:
        parser, args = _parse(sys.argv[1:] if argv is None else list(argv))
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        with hidden_progress_bars(getattr(args, "quiet", False)):
            return int(args.func(args) or 0)
    except (ValueError, OSError) as err:  # bad input, missing or unreadable files: one line, no traceback
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted()


if __name__ == "__main__":
    sys.exit(main())
