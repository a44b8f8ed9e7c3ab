"""llama.cpp next to dflash-hf in the bench: plain `llama-server` and `llama-server`s that speculate.

A CPU user serves with llama.cpp, so the bench can add llama.cpp's rows to a report: the target's GGUF decoded
greedily by a plain server, and by one server per speculative setup (the drafter exported as GGUF,
`--spec-type draft-dflash`, at each draft length asked for; optionally llama.cpp's own n-gram lookup alone and in
front of the drafter). Every server gets the same chat-templated text of every bench prompt at temperature 0 through
`/completion`; a row records tokens/s (llama.cpp's own decode timing), llama.cpp's acceptance (accepted per drafted
token), and how many completions equal the plain server's. With `llama-bench` beside `llama-server`, the target's
cost model comes too: a plain step and a forward over k tokens in plain steps. The servers run on this machine
(loopback only), one at a time, and are stopped afterwards.
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

from ..modeling import DFlashDraftModel
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
    completions_identical: int | None  # how many completions equal the plain server's (the plain row: None)
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


@dataclass(frozen=True)
class SpeculativeSetup:
    """One speculative `llama-server`: its row label and the flags it adds to the plain server's."""

    label: str
    flags: tuple[str, ...]


def dflash_setup(drafter_gguf: str | Path, draft_tokens: int, threads: int, p_min: float = 0.0) -> SpeculativeSetup:
    """llama.cpp drafting up to `draft_tokens` tokens per step with the DFlash drafter `drafter_gguf`; with `p_min`,
    the draft stops at the first token the drafter gives less probability (`--spec-draft-p-min`)."""
    flags = ["-md", str(drafter_gguf), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_tokens)]
    flags += ["-td", str(threads)]
    label = f"llama.cpp + DFlash drafter (n_max {draft_tokens}"
    if p_min > 0:
        flags += ["--spec-draft-p-min", f"{p_min:g}"]
        label += f", p_min {p_min:g}"
    return SpeculativeSetup(label + ")", tuple(flags))


def ngram_setup(draft_tokens: int, key_tokens: int = 3, drafter: SpeculativeSetup | None = None) -> SpeculativeSetup:
    """llama.cpp's own draftless speculation (`ngram-simple`: the `draft_tokens` tokens that followed the last
    occurrence of the last `key_tokens` tokens), alone or, given a DFlash `drafter` setup, in front of it (llama.cpp
    takes the n-gram draft where one is found and the drafter's elsewhere)."""
    ngram = ["--spec-ngram-simple-size-n", str(key_tokens), "--spec-ngram-simple-size-m", str(draft_tokens)]
    if drafter is None:
        flags = ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(draft_tokens), *ngram]
        return SpeculativeSetup(f"llama.cpp n-gram lookup (ngram-simple, n_max {draft_tokens})", tuple(flags))
    flags = list(drafter.flags)
    flags[flags.index("--spec-type") + 1] = "draft-dflash,ngram-simple"
    label = drafter.label.replace("llama.cpp + DFlash drafter", "llama.cpp + n-gram lookup + DFlash drafter")
    return SpeculativeSetup(label, tuple(flags + ngram))


def run_llama_cpp(
    binary_dir: str | Path,
    target_gguf: str | Path,
    setups: Sequence[SpeculativeSetup],
    prompts: Sequence[BenchPrompt],
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    threads: int,
    log_dir: Path | None = None,
) -> list[LlamaCppRow]:
    """Greedy decoding of every prompt by plain llama.cpp and by one `llama-server` per speculative setup, one server
    at a time; returns the plain row, then one row per setup."""
    texts = [tokenizer.decode(p.input_ids) for p in prompts]
    rows: list[LlamaCppRow] = []
    plain: list[dict[str, Any]] = []
    plain_rate: float | None = None
    for index, setup in enumerate([None, *setups]):
        log = log_dir / f"llama-server-{index}.log" if log_dir else None
        flags = () if setup is None else setup.flags
        with server(Path(binary_dir), Path(target_gguf), threads, flags, log=log) as url:
            complete(url, texts[0], min(8, max_new_tokens))  # warm-up, untimed
            replies, seconds, tokens, drafted, accepted = _serve_all(url, texts, max_new_tokens)
        rate = tokens / seconds if seconds > 0 else None
        if setup is None:
            plain, plain_rate = replies, rate
            rows.append(LlamaCppRow("llama.cpp plain greedy", tokens, seconds, rate, 0, 0, None, None, None, 1.0))
            continue
        same = sum(s["content"] == p["content"] for s, p in zip(replies, plain))
        rows.append(
            LlamaCppRow(
                setup.label,
                tokens,
                seconds,
                rate,
                drafted,
                accepted,
                accepted / drafted if drafted else None,
                same == len(plain),
                same,
                rate / plain_rate if rate and plain_rate else None,
            )
        )
    return rows


def _last_line(done: subprocess.CompletedProcess) -> str:
    """The last line a llama.cpp tool printed (its error message when it failed)."""
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else "no output"


