"""`bench` and `make-data` read their flags from settings dataclasses: `--config FILE.yaml` gives the settings, flags
on the command line override them, a bad file is one `error:` line, and bench's recorded command gives its settings
back."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from dflash_hf import cli
from dflash_hf.cli_settings import settings_of
from dflash_hf.commands.bench import BenchSettings, TaggedDrafter, _command_line
from dflash_hf.commands.make_data import MakeDataSettings


def _parse(argv: list[str]):
    return cli.build_parser().parse_args([str(arg) for arg in argv])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_bench_reads_a_config_file_and_flags_override_it(tmp_path):
    config = _write(
        tmp_path / "bench.yaml",
        "num_prompts: 3\nblock_sizes: [4, 8]\nadaptive: false\ncompare_drafter: [a=runs/a]\ntemperatures: 0.7,1.0\n"
        "dtype: float32\nout: results\n",
    )
    settings = settings_of(_parse(["bench", "--config", config]), BenchSettings)
    assert (settings.num_prompts, settings.block_sizes, settings.adaptive) == (3, [4, 8], False)
    assert settings.compare_drafter == [TaggedDrafter("a", Path("runs/a"))] and settings.temperatures == [0.7, 1.0]
    assert (settings.dtype, settings.out, settings.max_new_tokens) == ("float32", Path("results"), 128)

    argv = ["bench", "--num-prompts", "5", "--config", config, "--block-sizes", "16", "--compare-drafter", "b=runs/b"]
    settings = settings_of(_parse(argv), BenchSettings)
    assert (settings.num_prompts, settings.block_sizes, settings.adaptive) == (5, [16], False)
    # a repeatable flag adds to the file's
    assert [tagged.name for tagged in settings.compare_drafter] == ["a", "b"]


def test_make_data_reads_a_config_file_and_flags_override_it(tmp_path):
    config = _write(
        tmp_path / "data.yaml",
        "target: smollm2-135m\nout: data/smollm2\nmax_new_tokens: 64\nresponses: source\nfinal_hidden: false\n"
        "target_layer_ids: [1, 3]\nchat_template: false\n",
    )
    settings = settings_of(_parse(["make-data", "--config", config]), MakeDataSettings)
    assert (settings.target, settings.out, settings.max_new_tokens) == ("smollm2-135m", "data/smollm2", 64)
    assert (settings.responses, settings.final_hidden, settings.chat_template) == ("source", False, False)
    assert settings.target_layer_ids == [1, 3] and settings.prompts == "sharegpt"
    settings = settings_of(_parse(["make-data", "--config", config, "--out", "other", "--turn", "2"]), MakeDataSettings)
    assert (settings.out, settings.turn, settings.max_new_tokens) == ("other", 2, 64)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_prompts: [3\n", "is not a valid YAML file"),
        ("- 3\n", "holds no mapping of settings"),
        ("num_prompt: 3\n", "unknown setting(s) num_prompt; `dflash-hf bench` takes target, drafter,"),
        ("adaptive: maybe\n", "the setting adaptive is true or false, got 'maybe'"),
    ],
)
def test_a_bad_config_file_is_one_error_line(tmp_path, capsys, text, message):
    config = _write(tmp_path / "bad.yaml", text)
    assert cli.main(["bench", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --config {config}") and message in err[0]
    assert not (tmp_path / "out").exists()


def _one_error_line(capsys, argv: list[str]) -> str:
    """The single `error:` line of `dflash-hf make-data argv`; `--turn 0` is refused after the parse, so a file the
    parse takes never starts a run."""
    assert cli.main(["make-data", *map(str, argv), "--turn", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("out: [a, b]\n", "the setting out takes one plain value (text or a number), got a list"),
        ("out: {a: 1}\n", "the setting out takes one plain value (text or a number), got a mapping"),
        ("out: 2024-01-01\n", "the setting out takes one plain value (text or a number), got a date (quote it"),
        ("out: yes\n", "the setting out takes one plain value (text or a number), got true (quote it"),
        ("target_layer_ids: [[1], 2]\n", "target_layer_ids takes a list of plain values (text or numbers), got a list "
         "holding a list"),
        ("target_layer_ids: [1, null]\n", "got a list holding null"),
        ("final_hidden: [1, 2]\n", "the setting final_hidden is true or false, got a list"),
        # an alias bomb: nine lists of nine of the list before, never written out
        ("prompts: &a [x, x, x, x, x, x, x, x, x]\n"
         + "".join(f"{k}: &{k[0]}{i} [{', '.join([f'*{p}'] * 9)}]\n" for i, (k, p) in enumerate(
             [("server", "a"), ("drafter", "s0"), ("dtype", "d1"), ("device", "d2")])),
         "the setting prompts takes one plain value (text or a number), got a list"),
        ("out: &s " + "x" * 2000 + "\ntarget_layer_ids: [" + ", ".join(["*s"] * 600) + "]\n",
         "the setting target_layer_ids is more than 1048576 characters written out"),
    ],
    ids=["list", "mapping", "date", "yes", "nested list", "null item", "switch list", "alias bomb", "alias repeats"],
)  # fmt: skip
def test_a_config_value_of_the_wrong_shape_is_one_error_line(tmp_path, capsys, text, message):
    config = _write(tmp_path / "data.yaml", "target: smollm2-135m\n" + text)
    line = _one_error_line(capsys, ["--config", config])
    assert line.startswith(f"error: --config {config}: ") and message in line


def test_a_config_file_is_a_regular_file_of_bounded_size_and_depth(tmp_path, capsys):
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it to read would wait for a writer
    for path in (tmp_path, fifo, "/dev/zero"):
        assert f"--config {path} is not a regular file" in _one_error_line(capsys, ["--config", path])
    big = _write(tmp_path / "big.yaml", "# " + "x" * (1 << 20) + "\n")
    assert f"--config {big} is larger than 1048576 bytes" in _one_error_line(capsys, ["--config", big])
    deep = _write(tmp_path / "deep.yaml", "out: " + "[" * 20_000 + "]" * 20_000 + "\n")
    assert f"--config {deep} is nested too deeply" in _one_error_line(capsys, ["--config", deep])


def test_a_second_config_file_is_refused_not_silently_taken(tmp_path, capsys):
    first = _write(tmp_path / "a.yaml", "target: smollm2-135m\nout: a\n")
    second = _write(tmp_path / "b.yaml", "out: b\n")
    line = _one_error_line(capsys, ["--config", first, f"--config={second}"])
    assert f"error: --config is given 2 times ({first}, {second}): pass one settings file" in line


def test_a_missing_config_file_is_one_error_line(tmp_path, capsys):
    assert cli.main(["make-data", "--config", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "none.yaml" in err[0]


def test_the_recorded_command_gives_the_settings_back(tmp_path):
    argv = [
        "bench", "--target", "smollm2-135m", "--drafter", "runs/d", "--compare-drafter", "a=runs/a b",
        "--prompts", "suite", "--num-prompts", "3", "--block-sizes", "4,8", "--no-adaptive", "--no-draft-tree",
        "--lookup-tokens", "3", "--temperatures", "0.7,1.0", "--sampling-block-size", "3", "--skip", "prompt_lookup",
        "--dtype", "float32", "--mkl-mode", "cnr", "--device", "cpu", "--out", tmp_path / "out",
        "--llama-cpp", "bin", "--llama-cpp-draft-tokens", "1,3", "--llama-cpp-p-min", "0.25", "--llama-cpp-ngram",
        "--no-progress", "--allow-mismatch",
    ]  # fmt: skip
    settings = settings_of(_parse(argv), BenchSettings)
    command = _command_line(settings, threads=2)
    assert command.startswith("dflash-hf bench --target smollm2-135m --drafter runs/d --compare-drafter 'a=runs/a b'")
    recorded = settings_of(_parse(shlex.split(command)[1:]), BenchSettings)
    # how the run was shown is not recorded
    assert recorded == dataclasses.replace(settings, threads=2, progress=True, allow_mismatch=False)
    # options of a part the run did not have are left out
    plain = _command_line(settings_of(_parse(["bench"]), BenchSettings), threads=None)
    assert "--llama-cpp" not in plain and "--sampling-block-size" not in plain and "--mkl-mode" not in plain
