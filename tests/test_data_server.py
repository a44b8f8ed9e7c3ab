"""make-data through an inference server: rows equal in-process make-data's, requests in flight, resume, and a clear
error for a server of another model, one without token ids, or none at all (a loopback stand-in server)."""

from __future__ import annotations

import json

import pytest
from testing_utils import (
    PROMPTS,
    StandInServer,
    make_tiny_target,
    make_tokenizer,
    make_word_tokenizer,
    one_thread,
    save_tiny_target,
    write_prompts,
)
from transformers import AutoModelForCausalLM

from dflash_hf.cli import main as cli_main
from dflash_hf.data.make import load_training_data, make_data
from dflash_hf.data.server import ServerError, ServerResponder

pytestmark = pytest.mark.usefixtures("single_thread")
KWARGS = dict(max_new_tokens=10, held_out_fraction=0.0, batch_size=4, progress=False)


@pytest.fixture(scope="module")
def target():
    with one_thread():
        return make_tiny_target("llama")


def _responder(url: str, tokenizer, concurrency: int = 4, **kwargs) -> ServerResponder:
    return ServerResponder(url, tokenizer, 64, KWARGS["max_new_tokens"], [2], concurrency=concurrency, **kwargs)


@pytest.mark.parametrize("api", ["llama.cpp", "openai"])
def test_server_rows_equal_in_process_rows(target, tmp_path, api):
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    make_data(target, tok, tmp_path / "local", source=src, **KWARGS)
    with StandInServer(target, tok, api=api) as server:
        manifest = make_data(target, tok, tmp_path / "served", source=src, server=_responder(server.url, tok), **KWARGS)
    assert server.most_in_flight > 1  # several requests at once
    local, served = load_training_data(tmp_path / "local"), load_training_data(tmp_path / "served")
    assert {r["id"]: r["input_ids"] for r in served} == {r["id"]: r["input_ids"] for r in local}
    assert {r["id"]: r["prompt_length"] for r in served} == {r["id"]: r["prompt_length"] for r in local}
    assert manifest["settings"]["responses_from"] == "server"
    assert manifest["settings"]["server"] == {
        "api": api,
        "model": "stand-in",
        "vocab_size": 64 if api == "llama.cpp" else None,
        "concurrency": 4,
    }


def test_server_runs_resume_and_are_not_mixed_with_in_process_rows(target, tmp_path):
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    with StandInServer(target, tok) as server:
        make_data(
            target,
            tok,
            tmp_path / "out",
            source=src,
            server=_responder(server.url, tok),
            **{**KWARGS, "max_samples": 4},
        )
        first = server.completions
        grown = make_data(target, tok, tmp_path / "out", source=src, server=_responder(server.url, tok), **KWARGS)
    assert first == 4 and server.completions == len(PROMPTS)  # the resumed run asked only for the missing rows
    assert grown["counts"]["samples"] == len(PROMPTS) and grown["counts"]["generated_this_run"] == len(PROMPTS) - 4
    with pytest.raises(ValueError, match="other settings"):
        make_data(target, tok, tmp_path / "out", source=src, **KWARGS)


@pytest.mark.parametrize(
    ("server_kwargs", "message"),
    [
        ({"vocab_size": 99}, "vocabulary of 99 tokens"),
        ({"tokenizer": "words"}, "tokenizes a probe text differently"),
        ({"token_ids": False}, "returned no generated token ids"),
        ({"api": "openai", "token_ids": False}, "returned no generated token ids"),
    ],
)
def test_a_server_of_another_model_is_refused_before_anything_is_written(target, tmp_path, server_kwargs, message):
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    served_tokenizer = make_word_tokenizer() if server_kwargs.pop("tokenizer", None) else tok
    with StandInServer(target, served_tokenizer, **server_kwargs) as server, pytest.raises(ServerError, match=message):
        make_data(target, tok, tmp_path / "out", source=src, server=_responder(server.url, tok), **KWARGS)
    assert not (tmp_path / "out" / "parts").exists() or not list((tmp_path / "out" / "parts").glob("part-*"))


def test_no_server_and_bad_urls_name_the_fix(tmp_path):
    tok = make_tokenizer()
    with pytest.raises(ServerError, match="Cannot reach the server at http://127.0.0.1:9"):
        _responder("http://127.0.0.1:9", tok).check()
    for url in ("127.0.0.1:8080", "ftp://host/x", "http://"):
        with pytest.raises(ValueError, match="is not an http"):
            _responder(url, tok)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        _responder("http://127.0.0.1:8080", tok, concurrency=0)


def test_cli_make_data_through_a_server_loads_no_weights(target, tmp_path, capsys, monkeypatch):
    folder = save_tiny_target(tmp_path / "target")
    import dflash_hf.targets as targets

    monkeypatch.setattr(targets, "load_target", lambda *a, **k: pytest.fail("--server must not load the weights"))
    shell, tok = targets.load_target_shell(folder)
    assert shell.device.type == "meta"
    src = write_prompts(tmp_path / "p.jsonl", prompts=["the cat sat", "a dog ran far", "code def return print"])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with StandInServer(model, tok) as server:
        argv = [
            "make-data",
            "--target",
            str(folder),
            "--prompts",
            str(src),
            "--out",
            str(tmp_path / "out"),
            "--server",
            server.url,
            "--max-new-tokens",
            "6",
            "--held-out-fraction",
            "0",
            "--quiet",
        ]
        assert cli_main(argv) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["samples"] == 3 and counts["generated_this_run"] == 3
