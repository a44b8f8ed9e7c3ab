"""llama.cpp next to dflash-hf in the bench: plain `llama-server` and `llama-server` with a DFlash drafter.

A CPU user serves with llama.cpp, so the bench can add its two rows to a report: the target's GGUF decoded greedily
by a plain server, and by a server drafting with the drafter exported as GGUF (`--spec-type draft-dflash`). Both get
the same chat-templated text of every bench prompt at temperature 0 through `/completion`; a row records tokens/s
(llama.cpp's own decode timing), llama.cpp's acceptance (accepted per drafted token), and whether every completion
equals the plain server's. The servers run on this machine (loopback only) and are stopped afterwards.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from .prompts import BenchPrompt

SERVER_BINARY = "llama-server"


@dataclass
class LlamaCppRow:
    """One llama.cpp server over the bench prompts."""

    label: str
    new_tokens: int
    seconds: float
    tokens_per_s: float | None
    drafted: int
    accepted: int
    acceptance: float | None  # accepted per drafted token
    identical_to_plain: bool | None  # the plain row: None
    speedup_vs_plain: float | None


def _post(url: str, payload: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_until_ready(url: str, seconds: float = 300.0, process: subprocess.Popen | None = None) -> None:
    """Wait until a `llama-server` at `url` answers `/health` with status ok (a `ValueError` when it does not, or when
    its `process` ends first)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ValueError(f"llama-server for {url} exited with status {process.returncode} before it was ready.")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if json.loads(response.read()).get("status") == "ok":
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise ValueError(f"llama-server at {url} was not ready within {seconds:.0f} s.")


def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Greedy `/completion` of `prompt`, without the prompt cache (so that both servers prefill alike)."""
    return _post(
        f"{url}/completion",
        {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False},
    )


def complete_openai(url: str, prompt: str, max_tokens: int) -> str:
    """Greedy completion text through the OpenAI-style `/v1/completions` endpoint."""
    reply = _post(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return reply["choices"][0]["text"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(
    binary_dir: Path, model: Path, threads: int, extra: Sequence[str] = (), log: Path | None = None
) -> Iterator[str]:
    """A `llama-server` on a free loopback port for the duration of the block; yields its URL."""
    binary = Path(binary_dir) / SERVER_BINARY
    if not binary.is_file():
        raise ValueError(f"No {SERVER_BINARY} in {binary_dir}: pass llama.cpp's build/bin folder to --llama-cpp.")
    port = _free_port()
    command = [str(binary), "-m", str(model), "-t", str(threads), "--host", "127.0.0.1", "--port", str(port), *extra]
    output = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process=process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        if log is not None:
            output.close()


def _serve_all(url: str, texts: list[str], max_tokens: int) -> tuple[list[dict[str, Any]], float, int, int, int]:
    replies = [complete(url, text, max_tokens) for text in texts]
    seconds = sum(r["timings"]["predicted_ms"] for r in replies) / 1000
    tokens = sum(int(r["timings"]["predicted_n"]) for r in replies)
    drafted = sum(int(r["timings"].get("draft_n", 0)) for r in replies)
    accepted = sum(int(r["timings"].get("draft_n_accepted", 0)) for r in replies)
    return replies, seconds, tokens, drafted, accepted


def run_llama_cpp(
    binary_dir: str | Path,
    target_gguf: str | Path,
    drafter_gguf: str | Path,
    prompts: Sequence[BenchPrompt],
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    draft_tokens: int,
    threads: int,
    log_dir: Path | None = None,
) -> list[LlamaCppRow]:
    """Greedy decoding of every prompt by plain llama.cpp and by llama.cpp drafting `draft_tokens` tokens per step
    with the DFlash drafter `drafter_gguf`; returns the plain row, then the speculative one."""
    texts = [tokenizer.decode(p.input_ids) for p in prompts]
    logs = (log_dir / "llama-server-plain.log", log_dir / "llama-server-dflash.log") if log_dir else (None, None)
    with server(Path(binary_dir), Path(target_gguf), threads, log=logs[0]) as url:
        complete(url, texts[0], min(8, max_new_tokens))  # warm-up, untimed
        plain, plain_s, plain_tokens, _, _ = _serve_all(url, texts, max_new_tokens)
    speculative_flags = [
        "-md", str(drafter_gguf), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_tokens),
        "-td", str(threads),
    ]  # fmt: skip
    with server(Path(binary_dir), Path(target_gguf), threads, speculative_flags, log=logs[1]) as url:
        complete(url, texts[0], min(8, max_new_tokens))
        spec, spec_s, spec_tokens, drafted, accepted = _serve_all(url, texts, max_new_tokens)
    plain_rate = plain_tokens / plain_s if plain_s > 0 else None
    spec_rate = spec_tokens / spec_s if spec_s > 0 else None
    return [
        LlamaCppRow("llama.cpp plain greedy", plain_tokens, plain_s, plain_rate, 0, 0, None, None, 1.0),
        LlamaCppRow(
            f"llama.cpp + DFlash drafter (n_max {draft_tokens})",
            spec_tokens,
            spec_s,
            spec_rate,
            drafted,
            accepted,
            accepted / drafted if drafted else None,
            all(s["content"] == p["content"] for s, p in zip(spec, plain)),
            spec_rate / plain_rate if spec_rate and plain_rate else None,
        ),
    ]


def rows_to_json(rows: Sequence[LlamaCppRow], settings: dict[str, Any]) -> dict[str, Any]:
    """The `llama_cpp` part of `bench.json`."""
    return {"settings": settings, "rows": [asdict(row) for row in rows]}
