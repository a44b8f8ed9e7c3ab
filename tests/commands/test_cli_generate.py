"""`dflash-hf generate` end to end on a tiny random target + drafter saved to temporary folders."""

from __future__ import annotations

import json
import re

import pytest
import torch
from testing_utils import COMPARE, SUMMARY, make_drafter, make_llama, save_tiny_target
from transformers import AutoTokenizer, CompileConfig

from dflash_hf import cli, drafters, fileio, precision, runtime, targets


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    target_dir = save_tiny_target(root / "target")
    plain_dir = save_tiny_target(root / "plain-target", chat_template=None)
    drafter_dir = root / "drafter"
    make_drafter(make_llama(), seed=3, num_layers=2).save_pretrained(drafter_dir)
    return {"target": target_dir, "plain": plain_dir, "drafter": drafter_dir}


def _run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    """`dflash-hf generate ARGV`: the exit code, the output lines and the error lines."""
    code = cli.main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.strip().splitlines()


def _generate(
    capsys, folders: dict, prompt: str, max_new_tokens: int, *flags: str, target=None
) -> tuple[int, list[str], list[str]]:
    """`dflash-hf generate PROMPT` with the saved drafter, on the saved target unless `target` names another."""
    target = folders["target"] if target is None else target
    drafter = str(folders["drafter"])
    return _run(
        capsys, prompt, "--target", str(target), "--drafter", drafter, "--max-new-tokens", str(max_new_tokens), *flags
    )


def _summary(out: list[str], pattern: str) -> re.Match:
    """The match of the command's last output line, its summary, against `pattern`."""
    match = re.match(pattern, out[-1])
    assert match, out[-1]
    return match


def _precision(err: list[str]) -> str:
    """The dtype the command reported choosing (its stderr line `precision: DTYPE (why)`)."""
    [line] = [line for line in err if line.startswith("precision: ")]
    match = re.match(r"^precision: (float32|bfloat16) \(.+\)$", line)
    assert match, line
    return match.group(1)


def _assert_greedy_answer(
    match: re.Match, out: list[str], target_dir, input_ids: torch.Tensor, max_new_tokens: int, dtype: str
) -> None:
    """The command's answer (its output before the summary `match`) and token count are plain greedy decoding's by a
    freshly loaded target (stock attention) in `dtype`."""
    model, tokenizer = targets.load_target(target_dir, dtype=dtype)
    new = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)[0, input_ids.shape[1] :]
    assert int(match.group(1)) == len(new)
    assert "\n".join(out[:-1]).strip() == tokenizer.decode(new, skip_special_tokens=True).strip()


HOSTS = {  # kind of CPU -> (its native bf16 unit, the precision whose DFlash cycle it measures faster)
    "no native bf16 (AVX2 EPYC, AVX-512 Xeon)": (None, None),
    "AVX512-BF16 EPYC, bf16 faster": ("AVX512-BF16", torch.bfloat16),
    "AMX Xeon, float32 faster": ("AMX-BF16", torch.float32),
}