def requantize(binary_dir: str | Path, gguf: str | Path, weight_type: str, out: str | Path) -> Path:
    """The target's GGUF with its weights in `weight_type` (`F16`, `Q8_0`, ...), written by llama.cpp's
    `llama-quantize --allow-requantize` (a `ValueError` with its last output line when it fails)."""
    binary = Path(binary_dir) / "llama-quantize"
    if not binary.is_file():
        raise ValueError(f"No llama-quantize in {binary_dir}: build llama.cpp's llama-quantize target to requantize.")
    command = [str(binary), "--allow-requantize", str(gguf), str(out), weight_type.upper()]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not Path(out).is_file():
        raise ValueError(f"llama-quantize could not write a {weight_type} GGUF: {_last_line(done)}")
    return Path(out)


def forward_costs(
    binary_dir: str | Path, target_gguf: str | Path, threads: int, depth: int, rows: Sequence[int]
) -> dict[str, Any] | None:
    """llama.cpp's cost model for the target: a plain decoding step (ms, `llama-bench -n`) and a forward over `k`
    new tokens at `depth` cached ones (`llama-bench -p k -d depth`) in plain steps, the price of verifying `k - 1`
    drafted tokens (a lower bound: llama-bench computes the LM head for the last row only, a verify for every
    row). `None` without a `llama-bench` in `binary_dir`."""
    binary = Path(binary_dir) / "llama-bench"
    if not binary.is_file():
        return None
    ks = ",".join(str(k) for k in sorted(set(rows)))
    command = [str(binary), "-m", str(target_gguf), "-t", str(threads), "-p", ks, "-n", "32", "-d", str(depth)]
    done = subprocess.run([*command, "-r", "3", "-o", "json"], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"llama-bench failed on {Path(target_gguf).name}: {_last_line(done)}")
    results = json.loads(done.stdout)
    step_ms = next(1000.0 / r["avg_ts"] for r in results if r["n_gen"] > 0)
    steps = {str(r["n_prompt"]): r["n_prompt"] * 1000.0 / r["avg_ts"] / step_ms for r in results if r["n_prompt"] > 0}
    return {"depth": depth, "step_ms": step_ms, "forward_steps": steps}


def rows_to_json(
    rows: Sequence[LlamaCppRow], settings: dict[str, Any], costs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `llama_cpp` part of `bench.json`: settings, rows and the target's forward costs."""
    return {"settings": settings, "rows": [asdict(row) for row in rows], "costs": costs}


def bench_part(
    binary_dir: str | Path,
    target: str,
    drafter: DFlashDraftModel,
    prompts: Sequence[BenchPrompt],
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    threads: int,
    *,
    requantize_to: str | None = None,
    draft_tokens: Sequence[int] | None = None,
    p_min: float = 0.0,
    ngram: bool = False,
    gguf_type: str = "f32",
) -> dict[str, Any]:
    """llama.cpp's part of a bench result (`bench.json`'s `llama_cpp`): its rows on `prompts` and the target's forward
    costs, with `drafter` exported as GGUF into a temporary folder against the GGUF llama.cpp serves (`target`'s, or
    the GGUF file `target` names; with `requantize_to`, requantized by llama-quantize). `draft_tokens`: one DFlash row
    per draft length (default: the drafter's block size - 1); `ngram`: also llama.cpp's n-gram lookup, alone and in
    front of the drafter."""
    import tempfile

    from ..hub.gguf import target_gguf_file, write_gguf

    draft_tokens = list(draft_tokens or [int(drafter.config.block_size) - 1])
    with tempfile.TemporaryDirectory(prefix="dflash-hf-llama-cpp-") as scratch, target_gguf_file(target) as gguf:
        served = Path(gguf)
        if requantize_to:
            served = requantize(binary_dir, gguf, requantize_to, Path(scratch) / f"target-{requantize_to}.gguf")
        drafter_gguf = write_gguf(drafter, Path(scratch) / "drafter.gguf", target=served, gguf_type=gguf_type)
        dflash = [dflash_setup(drafter_gguf, n, threads, p_min) for n in draft_tokens]
        setups = list(dflash)
        if ngram:
            setups += [ngram_setup(max(draft_tokens))]
            setups += [ngram_setup(n, drafter=setup) for n, setup in zip(draft_tokens, dflash)]
        rows = run_llama_cpp(binary_dir, served, setups, prompts, tokenizer, max_new_tokens, threads)
        depth = round(sum(len(p.input_ids) for p in prompts) / len(prompts) + max_new_tokens / 2)
        costs = forward_costs(binary_dir, served, threads, depth, [1, 2, *(n + 1 for n in draft_tokens)])
    settings = {
        "binary_dir": str(binary_dir),
        "target_gguf": Path(gguf).name + (f" requantized to {requantize_to}" if requantize_to else ""),
        "gguf_type": gguf_type,
        "draft_tokens": draft_tokens,
        "p_min": p_min,
        "threads": threads,
    }
    return rows_to_json(rows, settings, costs)
