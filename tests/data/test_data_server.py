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
from transformers import AutoModelForCausalLM, AutoTokenizer

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


def test_the_server_stays_busy_across_parts(target, tmp_path):
    """Parts of 2 rows with 6 requests in flight: the next parts' requests are sent before a part is written."""
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    with StandInServer(target, tok) as server:
        responder = _responder(server.url, tok, concurrency=6)
        make_data(target, tok, tmp_path / "out", source=src, server=responder, **{**KWARGS, "batch_size": 2})
    assert server.most_in_flight > 2
    assert len(list((tmp_path / "out" / "parts").glob("part-*"))) == -(-len(PROMPTS) // 2)


def test_requests_keep_flowing_past_each_window_of_prompts(target, tmp_path):
    """Batches of one prompt are planned from windows of 8 prompts: while the first request is slow, the requests go
    on past the first window (the server never waits idle for a window's last answer)."""
    tok = make_tokenizer()
    prompts = [f"{prompt} {i}" for i in range(2) for prompt in PROMPTS]  # 12: more than one window
    src = str(write_prompts(tmp_path / "p.jsonl", prompts))
    with StandInServer(target, tok, slow_first=3.0) as server:
        responder = _responder(server.url, tok, concurrency=3)
        make_data(target, tok, tmp_path / "out", source=src, server=responder, **{**KWARGS, "batch_size": 1})
    assert server.started_while_first_ran >= 8  # the first window's other 7, and the next window's
    assert len(load_training_data(tmp_path / "out")) == len(prompts)


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


def test_a_responder_built_for_other_settings_is_refused(target, tmp_path):
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    with pytest.raises(ValueError, match="built for max_new_tokens 10 .* this run has 4"):
        make_data(
            target,
            tok,
            tmp_path / "out",
            source=src,
            server=_responder("http://127.0.0.1:9", tok),
            **{**KWARGS, "max_new_tokens": 4},
        )
    assert not (tmp_path / "out").exists()


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


# ------------------------------------------------------------------ spot check of the served rows (server_verify)


class _Lying(StandInServer):
    """A stand-in server whose greedy answers `lie(answers so far, honest answer)` turns into others."""

    def __init__(self, target, tokenizer, lie):
        super().__init__(target, tokenizer)
        self.lie, self.answers = lie, []

    def complete(self, prompt, limit):
        answer = super().complete(prompt, limit)
        honest = answer["tokens"]
        answer["tokens"] = self.lie(self.answers, honest)
        self.answers.append(honest)
        return answer


def test_a_spot_check_passes_the_target_s_own_answers(target, tmp_path):
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    with StandInServer(target, tok) as server:
        responder = _responder(server.url, tok)
        manifest = make_data(target, tok, tmp_path / "out", source=src, server=responder, server_verify=99, **KWARGS)
    assert manifest["settings"]["server"]["verified_rows"] == len(PROMPTS)  # every row: no more than there are
    assert len(load_training_data(tmp_path / "out")) == len(PROMPTS)


@pytest.mark.parametrize(
    "lie",
    [
        lambda before, honest: [7, 7, 7, 2],
        lambda before, honest: honest[:1] + [2],
        lambda before, honest: honest if len(before) < 3 else [9, 9, 2],
        lambda before, honest: before[-1] if before else honest,
    ],
    ids=["other ids", "a made-up end of turn", "drift after a few honest answers", "the previous request's answer"],
)
def test_a_spot_check_refuses_answers_that_are_not_the_target_s(target, tmp_path, lie):
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    with _Lying(target, tok, lie) as server:
        responder = _responder(server.url, tok, concurrency=1)
        with pytest.raises(ValueError, match=r"The served response of row '.*' in .* is not the target's: its token"):
            make_data(target, tok, tmp_path / "out", source=src, server=responder, server_verify=99, **KWARGS)
    assert not (tmp_path / "out" / "dataset").exists() and not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("verify_again", [0, 1])
def test_rows_a_failed_spot_check_found_are_never_published(target, tmp_path, verify_again):
    """One lying row in six: the check that finds it marks the folder, and the same command again (all rows already
    made), with a smaller spot check or none, refuses to publish instead of drawing other rows."""
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    with _Lying(target, tok, lambda before, honest: [7, 7, 7, 2] if len(before) == 2 else honest) as server:
        responder = _responder(server.url, tok, concurrency=1)
        with pytest.raises(ValueError, match="is not the target's"):
            make_data(target, tok, tmp_path / "out", source=src, server=responder, server_verify=99, **KWARGS)
        with pytest.raises(ValueError, match="found a served row that is not the target's answer"):
            make_data(target, tok, tmp_path / "out", source=src, server=responder, server_verify=verify_again, **KWARGS)
    assert not (tmp_path / "out" / "dataset").exists() and not (tmp_path / "out" / "manifest.json").exists()


def test_verified_rows_count_the_rows_verified_over_the_folder(target, tmp_path):
    """Each run checks rows no earlier run verified; the manifest counts every row verified so far."""
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    counts = []
    with StandInServer(target, tok) as server:
        responder = _responder(server.url, tok)
        for _ in range(3):
            manifest = make_data(target, tok, tmp_path / "out", source=src, server=responder, server_verify=2, **KWARGS)
            counts.append(manifest["settings"]["server"]["verified_rows"])
    assert counts == [2, 4, min(6, len(PROMPTS))]


def test_a_spot_check_it_cannot_run_is_refused_before_anything_is_written(target, tmp_path):
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    shell = type(target)(target.config).to("meta")
    cases = [
        (target, None, 2, "pass a server"),
        (target, _responder("http://127.0.0.1:9", tok), -1, "server_verify must be an int >= 0"),
        (shell, _responder("http://127.0.0.1:9", tok), 2, "this target has none"),
    ]
    for model, server, count, message in cases:
        with pytest.raises(ValueError, match=message):
            make_data(model, tok, tmp_path / "out", source=src, server=server, server_verify=count, **KWARGS)
    assert not (tmp_path / "out").exists()


def test_cli_server_verify_loads_the_weights_and_fails_with_one_error_line(tmp_path, capsys):
    folder = save_tiny_target(tmp_path / "target")
    src = write_prompts(tmp_path / "p.jsonl", prompts=["the cat sat", "a dog ran far", "code def return print"])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    argv = ["make-data", "--target", str(folder), "--prompts", str(src), "--out", str(tmp_path / "out")]
    argv += ["--max-new-tokens", "6", "--held-out-fraction", "0", "--quiet", "--server-verify", "3"]
    assert cli_main(argv) == 2
    assert "error: --server-verify recomputes rows made through --server" in capsys.readouterr().err
    with _Lying(model, AutoTokenizer.from_pretrained(folder), lambda before, honest: [4, 4, 4, 4, 4, 4]) as server:
        assert cli_main([*argv, "--server", server.url]) == 2
    assert "error: The served response of row" in capsys.readouterr().err
    assert not (tmp_path / "out" / "dataset").exists()
    with StandInServer(model, AutoTokenizer.from_pretrained(folder)) as server:  # an honest server now: still refused
        assert cli_main([*argv[:-2], "--server", server.url]) == 2
    assert "found a served row that is not the target's answer" in capsys.readouterr().err
    assert not (tmp_path / "out" / "dataset").exists()


@pytest.mark.parametrize("timeout", ["0", "-1", "1e9"])
def test_cli_server_timeout_errors_name_the_flag(tmp_path, capsys, timeout):
    folder = save_tiny_target(tmp_path / "target")
    src = write_prompts(tmp_path / "p.jsonl", prompts=["the cat sat"])
    argv = ["make-data", "--target", str(folder), "--prompts", str(src), "--out", str(tmp_path / "out"), "--quiet"]
    argv += ["--server", "http://127.0.0.1:9", "--server-timeout", timeout]
    assert cli_main(argv) == 2
    assert "--server-timeout" in capsys.readouterr().err


# ------------------------------------------------------------------ hostile and broken servers


class _Scripted:
    """A loopback server answering as llama-server (`/props`, `/v1/models`, `/tokenize`, `/completion`) with the
    target's tokenizer, where `answers[(method, path)](body)` overrides an answer: `(status, JSON or bytes)`,
    `"broken"` (a body cut short, then the connection closed), `"not http"` (no HTTP status line), `("sleep", s)`
    (no answer for `s` seconds), `("redirect", status, location)` or `("trickle", s)` (a long body, a byte every `s`
    seconds)."""

    def __init__(self, tokenizer, answers=None):
        import http.server
        import threading

        from dflash_hf.data.server import TOKENIZATION_PROBE

        probe = tokenizer(TOKENIZATION_PROBE, add_special_tokens=False)["input_ids"]
        self.answers = {
            ("GET", "/props"): lambda body: (200, {"total_slots": 4}),
            ("GET", "/v1/models"): lambda body: (200, {"data": [{"id": "m", "meta": {"n_vocab": 64}}]}),
            ("POST", "/tokenize"): lambda body: (200, {"tokens": probe}),
            ("POST", "/completion"): lambda body: (200, {"tokens": [5, 2]}),
            **(answers or {}),
        }
        self.bodies: list[dict] = []
        scripted = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                scripted.bodies.append(body)
                answer = scripted.answers.get((method, self.path), lambda body: (404, {"error": "not found"}))(body)
                if isinstance(answer, tuple) and answer[0] == "sleep":
                    import time

                    time.sleep(answer[1])
                    return
                if isinstance(answer, tuple) and answer[0] == "redirect":
                    self.send_response(answer[1])
                    self.send_header("Location", answer[2])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if isinstance(answer, tuple) and answer[0] == "trickle":
                    import time

                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    for _ in range(1000):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(answer[1])
                    return
                if answer == "not http":
                    self.wfile.write(b"NOT HTTP\r\n\r\n")
                    return
                status, data = (200, b'{"tokens": [5, ') if answer == "broken" else answer
                data = data if isinstance(data, bytes) else json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data) + (100 if answer == "broken" else 0)))
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = True

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads, self._http.block_on_close = True, False
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> "_Scripted":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()


