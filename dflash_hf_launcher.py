"""The `dflash-hf` console entry point, outside the `dflash_hf` package on purpose.

Importing `dflash_hf` loads torch and Transformers, which takes seconds. This module imports nothing heavy, so Ctrl-C
at any moment of start-up ends as it does later (one `error: interrupted` line, exit code 130), not in a traceback
from inside those imports.
"""

from __future__ import annotations

import sys

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what shells report for a command ended by Ctrl-C


def interrupted() -> int:
    """Say that the run was interrupted (one line on stderr) and return the exit code for it."""
    print("error: interrupted", file=sys.stderr)
    return INTERRUPTED_EXIT_CODE


def main() -> int:
    """Run `dflash-hf` ([`dflash_hf.cli.main`]); Ctrl-C while it is being imported ends with [`interrupted`]."""
    try:
        from dflash_hf.cli import main as cli_main
    except KeyboardInterrupt:
        return interrupted()
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
