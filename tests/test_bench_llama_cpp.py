"""llama.cpp rows of the bench, against a stand-in `llama-server` (a small HTTP server on loopback that answers as
llama.cpp's does): servers started and stopped, the same prompt text to both, rows, report table and refusals."""

from __future__ import annotations

import json
import stat
import sys
import textwrap

import pytest
from testing_utils import make_tokenizer

from dflash_hf import bench
from dflash_hf.bench import llama_cpp

# A stand-in llama-server: `/health`, and `/completion` that continues the prompt with its reversed words; with
# `-md` (a drafter) it reports drafted and accepted tokens, and with STANDIN_DIFFER set its text differs.
STANDIN = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    drafting = "-md" in args
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(json.dumps(args) + "\\n")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _reply(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply({{"status": "ok"}})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            words = request["prompt"].split()[::-1][: request["n_predict"]]
            text = " ".join(words) + (" x" if drafting and os.environ.get("STANDIN_DIFFER") else "")
            timings = {{"predicted_n": len(words), "predicted_ms": 10.0 * len(words) / (2 if drafting else 1)}}
            if drafting:
                timings.update(draft_n=4 * len(words), draft_n_accepted=len(words))
            self._reply({{"content": text, "timings": timings}})

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def bin_dir(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    server = folder / "llama-server"
    server.write_text(STANDIN.format(python=sys.executable))
    server.chmod(server.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "servers.log"))
    return folder


def _prompts(tokenizer):
    texts = ["the cat sat", "a big red dog ran"]
    return [bench.BenchPrompt(id=str(i), input_ids=tokenizer(t)["input_ids"]) for i, t in enumerate(texts)]


def test_llama_cpp_rows_from_both_servers(bin_dir, tmp_path):
    tokenizer = make_tokenizer()
    rows = llama_cpp.run_llama_cpp(
        bin_dir, tmp_path / "target.gguf", tmp_path / "drafter.gguf", _prompts(tokenizer), tokenizer,
        max_new_tokens=16, draft_tokens=3, threads=1,
    )  # fmt: skip
    plain, drafting = rows
    assert plain.identical_to_plain is None and plain.speedup_vs_plain == 1.0 and plain.drafted == 0
    assert drafting.identical_to_plain is True
    assert drafting.acceptance == pytest.approx(0.25) and drafting.speedup_vs_plain == pytest.approx(2.0)
    assert plain.new_tokens == drafting.new_tokens > 0
    launched = [json.loads(line) for line in (tmp_path / "servers.log").read_text().splitlines()]
    assert "-md" not in launched[0] and launched[1][launched[1].index("-md") + 1] == str(tmp_path / "drafter.gguf")
    assert launched[1][launched[1].index("--spec-draft-n-max") + 1] == "3" and "draft-dflash" in launched[1]
    assert all("127.0.0.1" in args for args in launched)  # loopback only
    document = {"llama_cpp": llama_cpp.rows_to_json(rows, {"binary_dir": "bin", "target_gguf": "t.gguf",
                                                           "gguf_type": "f32", "threads": 1})}  # fmt: skip
    table = bench.llama_cpp_table(document)
    assert "| llama.cpp + DFlash drafter (n_max 3) | " in table and "| 2.00x | 0.250 | yes |" in table
    assert bench.llama_cpp_table({"llama_cpp": None}) is None


def test_a_differing_completion_is_reported(bin_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_DIFFER", "1")
    tokenizer = make_tokenizer()
    rows = llama_cpp.run_llama_cpp(
        bin_dir, tmp_path / "t.gguf", tmp_path / "d.gguf", _prompts(tokenizer), tokenizer, 8, 3, 1
    )
    assert rows[1].identical_to_plain is False


def test_missing_server_and_a_server_that_exits(tmp_path):
    tokenizer = make_tokenizer()
    with pytest.raises(ValueError, match="No llama-server in"):
        llama_cpp.run_llama_cpp(
            tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", _prompts(tokenizer), tokenizer, 8, 3, 1
        )
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(ValueError, match="exited with status 3 before it was ready"):
        llama_cpp.run_llama_cpp(
            tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", _prompts(tokenizer), tokenizer, 8, 3, 1
        )