@pytest.mark.parametrize("host", list(HOSTS))
def test_greedy_compare_streams_the_lossless_answer(folders, capsys, monkeypatch, tmp_path, host):
    """`--dtype auto` on each kind of host (its bf16 unit and the measured cycle times stood in) picks its precision,
    and in it the engine's answer is plain greedy decoding's."""
    feature, faster = HOSTS[host]
    monkeypatch.setenv(fileio.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(runtime, "native_bf16_feature", lambda: feature)
    monkeypatch.setattr(precision, "_cycle_ms", lambda model, *args: 1.0 if model.dtype == faster else 2.0)
    code, out, err = _generate(capsys, folders, "the cat sat", 12, "--compare", "--threads", "1")
    assert code == 0
    match = _summary(out, COMPARE)
    assert match.group(2) == "greedy" and match.group(4) == "yes"
    verdicts = tmp_path / precision.VERDICTS_FILE
    if feature is None:  # nothing to measure
        assert _precision(err) == "float32" and not verdicts.exists()
    else:  # measured once: bf16 where its cycle was faster and its verification bit-exact
        [verdict] = json.loads(verdicts.read_text()).values()
        bf16 = faster == torch.bfloat16 and verdict["bfloat16_exact"]
        assert _precision(err) == ("bfloat16" if bf16 else "float32")

    tokenizer = AutoTokenizer.from_pretrained(folders["target"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the cat sat"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert match.group(3) == _precision(err)
    _assert_greedy_answer(match, out, folders["target"], prompt, 12, _precision(err))


def test_plain_prompt_block_size_and_no_template(folders, capsys):
    for target, extra in ((folders["plain"], []), (folders["target"], ["--no-chat-template"])):
        code, out, err = _generate(capsys, folders, "a dog ran", 6, "--block-size", "3", *extra, target=target)
        assert code == 0
        match = _summary(out, SUMMARY)
        input_ids = AutoTokenizer.from_pretrained(target)("a dog ran", return_tensors="pt").input_ids
        _assert_greedy_answer(match, out, target, input_ids, 6, _precision(err))


def test_sampling_compare(folders, capsys):
    torch.manual_seed(0)
    flags = ["--temperature", "0.8", "--top-k", "10", "--top-p", "0.9", "--compare"]
    code, out, err = _generate(capsys, folders, "the cat sat", 8, *flags)
    assert code == 0
    match = _summary(out, COMPARE)
    assert match.group(2) == "sampling" and match.group(4) == "n/a (sampling)"
    # the line names what the cycles verify: the block alone, whatever was asked
    engine = next(line for line in err if line.startswith("engine: "))
    assert re.fullmatch(
        r"engine: block size \d+, candidates dflash \(.*; dflash\+lookup asked, sampling verifies the DFlash block "
        r"alone\)",
        engine,
    ), engine


def test_compile_runs_the_compiled_engine_and_compares_with_static_greedy(folders, capsys, monkeypatch):
    """`--compile`: the engine compiles its verify forwards (a counting-free eager backend stands in for inductor on
    CPU), and `--compare` times plain greedy on a static cache; the answers are the same."""
    import dflash_hf.engine.generation_call as generation_call

    configs = []

    def eager_config(value):
        configs.append(value)
        return CompileConfig(backend="eager", mode=None, fullgraph=True) if value else None

    import dflash_hf.commands.generate as generate_command

    calls, real_generate = [], generate_command.generate

    def recorded(target, drafter, input_ids, **kwargs):
        calls.append((input_ids.shape[1], kwargs["max_new_tokens"]))
        return real_generate(target, drafter, input_ids, **kwargs)

    monkeypatch.setattr(generation_call, "compile_config_of", eager_config)
    monkeypatch.setattr(generate_command, "generate", recorded)
    code, out, err = _generate(capsys, folders, "the cat sat", 12, "--compile", "--compare", "--dtype", "float32")
    assert code == 0 and configs == [True, True]  # the warm-up and the timed call
    assert calls[0] == calls[1]  # the warm-up runs every shape the timed call runs
    match = _summary(out, COMPARE)
    assert match.group(2) == "greedy, static cache" and match.group(4) == "yes"


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_sampling_proposal_candidates_and_lookup_flags_reach_the_engine(folders, capsys, monkeypatch, proposal):
    import dflash_hf.engine.generation_call as generation_call

    seen = []
    real = generation_call.GenerationCall.__init__

    def recording(self, *args, **kwargs):
        seen.append((kwargs.get("sampling_proposal"), kwargs.get("candidates"), kwargs.get("lookup_tokens")))
        real(self, *args, **kwargs)

    monkeypatch.setattr(generation_call.GenerationCall, "__init__", recording)
    code, _, _ = _generate(
        capsys, folders, "the cat sat", 4, "--temperature", "0.8", "--sampling-proposal", proposal,
        "--candidates", "dflash+lookup", "--lookup-tokens", "6",
    )  # fmt: skip
    assert code == 0 and seen[-1] == (proposal, "dflash+lookup", 6)


def test_the_cli_registers_every_command_module():
    """`dflash_hf.cli.COMMANDS` holds the `register` of every module in `dflash_hf.commands`, in the help's order."""
    import argparse
    import pkgutil

    from dflash_hf import commands

    modules = {module.name for module in pkgutil.iter_modules(commands.__path__)}
    assert sorted(register.__module__.rsplit(".", 1)[-1] for register in cli.COMMANDS) == sorted(modules)
    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(subparsers.choices) == [
        "make-data", "cache-features", "train", "generate", "export", "push", "bench", "profile", "results-doc",
    ]  # fmt: skip


def test_defaults_use_named_target_and_bundled_drafter(monkeypatch, tmp_path, capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hello"])
    assert args.target == targets.DEFAULT_TARGET == "smollm2-135m"
    assert args.drafter is None and not args.compare and args.max_new_tokens > 0
    assert drafters.bundled_drafter_dir("smollm2-135m").parts[-2:] == ("bundled", "dflash-smollm2-135m")

    # without a bundled drafter the command stops before loading anything, with one error line
    missing = tmp_path / "bundled" / "dflash-smollm2-135m"
    monkeypatch.setattr(drafters, "bundled_drafter_dir", lambda name: missing)
    monkeypatch.setattr(targets, "load_target", lambda *a, **k: pytest.fail("target must not be loaded"))
    code, out, err = _run(capsys, "hello")
    assert code == 2 and out == []
    assert len(err) == 1 and err[0].startswith("error: ") and "--drafter PATH" in err[0] and str(missing) in err[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--drafter", "{tmp}/nowhere"], "--drafter PATH"),
        (["--target", "{target}"], "--drafter PATH"),  # a folder target has no bundled drafter
        (["--drafter", "{drafter}", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--drafter", "{drafter}", "--temperature", "-1"], "--temperature"),
        (["--drafter", "{drafter}", "--top-p", "1.5"], "--top-p"),
        (["--drafter", "{drafter}", "--temperature", "0", "--top-k", "5"], "greedy"),
        (["--drafter", "{drafter}", "--target", "{target}", "--block-size", "9"], "--block-size"),
        (["--drafter", "{drafter}", "--target", "{target}", "--lookup-tokens", "0"], "--lookup-tokens"),
    ],
)
def test_bad_input_gives_one_error_line(folders, tmp_path, capsys, argv, message):
    values = {"tmp": tmp_path, "target": folders["target"], "drafter": folders["drafter"]}
    code, _, err = _run(capsys, "hi", *[arg.format(**values) for arg in argv])
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_random_target_without_a_drafter_runs_with_a_random_drafter(capsys):
    code, out, err = _run(
        capsys,
        "hello world",
        "--target",
        "random:tiny-qwen3",
        "--max-new-tokens",
        "6",
        "--dtype",
        "float32",
        "--compare",
    )
    assert code == 0, err
    assert "engine: block size 16, candidates dflash+lookup (the engine's defaults)" in err
    assert _summary(out, COMPARE).group(4) == "yes"


@pytest.mark.parametrize("target", ["random:nope", "random:"])
def test_an_unknown_random_shape_is_named_with_the_known_ones(capsys, target):
    code, _, err = _run(capsys, "hi", "--target", target, "--max-new-tokens", "2")
    assert code == 2 and len(err) == 1 and "Unknown random target" in err[0] and "random:tiny-qwen3" in err[0], err