def _completion(answer):
    return {("POST", "/completion"): lambda body: answer}


def _models(answer):
    return {("GET", "/v1/models"): lambda body: (200, answer)}


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        (_completion((200, {"tokens": [True, False]})), r"token ids that are not integers \(True\)"),
        (_completion((200, {"tokens": [5.0, 2.0]})), r"token ids that are not integers \(5.0\)"),
        (_completion((200, {"tokens": []})), "generated no token for a prompt of 3 tokens"),
        (_completion("broken"), "sent a broken HTTP answer"),
        (_completion("not http"), "sent a broken HTTP answer"),
        (_completion((200, b"[" * 100_000)), "did not answer JSON"),
        (_models({"data": {"id": "m"}}), "lists no model"),
        (_models({"data": [{"id": "m"}, 3]}), "lists models without a string `id`"),
        (_models({"data": [{"meta": {"n_vocab": 64}}]}), "lists models without a string `id`"),
        (_models({"data": [{"id": "m", "meta": {"n_vocab": [64]}}]}), r"vocabulary size of \[64\], not a number"),
        ({("POST", "/tokenize"): lambda body: (200, {"tokens": [{"piece": "x"}]})}, "tokenizes a probe text"),
        (_completion((200, {"tokens": [5, 6, 7]})), "stopped after 3 of 10 tokens on token 7, which the target"),
    ],
    ids=[
        "boolean ids",
        "float ids",
        "no token",
        "body cut short",
        "no status line",
        "JSON too deep",
        "models not a list",
        "model not an object",
        "model without id",
        "vocabulary not a number",
        "tokenize without ids",
        "stopped short without EOS",
    ],
)
def test_broken_answers_are_server_errors_never_rows(answers, message):
    tok = make_tokenizer()
    with _Scripted(tok, answers) as server, pytest.raises(ServerError, match=message):
        responder = _responder(server.url, tok, api="llama.cpp")
        responder.check()
        responder([[1, 2, 3]])


