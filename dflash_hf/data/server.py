"""Responses regenerated through a running inference server (`dflash-hf make-data --server URL`).

Token ids go in and come out: each prompt is encoded by the target's tokenizer (and chat template) here and sent as
ids; the server's greedy answer comes back as ids (never re-tokenized text), so every row holds exactly the served
model's tokens. Two APIs are spoken:

* llama.cpp's `llama-server`: `POST /completion` with `return_tokens` (found by its `GET /props`);
* an OpenAI-compatible completions server (vLLM, SGLang): `POST /v1/completions` with `return_token_ids`.

Before any row is made, [`ServerResponder.check`] compares the served model with the target: the vocabulary size
(when the server reports it) and a tokenization probe (`POST /tokenize`, both APIs). Many requests are in flight at
once (`concurrency`), one per prompt of a batch; the answers keep the batch's order.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers import PreTrainedTokenizerBase

# text whose tokens must be the same on both sides: code, whitespace runs, digits, non-ASCII, a chat turn
TOKENIZATION_PROBE = (
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 12345 café ✓ 你好\n\n\t"
)
API_CHOICES = ("auto", "llama.cpp", "openai")
REQUEST_TIMEOUT_S = 600.0


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
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--server {url!r} is not an http(s) URL such as http://127.0.0.1:8080.")
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

    # ------------------------------------------------------------------ HTTP
    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", "replace")[:300]
            raise ServerError(f"{self.url}{path} answered HTTP {err.code}: {detail}") from err
        except (urllib.error.URLError, OSError) as err:
            raise ServerError(f"Cannot reach the server at {self.url} ({err}): start it or fix --server.") from err
        except ValueError as err:
            raise ServerError(f"{self.url}{path} did not answer JSON ({err}).") from err

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
        if not entries:
            raise ServerError(f"{self.url}/v1/models lists no model: start the server with the target's weights.")
        entry = entries[0] if self.model is None else next((e for e in entries if e.get("id") == self.model), None)
        if entry is None:
            served = ", ".join(str(e.get("id")) for e in entries)
            raise ServerError(f"The server does not serve {self.model!r} (it serves {served}): fix --server-model.")
        self.model = str(entry.get("id"))
        served_vocab = (entry.get("meta") or {}).get("n_vocab")
        if served_vocab is not None and int(served_vocab) != self.vocab_size:
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
        tokens = [t["id"] if isinstance(t, dict) else t for t in tokens] if isinstance(tokens, list) else None
        if tokens != expected:
            raise ServerError(
                f"The served model {self.model!r} tokenizes a probe text differently from the target's tokenizer "
                f"({tokens} vs {expected}): serve the target's own weights and tokenizer."
            )
        return {"api": self.api, "model": self.model, "vocab_size": served_vocab}

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
                "return_token_ids": True,
                "stream": False,
            }
            answer = self._request("/v1/completions", body)
            choices = answer.get("choices") if isinstance(answer, dict) else None
            tokens = choices[0].get("token_ids") if choices and isinstance(choices[0], dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ServerError(
                f"The {self.api} server at {self.url} returned no generated token ids (a server too old for "
                "`return_tokens` / `return_token_ids`): update it."
            )
        tokens = tokens[: self.max_new_tokens]
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise ServerError(f"The server returned token ids outside the target's vocabulary of {self.vocab_size}.")
        stop = next((i for i, t in enumerate(tokens) if t in self.end_ids), None)
        return tokens if stop is None else tokens[: stop + 1]

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        """The greedy responses to `prompts` (token ids), in order, with up to `concurrency` requests in flight."""
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(prompts)))) as pool:
            return list(pool.map(self._complete, prompts))
