"""The prompts a make-data run still has to answer: encoded lazily in source order (those already made, too long or,
for teacher-forced data, without a reply are skipped and counted) and cut into length-sorted batches, window by window."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from transformers import PreTrainedTokenizerBase

from .prompts import Prompt, encode_prompt

Chunk = list[tuple[Prompt, list[int]]]
"""The `(prompt, prompt ids)` pairs of one part."""


def encoded_prompts(
    prompts: list[Prompt],
    done_ids: set[str],
    tokenizer: PreTrainedTokenizerBase,
    use_chat_template: bool,
    max_prompt_tokens: int,
    skipped: dict[str, int],
    need_reply: bool = False,
) -> Iterator[tuple[Prompt, list[int]]]:
    """The prompts not done yet with their token ids; longer prompts are skipped and counted in `skipped["long"]`,
    with `need_reply` prompts without a source reply in `skipped["no_reply"]`."""
    for prompt in prompts:
        if prompt.id in done_ids:
            continue
        if need_reply and prompt.reply is None:
            skipped["no_reply"] += 1
            continue
        ids = encode_prompt(tokenizer, prompt.text, use_chat_template, prompt.history)
        if len(ids) > max_prompt_tokens:
            skipped["long"] += 1
            continue
        yield prompt, ids


def nonempty(encoded: Iterator[tuple[Prompt, list[int]]]) -> Iterator[tuple[Prompt, list[int]]] | None:
    """`encoded` unchanged when it holds a prompt, else `None` (its skipped prompts counted)."""
    first = next(encoded, None)
    return None if first is None else itertools.chain([first], encoded)


def length_sorted_chunks(window: Chunk, batch_size: int, wanted: int) -> list[Chunk]:
    """The `wanted` shortest prompts of `window` in batches of `batch_size` (length-sorted batches waste less
    padding)."""
    window = sorted(window, key=lambda item: len(item[1]))[:wanted]
    return [window[start : start + batch_size] for start in range(0, len(window), batch_size)]


def planned_chunks(encoded: Iterable[tuple[Prompt, list[int]]], batch_size: int, wanted: int) -> Iterator[Chunk]:
    """The batches of a run, drawn lazily: windows of `8 * batch_size` prompts, each cut into [`length_sorted_chunks`],
    until `wanted` prompts are planned or the prompts run out."""
    encoded = iter(encoded)
    while wanted > 0:
        window = list(itertools.islice(encoded, batch_size * 8))
        if not window:
            return
        for chunk in length_sorted_chunks(window, batch_size, wanted):
            wanted -= len(chunk)
            yield chunk
