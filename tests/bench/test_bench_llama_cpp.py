"""llama.cpp rows of the bench, against a stand-in `llama-server` (a small HTTP server on loopback that answers as
llama.cpp's does): servers started and stopped, the same prompt text to both, rows, report table and refusals."""

from __future__ import annotations

import argparse
import json
import stat
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

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
    setups = [llama_cpp.dflash_setup(tmp_path / "drafter.gguf", 3, threads=1)]
    rows = llama_cpp.run_llama_cpp(
        bin_dir, tmp_path / "target.gguf", setups, _prompts(tokenizer), tokenizer, max_new_tokens=16, threads=1
    )
    plain, drafting = rows
    assert plain.identical_to_plain is None and plain.speedup_vs_plain == 1.0 and plain.drafted == 0
    assert drafting.identical_to_plain is True and drafting.completions_identical == 2
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
    assert "forward costs" not in table  # none measured
    assert bench.llama_cpp_table({"llama_cpp": None}) is None


def test_speculative_setups():
    dflash = llama_cpp.dflash_setup("d.gguf", 3, threads=2, p_min=0.5)
    assert dflash.label == "llama.cpp + DFlash drafter (n_max 3, p_min 0.5)"
    flags = list(dflash.flags)
    assert flags[flags.index("--spec-draft-p-min") + 1] == "0.5" and flags[flags.index("-td") + 1] == "2"
    assert "--spec-draft-p-min" not in llama_cpp.dflash_setup("d.gguf", 3, threads=2).flags
    alone = list(llama_cpp.ngram_setup(7).flags)
    assert alone[alone.index("--spec-type") + 1] == "ngram-simple" and "-md" not in alone
    assert alone[alone.index("--spec-ngram-simple-size-m") + 1] == "7"
    both = llama_cpp.ngram_setup(3, drafter=dflash)
    flags = list(both.flags)
    assert flags[flags.index("--spec-type") + 1] == "draft-dflash,ngram-simple" and "-md" in flags
    assert both.label == "llama.cpp + n-gram lookup + DFlash drafter (n_max 3, p_min 0.5)"


