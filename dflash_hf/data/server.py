"""Responses regenerated through a running inference server (`dflash-hf make-data --server URL`).

Token ids go in and come out: each prompt is encoded by the target's tokenizer (and chat template) here and sent as
ids; the server's greedy answer comes back as ids (never re-tokenized text), so every row holds exactly the served
model's tokens. Two APIs are spoken:

* llama.cpp's `llama-server`: `POST /completion` with `return_tokens` (found by its `GET /props`);
* an OpenAI-compatible completions server (vLLM, SGLang): `POST /v1/completions` with `return_token_ids`.

Before any row is made, [`ServerResponder.check`] compares the served model with the target: the vocabulary size
(when the server reports it) and a tokenization probe (`POST /tokenize`, both APIs). Many requests are in flight at
once (`concurrency`, all along a run: the next prompts go out while the first answers are written); the answers
keep their order. A response that stops short of `max_new_tokens` without one of the target's EOS ids (the server's
context was full, or it ended on a token the target does not end on) is refused: plain greedy decoding would have
gone on. Each answer must come whole within `timeout_s`; one far larger than `max_new_tokens` tokens can need is
refused, and so is a redirect (never followed: these servers never redirect). The requests run on daemon threads, so
Ctrl-C (or a failed request) returns at once instead of waiting for the others in flight.
"""

from __future__ import annotations

import collections
import http.client
import itertools
import json
import queue
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

# text whose tokens must be the same on both sides: code, whitespace runs, digits, non-ASCII, a chat turn
TOKENIZATION_PROBE = (
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 12345 café ✓ 你好\n\n\t"
)
API_CHOICES = ("auto", "llama.cpp", "openai")
REQUEST_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 86_400.0
# the longest answer: its fixed part (settings, timings, a list of models, a probe's tokens) and, per generated token,
# far more than its id and text take
ANSWER_BYTES = 1 << 20
ANSWER_BYTES_PER_TOKEN = 4096


REDIRECTS = (301, 302, 303, 307, 308)


class _Unredirected(urllib.request.HTTPRedirectHandler):
    """Follows no redirect: urllib then raises an `HTTPError` of the redirect's status."""

    def redirect_request(self, req, fp, code, msg, headers, newurl) -> None:
        return None


_OPENER = urllib.request.build_opener(_Unredirected)


class ServerError(ValueError):
    """The server cannot be reached, does not speak a known API, or serves another model than the target."""