def test_a_run_that_made_nothing_leaves_no_folder(target, tmp_path):
    """A server that answers the probes and then breaks: the run fails, and its new folder (with the settings it
    recorded) is gone, so the next run starts clean; a folder that holds rows is kept for its resume."""
    tok = make_tokenizer()
    src = str(write_prompts(tmp_path / "p.jsonl"))
    with _Scripted(tok, _completion("broken")) as server, pytest.raises(ServerError, match="broken HTTP answer"):
        make_data(
            target, tok, tmp_path / "out", source=src, server=_responder(server.url, tok, api="llama.cpp"), **KWARGS
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:abc",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "http://127.0.0.1:8080/?a=1",
        "http://h#x",
    ],
)
def test_urls_with_a_bad_port_a_query_or_a_fragment_are_refused_up_front(url):
    with pytest.raises(ValueError, match="is not an http"):
        _responder(url, make_tokenizer())


def test_https_to_a_plain_server_and_a_v1_base_url_name_the_fix():
    tok = make_tokenizer()
    with _Scripted(tok) as server:
        with pytest.raises(ServerError, match="for a plain HTTP server use an http:// URL"):
            _responder("https" + server.url[len("http") :], tok).check()
        with pytest.raises(ServerError, match="without /v1"):
            _responder(server.url + "/v1", tok).check()