# Stand-ins for llama-quantize (copies its input, or fails on a type named BAD) and llama-bench (JSON like
# llama-bench -o json: a k-token forward costs 1 + k/4 plain steps of 20 ms).
QUANTIZE = """#!{python}
import shutil, sys
args = sys.argv[1:]
if args[-1] == "BAD":
    print("main: invalid ftype BAD", file=sys.stderr)
    sys.exit(1)
shutil.copy(args[1], args[2])
"""
LLAMA_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
rows = [{{"n_prompt": k, "n_gen": 0, "avg_ts": k / (0.020 * (1 + k / 4))}} for k in map(int, args[args.index("-p") + 1].split(","))]
print(json.dumps(rows + [{{"n_prompt": 0, "n_gen": 32, "avg_ts": 50.0}}]))
"""


def _tool(folder, name, text):
    path = folder / name
    path.write_text(text.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_requantize_and_forward_costs(bin_dir, tmp_path):
    source = tmp_path / "target.gguf"
    source.write_bytes(b"GGUF")
    assert llama_cpp.forward_costs(bin_dir, source, 1, 100, [1, 4]) is None  # no llama-bench
    with pytest.raises(ValueError, match="No llama-quantize in"):
        llama_cpp.requantize(bin_dir, source, "F16", tmp_path / "f16.gguf")
    _tool(bin_dir, "llama-quantize", QUANTIZE)
    _tool(bin_dir, "llama-bench", LLAMA_BENCH)
    assert llama_cpp.requantize(bin_dir, source, "f16", tmp_path / "f16.gguf").read_bytes() == b"GGUF"
    with pytest.raises(ValueError, match="could not write a BAD GGUF: main: invalid ftype BAD"):
        llama_cpp.requantize(bin_dir, source, "BAD", tmp_path / "bad.gguf")
    costs = llama_cpp.forward_costs(bin_dir, source, 1, 100, [4, 1, 4])
    assert costs["depth"] == 100 and costs["step_ms"] == pytest.approx(20.0)
    assert costs["forward_steps"] == pytest.approx({"1": 1.25, "4": 2.0})


def test_bench_command_llama_cpp_part(bin_dir, tmp_path, monkeypatch):
    """`dflash-hf bench --llama-cpp` with every llama.cpp option: the requantized target served, one DFlash row per
    draft length, the n-gram rows, the costs, and the report's table."""
    from dflash_hf.commands import bench as bench_command
    from dflash_hf.hub import gguf as gguf_export

    _tool(bin_dir, "llama-quantize", QUANTIZE)
    _tool(bin_dir, "llama-bench", LLAMA_BENCH)
    source = tmp_path / "target.gguf"
    source.write_bytes(b"GGUF")
    exported = []

    def write_gguf(drafter, path, target, gguf_type):
        exported.append((Path(target).name, gguf_type))
        Path(path).write_bytes(b"drafter")
        return Path(path)

    monkeypatch.setattr(gguf_export, "write_gguf", write_gguf)
    parser = argparse.ArgumentParser()
    bench_command.register(parser.add_subparsers())
    args = parser.parse_args([
        "bench", "--llama-cpp", str(bin_dir), "--llama-cpp-target", str(source), "--llama-cpp-requantize", "F16",
        "--llama-cpp-draft-tokens", "1,3", "--llama-cpp-p-min", "0.4", "--llama-cpp-ngram",
        "--llama-cpp-gguf-type", "q8_0", "--max-new-tokens", "8",
    ])  # fmt: skip
    tokenizer = make_tokenizer()
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=4))
    part = bench_command._llama_cpp(args, drafter, _prompts(tokenizer), tokenizer, threads=1)
    assert exported == [("target-F16.gguf", "q8_0")]  # the drafter's head rows come from the served target
    assert [row["label"] for row in part["rows"]] == [
        "llama.cpp plain greedy",
        "llama.cpp + DFlash drafter (n_max 1, p_min 0.4)",
        "llama.cpp + DFlash drafter (n_max 3, p_min 0.4)",
        "llama.cpp n-gram lookup (ngram-simple, n_max 3)",
        "llama.cpp + n-gram lookup + DFlash drafter (n_max 1, p_min 0.4)",
        "llama.cpp + n-gram lookup + DFlash drafter (n_max 3, p_min 0.4)",
    ]
    launched = [json.loads(line) for line in (tmp_path / "servers.log").read_text().splitlines()]
    assert all(args[args.index("-m") + 1].endswith("target-F16.gguf") for args in launched)
    assert part["settings"]["target_gguf"] == "target.gguf requantized to F16"
    assert part["settings"]["draft_tokens"] == [1, 3] and part["costs"]["forward_steps"].keys() == {"1", "2", "4"}
    monkeypatch.setenv("STANDIN_DIFFER", "1")
    table = bench.llama_cpp_table({"llama_cpp": part})
    assert "a plain step 20.0 ms; a forward over k new tokens in plain steps: 1 tokens 1.25, 2 tokens 1.50" in table
    differing = bench_command._llama_cpp(args, drafter, _prompts(tokenizer), tokenizer, threads=1)
    assert "| **NO** (0 of the completions) |" in bench.llama_cpp_table({"llama_cpp": differing})


def test_a_differing_completion_is_reported(bin_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_DIFFER", "1")
    tokenizer = make_tokenizer()
    setups = [llama_cpp.dflash_setup(tmp_path / "d.gguf", 3, threads=1)]
    rows = llama_cpp.run_llama_cpp(bin_dir, tmp_path / "t.gguf", setups, _prompts(tokenizer), tokenizer, 8, 1)
    assert rows[1].identical_to_plain is False and rows[1].completions_identical == 0


def test_missing_server_and_a_server_that_exits(tmp_path):
    tokenizer = make_tokenizer()
    with pytest.raises(ValueError, match="No llama-server in"):
        llama_cpp.run_llama_cpp(tmp_path, tmp_path / "t.gguf", [], _prompts(tokenizer), tokenizer, 8, 1)
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(ValueError, match="exited with status 3 before it was ready"):
        llama_cpp.run_llama_cpp(tmp_path, tmp_path / "t.gguf", [], _prompts(tokenizer), tokenizer, 8, 1)
