"""The `dflash-hf` console entry point, outside the `dflash_hf` package on purpose.

Importing `dflash_hf` loads torch and Transformers, which takes seconds. This module imports nothing heavy, so Ctrl-C
at any moment of start-up ends as it does later (one `error: interrupted` line, exit code 130, as
`dflash_hf.cli.interrupted` ends a run), not in a traceback from inside those imports.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Run `dflash-hf` ([`dflash_hf.cli.main`]); Ctrl-C while it is being imported ends like one during the run."""
    try:
        from dflash_hf.cli import main as cli_main
    except KeyboardInterrupt:  # `dflash_hf.cli` is only half imported: say what its `interrupted` says
        print("error: interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
