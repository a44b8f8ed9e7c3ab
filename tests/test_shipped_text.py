"""Shipped text speaks of the product, not of how it was made: no run history or process words in the README, the
docs, the recipes, the data notes, the model cards and their templates, or the package's comments and strings.

A measurement is a dated, host-named fact ("2026-12-01, AMD EPYC with AVX2 only"); what is missing is a limitation.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
from testing_utils import REPO

# history and process words, wherever they appear
_COMMON = [
    r"sessions?",
    r"(previous|earlier) README",
    r"the issue",
    r"issue \d+",
    r"issue's",
    r"for now",
    r"previously",
    r"anymore",
    r"shipped (now|before)",
    r"the aim",
    r"(is|are) not met",
    r"this VM",
    r"reviewers?",
]
# in prose only: in code these words describe the program's own state ("the prompts not done yet", "this run's rows")
_PROSE_ONLY = [
    r"now(?! and then)",
    r"this run",
    r"this README('s)?",
    r"the run before",
    r"(earlier|previous) (run|runs|session|host|hosts|profile|bench|benches)",
    r"not done yet",
    r"(measured|re-measured|tried) yet",
    r"since (then|those|these)",
]
PROSE = re.compile(r"\b(" + "|".join(_COMMON + _PROSE_ONLY) + r")\b", re.IGNORECASE)
CODE = re.compile(r"\b(" + "|".join(_COMMON) + r")\b|\b(TODO|FIXME|XXX)\b", re.IGNORECASE)


def prose_files() -> list[Path]:
    """The shipped documents: README, docs, recipes and examples' notes, data notes, card templates, bundled cards."""
    files = [REPO / "README.md", REPO / "data" / "README.md"]
    files += sorted((REPO / "docs").rglob("*.md"))
    for pattern in ("*.yaml", "*.md", "*.sh"):
        files += sorted((REPO / "examples").rglob(pattern))
    files += sorted((REPO / "hub_cards").glob("*.md"))
    files += sorted((REPO / "dflash_hf" / "bundled").glob("*/README.md"))
    return files


def code_files() -> list[Path]:
    """The shipped Python: the package, the remote code, the trainers, the card renderer, the examples, the launcher."""
    files = [REPO / "dflash_hf_launcher.py"]
    for folder in ("dflash_hf", "modeling", "trainers", "hub_cards", "examples"):
        files += sorted((REPO / folder).rglob("*.py"))
    return files


def _code_text(source: str) -> list[tuple[int, str]]:
    """`(line number, line)` of every comment and string (docstrings, messages) of a Python source."""
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING) or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            lines += [(token.start[0] + k, line) for k, line in enumerate(token.string.splitlines())]
    return lines


def history_words(lines: list[tuple[int, str]], pattern: re.Pattern, name: str) -> list[str]:
    """`name:line: 'word' in: text` for every match of `pattern` in `lines`."""
    return [
        f"{name}:{number}: {match.group(0)!r} in: {line.strip()}"
        for number, line in lines
        for match in pattern.finditer(line)
    ]


def test_the_patterns_find_history_and_leave_product_text_alone():
    history = [
        "in session 13's stage-9 run",
        "the previous README's run",
        "This run is the first with grouped attention",
        "Not done yet: the branch length",
        "The aim (tau >= 3) is not met",
        "the engine now runs its forwards",
        "see the issue's recipe list",
        "bench (and generate) now choose on AMD CPUs",
    ]
    for text in history:
        assert history_words([(1, text)], PROSE, "x"), text
    product = [
        "changes an output's rounding only now and then",
        "--overwrite replaces an earlier export",
        "measured on 2026-12-01 on an AMD EPYC with AVX2 only",
        "the previous token of the slot",
        "blocks anchored where the previous one stopped",
        "stops a run that no longer improves",
    ]
    for text in product:
        assert not history_words([(1, text)], PROSE, "x"), text
    assert history_words(_code_text("x = 1  # as the session showed\n"), CODE, "x")
    assert history_words(_code_text('def f():\n    """Fixed in issue 14."""\n'), CODE, "x")
    assert not history_words(_code_text("now = clock()  # the cache is full now\n"), CODE, "x")


@pytest.mark.parametrize("path", prose_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_documents_have_no_run_history(path):
    lines = list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
    hits = history_words(lines, PROSE, str(path.relative_to(REPO)))
    assert not hits, "run history in shipped text (say the dated, host-named fact or the limitation):\n" + "\n".join(
        hits
    )


@pytest.mark.parametrize("path", code_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_code_comments_and_strings_have_no_run_history(path):
    hits = history_words(_code_text(path.read_text(encoding="utf-8")), CODE, str(path.relative_to(REPO)))
    assert not hits, "run history in a comment or string (say what the code does):\n" + "\n".join(hits)
