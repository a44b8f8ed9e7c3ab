"""The bundled pairs' engine defaults: chosen by their rule from the pair's committed bench runs, and what `dflash-hf
generate` runs with the bundled drafter unless a flag says otherwise."""

from __future__ import annotations

import ast
import json
import re

import pytest
from testing_utils import REPO

from dflash_hf import cli
from dflash_hf.commands import generate as generate_command
from dflash_hf.drafters import BUNDLED_BENCH_RUNS, BUNDLED_ENGINE_DEFAULTS, EngineDefaults, engine_defaults
from dflash_hf.engine.candidates import DEFAULT_CANDIDATES

CALL = re.compile(r"^dflash_hf\.generate\((.*)\)$")


def engine_rows(run: str) -> dict[EngineDefaults, float]:
    """The speedup of every engine row of the bench run `run` (under docs/bench), by the settings it ran with."""
    bench = json.loads((REPO / "docs" / "bench" / run / "bench.json").read_text())
    rows = {}
    for method in bench["methods"]:
        call = CALL.match(method["description"])
        if call is None:  # plain greedy, Transformers' paths
            continue
        keywords = {k.arg: ast.literal_eval(k.value) for k in ast.parse(f"f({call.group(1)})").body[0].value.keywords}
        rows[EngineDefaults(keywords["block_size"], keywords["candidates"])] = method["summary"]["speedup"]
    return rows


@pytest.mark.parametrize("target", sorted(BUNDLED_ENGINE_DEFAULTS))
def test_each_pairs_defaults_are_the_best_worst_case_of_its_bench_runs(target):
    runs = [engine_rows(run) for run in BUNDLED_BENCH_RUNS[target]]
    in_every_run = set.intersection(*(set(rows) for rows in runs))
    worst = {settings: min(rows[settings] for rows in runs) for settings in in_every_run}
    chosen = BUNDLED_ENGINE_DEFAULTS[target]
    assert chosen == max(worst, key=worst.get), worst
    assert worst[chosen] >= 1.0, f"{target}'s defaults were slower than plain greedy in a run: {worst[chosen]:.2f}x"


def test_every_bundled_drafter_has_defaults_and_runs():
    bundled = {p.name.removeprefix("dflash-") for p in (REPO / "dflash_hf" / "bundled").iterdir() if p.is_dir()}
    assert set(BUNDLED_ENGINE_DEFAULTS) == set(BUNDLED_BENCH_RUNS) == bundled


def settings_of(*argv: str) -> tuple:
    """What `dflash-hf generate` runs with for `argv` (trained block size 8)."""
    args = cli.build_parser().parse_args(["generate", "hi", *argv])
    return generate_command._engine_settings(args, 8)


def test_generate_runs_the_bundled_pairs_defaults_unless_a_flag_says_otherwise(tmp_path):
    block, candidates, why = settings_of("--target", "qwen2.5-coder-0.5b")
    assert (block, candidates) == ("adaptive", "dflash") and "pair's defaults" in why
    assert settings_of("--target", "qwen2.5-coder-0.5b", "--block-size", "4")[:2] == (4, "dflash")
    assert settings_of("--target", "smollm2-135m", "--candidates", "tree")[:2] == (4, "tree")
    both = settings_of("--target", "smollm2-135m", "--block-size", "adaptive", "--candidates", "dflash")
    assert both == ("adaptive", "dflash", "as asked")
    # another drafter: the engine's own defaults (the drafter's block size, the default candidates)
    assert settings_of("--target", "qwen2.5-coder-0.5b", "--drafter", str(tmp_path))[:2] == (None, DEFAULT_CANDIDATES)
    assert engine_defaults("qwen2.5-coder-0.5b", tmp_path) is None and engine_defaults("a/folder", None) is None


@pytest.mark.parametrize("value", ["9", "1"])
def test_a_block_size_beyond_the_drafter_is_refused(value):
    with pytest.raises(ValueError, match="--block-size must be between 2 and the drafter's block size 8"):
        settings_of("--block-size", value)


def test_a_block_size_that_is_no_int_or_adaptive_is_one_error_line(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--block-size", "big"])
    assert "expected an int or 'adaptive', got 'big'" in capsys.readouterr().err