def test_a_stalled_server_fails_after_timeout_s_and_a_failed_request_does_not_wait_for_the_others():
    import time

    tok = make_tokenizer()
    slow_then_failing = {
        ("POST", "/completion"): lambda body: ("sleep", 5) if body["prompt"] == [1] else (500, {"error": "boom"})
    }
    with _Scripted(tok, slow_then_failing) as server:
        responder = _responder(server.url, tok, api="llama.cpp", timeout_s=0.5)
        with pytest.raises(ServerError, match=r"/completion gave no answer within 0.5 s: the server is stalled"):
            responder([[1]])
        responder = _responder(server.url, tok, api="llama.cpp")
        started = time.monotonic()
        with pytest.raises(ServerError, match="HTTP 500"):
            responder([[1], [2]])  # the first prompt's request is still in flight
        assert time.monotonic() - started < 3


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize(("method", "path"), [("POST", "/completion"), ("GET", "/v1/models"), ("POST", "/tokenize")])
def test_a_redirect_is_refused_never_followed(status, method, path):
    """A redirect to another host is a server error: the other host's answers (to a request without the prompt,
    after a 302/303) never become rows."""
    tok = make_tokenizer()
    elsewhere_answers = {
        (verb, route): lambda body: (200, {"tokens": [5, 6, 2], "data": [{"id": "m"}]})
        for verb in ("GET", "POST")
        for route in ("/completion", "/v1/models", "/tokenize")
    }
    with _Scripted(tok, elsewhere_answers) as elsewhere:
        redirect = {(method, path): lambda body: ("redirect", status, elsewhere.url + path)}
        with _Scripted(tok, redirect) as server:
            responder = _responder(server.url, tok, api="llama.cpp")
            with pytest.raises(ServerError, match=rf"{path} answered HTTP {status}, a redirect to .*--server"):
                responder.check()
                responder([[1, 7, 8, 9]])
    assert elsewhere.bodies == []  # nothing was asked of the other host


def test_an_answer_trickled_past_timeout_s_fails_at_the_deadline():
    import time

    tok = make_tokenizer()
    with _Scripted(tok, _completion(("trickle", 0.05))) as server:
        responder = _responder(server.url, tok, api="llama.cpp", timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(ServerError, match=r"/completion gave no answer within 0.5 s"):
            responder([[1]])
        assert time.monotonic() - started < 1.5  # not the 50 s the whole trickle takes


def test_an_answer_far_larger_than_max_new_tokens_needs_is_refused():
    from dflash_hf.data.server import ANSWER_BYTES, ANSWER_BYTES_PER_TOKEN

    tok = make_tokenizer()
    limit = ANSWER_BYTES + ANSWER_BYTES_PER_TOKEN * KWARGS["max_new_tokens"]
    huge = (200, {"tokens": [5, 2], "content": "x" * limit})
    with _Scripted(tok, _completion(huge)) as server:
        with pytest.raises(
            ServerError, match=rf"^\S+/completion sent an answer of more than {limit} bytes, far beyond"
        ):
            _responder(server.url, tok, api="llama.cpp")([[1]])


def test_ctrl_c_returns_at_once_while_requests_are_in_flight():
    import os
    import signal
    import threading
    import time

    tok = make_tokenizer()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as a fresh process takes it
    with _Scripted(tok, _completion(("sleep", 5))) as server:
        responder = _responder(server.url, tok, api="llama.cpp")
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        started = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            responder([[1], [2]])
        timer.join()
        assert time.monotonic() - started < 3  # not after the 5 s answers
    signal.signal(signal.SIGINT, previous)


def test_openai_requests_state_no_repetition_penalty_so_no_served_default_applies():
    """vLLM and SGLang apply the model's generation_config (Qwen2.5: repetition_penalty 1.1) to what a request leaves
    out; a greedy row must not be penalized (llama-server's `samplers: ["top_k"]` already leaves penalties out)."""
    tok = make_tokenizer()

    def penalized_unless_stated(body):
        stated = (body.get("repetition_penalty"), body.get("presence_penalty"), body.get("frequency_penalty"))
        tokens = [5, 2] if stated == (1.0, 0.0, 0.0) else [6, 2]
        return (200, {"choices": [{"text": "", "token_ids": tokens}]})

    openai = {("GET", "/props"): lambda body: (404, {}), ("POST", "/v1/completions"): penalized_unless_stated}
    with _Scripted(tok, openai) as server:
        responder = _responder(server.url, tok)
        assert responder.check()["api"] == "openai"
        assert responder([[1, 2, 3]]) == [[5, 2]]