class ServerResponder:
    """Greedy responses of a served model for batches of token-id prompts.

    Args:
        url: The server's base URL (`http://127.0.0.1:8080`); loopback and private hosts alike.
        tokenizer: The target's tokenizer (the probe is encoded with it).
        vocab_size: The target's vocabulary (embedding rows): the served model must have as many.
        max_new_tokens: Longest response.
        end_ids: The target's EOS ids: a response is cut after the first one.
        concurrency: Requests in flight at once (at least the server's slots, for batched decoding).
        api: `auto` (llama.cpp when `GET /props` answers, else OpenAI), `llama.cpp` or `openai`.
        model: The model name sent to an OpenAI-compatible server (default: the first of `GET /v1/models`).
        timeout_s: Longest wait for one whole answer, from sending the request to its last byte (keep
            `concurrency` near the server's slots, or queued requests wait for the others).
    """

    def __init__(
        self,
        url: str,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_new_tokens: int,
        end_ids: Sequence[int],
        concurrency: int = 16,
        api: str = "auto",
        model: str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        try:
            parsed = urllib.parse.urlparse(url)
            port_ok = parsed.port is None or parsed.port > 0
        except ValueError:  # a port that is not a number in 0..65535, a broken IPv6 address
            parsed, port_ok = urllib.parse.urlparse(""), False
        if (
            not port_ok
            or parsed.scheme not in ("http", "https")
            or not parsed.hostname
            or parsed.query
            or parsed.fragment
        ):
            raise ValueError(
                f"--server {url!r} is not an http(s) URL such as http://127.0.0.1:8080 (a host, an optional numeric "
                "port and path prefix, no query or fragment)."
            )
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"The server timeout (--server-timeout, `timeout_s`) must be > 0 and at most {MAX_TIMEOUT_S:g} s (a "
                f"day), got {timeout_s}."
            )
        if api not in API_CHOICES:
            raise ValueError(f"server api must be one of {API_CHOICES}, got {api!r}.")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}.")
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.max_new_tokens = int(max_new_tokens)
        self.end_ids = {int(i) for i in end_ids}
        self.concurrency = int(concurrency)
        self.api = api
        self.model = model
        self.timeout_s = float(timeout_s)

    # ------------------------------------------------------------------ HTTP
    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer to `GET path` (or `POST path` of `body`), whole within `timeout_s` (a server that trickles
        its answer is cut off too); a `ServerError` naming the problem and the fix. The exchange runs on a daemon
        thread, abandoned at the deadline."""
        deadline = time.monotonic() + self.timeout_s
        outcome: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

        def exchange() -> None:
            try:
                outcome.put((True, self._exchange(path, body, deadline)))
            except BaseException as err:  # noqa: BLE001 (handed to the waiting thread)
                outcome.put((False, err))

        threading.Thread(target=exchange, name="dflash-hf-server-exchange", daemon=True).start()
        while (left := deadline - time.monotonic()) > 0:
            try:  # short waits: a Ctrl-C is taken at once, however the platform wakes blocked waits
                answered, answer = outcome.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            if not answered:
                raise answer
            return answer
        raise self._stalled(path)

    def _stalled(self, path: str) -> ServerError:
        return ServerError(
            f"{self.url}{path} gave no answer within {self.timeout_s:g} s: the server is stalled or overloaded; "
            "restart it, or lower --concurrency to its slots (or --max-new-tokens), or raise --server-timeout."
        )

    def _exchange(self, path: str, body: dict[str, Any] | None, deadline: float) -> Any:
        """[`_request`]'s exchange; redirects are refused, never followed."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                return json.loads(self._read(response, path, deadline).decode("utf-8"))
        except ServerError:
            raise
        except urllib.error.HTTPError as err:
            if err.code in REDIRECTS:
                raise ServerError(
                    f"{self.url}{path} answered HTTP {err.code}, a redirect to {err.headers.get('Location')!r}: "
                    "llama-server, vLLM and SGLang never redirect, so it is not followed; point --server at the "
                    "inference server itself."
                ) from err
            detail = err.read(300).decode("utf-8", "replace")
            hint = " (pass the server's base URL, without /v1)" if err.code == 404 and self.url.endswith("/v1") else ""
            raise ServerError(f"{self.url}{path} answered HTTP {err.code}: {detail}{hint}") from err
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            reason = err.reason if isinstance(err, urllib.error.URLError) else err
            if isinstance(reason, TimeoutError):
                raise self._stalled(path) from err
            if isinstance(reason, ssl.SSLError):
                raise ServerError(
                    f"TLS with {self.url} failed ({reason}): for a plain HTTP server use an http:// URL."
                ) from err
            if isinstance(err, http.client.HTTPException) and not isinstance(err, OSError):
                raise ServerError(
                    f"{self.url}{path} sent a broken HTTP answer ({err!r}): the connection broke off or --server is "
                    "not an inference server; check it and rerun (finished rows are kept)."
                ) from err
            raise ServerError(f"Cannot reach the server at {self.url} ({err}): start it or fix --server.") from err
        except (ValueError, RecursionError) as err:
            raise ServerError(f"{self.url}{path} did not answer JSON ({err}).") from err

    def _read(self, response: http.client.HTTPResponse, path: str, deadline: float) -> bytes:
        """The body of `response`, read as it comes until `deadline`; a `ServerError` once it is longer than any
        answer for `max_new_tokens` tokens can be (`ANSWER_BYTES` + `ANSWER_BYTES_PER_TOKEN` per token)."""
        limit = ANSWER_BYTES + ANSWER_BYTES_PER_TOKEN * self.max_new_tokens
        chunks, size = [], 0
        while chunk := response.read1(1 << 16):
            size += len(chunk)
            if size > limit:
                raise ServerError(
                    f"{self.url}{path} sent an answer of more than {limit} bytes, far beyond what "
                    f"{self.max_new_tokens} new tokens need: --server is not a llama-server or OpenAI-compatible "
                    "server; fix it."
                )
            if time.monotonic() > deadline:  # the caller gave up: end the exchange
                raise self._stalled(path)
            chunks.append(chunk)
        if response.length:  # the connection closed before the announced length
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        return b"".join(chunks)

    def _probe_api(self) -> str:
        if self.api != "auto":
            return self.api
        try:
            props = self._request("/props")
        except ServerError:
            return "openai"
        return "llama.cpp" if isinstance(props, dict) else "openai"

    # ------------------------------------------------------------------ checks
    def check(self) -> dict[str, Any]:
        """Find the API and compare the served model with the target (vocabulary size, tokenization probe); returns
        what was found (`api`, `model`, `vocab_size`). A `ServerError` names the mismatch and the fix."""
        self.api = self._probe_api()
        models = self._request("/v1/models")
        entries = models.get("data") if isinstance(models, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ServerError(f"{self.url}/v1/models lists no model: start the server with the target's weights.")
        if not all(isinstance(e, dict) and isinstance(e.get("id"), str) for e in entries):
            raise ServerError(
                f"{self.url}/v1/models lists models without a string `id` ({json.dumps(entries)[:200]}): it is not "
                "a llama-server or OpenAI-compatible server; fix --server."
            )
        entry = entries[0] if self.model is None else next((e for e in entries if e["id"] == self.model), None)
        if entry is None:
            served = ", ".join(e["id"] for e in entries)
            raise ServerError(f"The server does not serve {self.model!r} (it serves {served}): fix --server-model.")
        self.model = entry["id"]
        meta = entry.get("meta")
        served_vocab = meta.get("n_vocab") if isinstance(meta, dict) else None
        if served_vocab is not None and type(served_vocab) is not int:
            raise ServerError(
                f"The served model {self.model!r} reports a vocabulary size of {served_vocab!r}, not a number: "
                "fix --server (a llama-server reports its GGUF's n_vocab)."
            )
        if served_vocab is not None and served_vocab != self.vocab_size:
            raise ServerError(
                f"The served model {self.model!r} has a vocabulary of {served_vocab} tokens, the target "
                f"{self.vocab_size}: serve the target's own weights (its GGUF for llama-server)."
            )
        expected = list(self.tokenizer(TOKENIZATION_PROBE, add_special_tokens=False)["input_ids"])
        body = {"content": TOKENIZATION_PROBE, "add_special": False, "parse_special": True}
        if self.api == "openai":
            body = {"model": self.model, "prompt": TOKENIZATION_PROBE, "add_special_tokens": False}
        answer = self._request("/tokenize", body)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        tokens = [t.get("id") if isinstance(t, dict) else t for t in tokens] if isinstance(tokens, list) else None
        if tokens is None or any(type(t) is not int for t in tokens) or tokens != expected:
            raise ServerError(
                f"The served model {self.model!r} tokenizes a probe text differently from the target's tokenizer "
                f"({tokens} vs {expected}): serve the target's own weights and tokenizer."
            )
        return {"api": self.api, "model": self.model, "vocab_size": served_vocab}

    def check_run(self, max_new_tokens: int, vocab_size: int) -> dict[str, Any]:
        """[`check`] for a make-data run of `max_new_tokens` with a target of `vocab_size`, after a `ValueError` when
        the responder was built for other values."""
        if (self.max_new_tokens, self.vocab_size) != (int(max_new_tokens), int(vocab_size)):
            raise ValueError(
                f"The server responder was built for max_new_tokens {self.max_new_tokens} and a vocabulary of "
                f"{self.vocab_size}, this run has {max_new_tokens} and the target {vocab_size}: build it with the "
                "run's values."
            )
        return self.check()

    # ------------------------------------------------------------------ generation
    def _complete(self, prompt_ids: list[int]) -> list[int]:
        if self.api == "llama.cpp":
            body = {
                "prompt": prompt_ids,
                "n_predict": self.max_new_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "samplers": ["top_k"],
                "return_tokens": True,
                "stream": False,
            }
            answer = self._request("/completion", body)
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
        else:
            body = {
                "model": self.model,
                "prompt": prompt_ids,
                "max_tokens": self.max_new_tokens,
                "temperature": 0.0,
                # stated, or vLLM/SGLang apply the model's generation_config defaults (Qwen2.5: repetition 1.1)
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "return_token_ids": True,
                "stream": False,
            }
            answer = self._request("/v1/completions", body)
            choices = answer.get("choices") if isinstance(answer, dict) else None
            first = choices[0] if isinstance(choices, list) and choices else None
            tokens = first.get("token_ids") if isinstance(first, dict) else None
        if not isinstance(tokens, list):
            raise ServerError(
                f"The {self.api} server at {self.url} returned no generated token ids (a server too old for "
                "`return_tokens` / `return_token_ids`): update it."
            )
        if any(type(t) is not int for t in tokens):  # bool is an int subclass: true/false are no token ids
            bad = next(t for t in tokens if type(t) is not int)
            raise ServerError(
                f"The {self.api} server at {self.url} returned token ids that are not integers ({bad!r}): it is not "
                "a llama-server or OpenAI-compatible server; fix --server."
            )
        if not tokens:  # greedy decoding of at least one token always gives one (an end-of-turn token at least)
            raise ServerError(
                f"The {self.api} server at {self.url} generated no token for a prompt of {len(prompt_ids)} tokens: "
                "its context is likely full; raise the server's context size or lower --max-prompt-tokens."
            )
        tokens = tokens[: self.max_new_tokens]
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise ServerError(f"The server returned token ids outside the target's vocabulary of {self.vocab_size}.")
        stop = next((i for i, t in enumerate(tokens) if t in self.end_ids), None)
        if stop is None and len(tokens) < self.max_new_tokens:
            raise ServerError(
                f"The {self.api} server at {self.url} stopped after {len(tokens)} of {self.max_new_tokens} tokens on "
                f"token {tokens[-1]}, which the target does not end on: its context per slot is too small (llama-server:"
                " -c SLOTS x (prompt + new tokens)) or it ends on other tokens than the target's EOS ids "
                f"{sorted(self.end_ids)}; fix the server (or the target's generation_config) and rerun."
            )
        return tokens if stop is None else tokens[: stop + 1]

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        """The greedy responses to `prompts` (token ids), in order (see [`responses`])."""
        return list(self.responses(prompts))

    def batches(self, batches: Iterable[list[list[int]]]) -> Iterator[list[list[int]]]:
        """The responses of each batch of prompts in turn (see [`responses`]): the batches are drawn as their requests
        go out, so the server stays busy across batches while the caller writes the first ones."""
        sizes: collections.deque[int] = collections.deque()

        def prompts() -> Iterator[list[int]]:
            for batch in batches:
                sizes.append(len(batch))
                yield from batch

        answers = self.responses(prompts())
        try:
            for first in answers:  # a batch's size is known once its first request has gone out
                yield [first, *itertools.islice(answers, sizes.popleft() - 1)]
        finally:
            answers.close()

    def responses(self, prompts: Iterable[list[int]]) -> Iterator[list[int]]:
        """The greedy responses to `prompts` (token ids, drawn as requests go out), yielded in order as soon as each
        is in, with up to `concurrency` requests in flight all along (a caller writing the first answers keeps the
        server busy).

        The requests run on daemon threads: the first failure (or Ctrl-C, or closing the iterator) stops them at
        once, no new request is sent after it, and the ones still in flight are abandoned (never waited for, also
        not at interpreter exit)."""
        results: dict[int, list[int]] = {}
        outcomes: queue.SimpleQueue[tuple[int, list[int] | BaseException]] = queue.SimpleQueue()
        pending = enumerate(prompts)
        lock, stop = threading.Lock(), threading.Event()
        drawn = [0, False]  # prompts drawn so far, and whether they have run out

        def work() -> None:
            while not stop.is_set():
                with lock:
                    try:
                        index, prompt = next(pending, (None, None))
                    except BaseException as err:  # noqa: BLE001 (drawing the prompt failed: the caller's error)
                        outcomes.put((-1, err))
                        return
                    if index is None:
                        drawn[1] = True
                        return
                    drawn[0] += 1
                try:
                    outcomes.put((index, self._complete(prompt)))
                except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
                    outcomes.put((index, err))

        for _ in range(self.concurrency):
            threading.Thread(target=work, name="dflash-hf-server-request", daemon=True).start()
        try:
            wanted = 0
            while True:
                while wanted not in results:
                    with lock:
                        if drawn[1] and wanted >= drawn[0]:
                            return
                    try:  # short waits: a Ctrl-C is taken at once, however the platform wakes blocked waits
                        index, outcome = outcomes.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    if isinstance(outcome, BaseException):
                        raise outcome
                    results[index] = outcome
                yield results.pop(wanted)
                wanted += 1
        finally:
            stop.set()
