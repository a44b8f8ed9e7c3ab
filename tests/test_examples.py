"""Every example under examples/ names what the package has: the Python one-liners and heredocs of its shell scripts
import what they use (their imports are run), each `dflash-hf COMMAND` a script runs takes the flags it is given
(`dflash-hf COMMAND --help` lists them), and each Python example answers `--help` with the flags the scripts give it.
Nothing long runs: no build, no model, no server."""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import runpy
import sys
from pathlib import Path

import pytest
from testing_utils import REPO

from dflash_hf import cli

EXAMPLES = REPO / "examples"
SHELL_SCRIPTS = sorted(EXAMPLES.rglob("*.sh"))
PYTHON_SCRIPTS = sorted(EXAMPLES.rglob("*.py"))
HEREDOC = re.compile(r"python3?\s+-\s[^\n]*<<\s*'?(\w+)'?\n(.*?)\n\1\n", re.S)
ONE_LINER = re.compile(r"""python3?\s+-c\s+(?:'([^']*)'|"((?:[^"\\]|\\.)*)")""")
DFLASH_HF = re.compile(r"(?:^|[;&|(]\s*)dflash-hf\s+([a-z][a-z-]*)(.*)")
PYTHON_RUN = re.compile(r"python3?\"?\s+\"?\$here/([\w.-]+\.py)\"?(.*)")
FLAG = re.compile(r"(?<!\S)(--[A-Za-z][\w-]*)")
# read before the parse by `train`'s recipe parser (TRL's), so absent from its --help
UNLISTED = {"train": {"--config"}}


def _python_snippets(script: Path) -> list[str]:
    """The Python code a shell script runs inline: its `python -c` one-liners and `python - <<EOF` heredocs, shell
    variables standing as plain names."""
    text = script.read_text()
    snippets = [body for _, body in HEREDOC.findall(text)]
    snippets += [single or double for single, double in ONE_LINER.findall(text)]
    return [re.sub(r"\$\{?(\w+)\}?", r"\1", snippet) for snippet in snippets]


def _commands(script: Path) -> list[str]:
    """The command lines of a shell script, continuation lines joined, comments and heredoc bodies dropped."""
    text = HEREDOC.sub("", script.read_text()).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _help(run) -> str:
    """What `run()` prints for `--help`, once it has returned or exited with 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = run()
        except SystemExit as exited:
            code = exited.code
    assert code in (0, None), out.getvalue()
    return out.getvalue()


def _script_help(script: Path) -> str:
    """`python SCRIPT --help`, run here (the package is imported once); skipped for a script that needs a package
    this environment lacks (the speculators check runs in its own virtual environment)."""
    argv = sys.argv
    sys.argv = [str(script), "--help"]
    try:
        return _help(lambda: runpy.run_path(str(script), run_name="__main__"))
    except ModuleNotFoundError as err:
        if err.name.split(".")[0] == "dflash_hf":
            raise
        pytest.skip(f"{script.name} needs {err.name}, which is not installed here")
    finally:
        sys.argv = argv


def test_the_examples_are_found():
    assert {p.name for p in SHELL_SCRIPTS} >= {"run.sh", "llama_cpp.sh", "make_data_server.sh"}
    assert {p.name for p in PYTHON_SCRIPTS} >= {"train.py", "check_llama_cpp.py", "check_make_data_server.py"}


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_the_python_a_shell_example_runs_inline_imports_what_it_uses(script):
    for snippet in _python_snippets(script):
        for node in ast.walk(ast.parse(snippet)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), str(script), "exec"), {})


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_each_command_of_a_shell_example_takes_the_flags_it_is_given(script):
    for line in _commands(script):
        if match := DFLASH_HF.search(line):
            command, rest = match.groups()
            listed = _help(functools.partial(cli.main, [command, "--help"]))
        elif match := PYTHON_RUN.search(line):
            name, rest = match.groups()
            listed = _script_help(script.parent / name)
        else:
            continue
        missing = set(FLAG.findall(rest)) - UNLISTED.get(match[1], set()) - set(FLAG.findall(listed))
        assert not missing, f"{script.name}: `{line[:80]}` gives {sorted(missing)}, which it does not take"


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_a_python_example_answers_help(script):
    assert "usage:" in _script_help(script)
