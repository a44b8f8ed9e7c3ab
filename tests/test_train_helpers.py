"""Helpers shared by the training/data tests (no tests here): a tiny offline tokenizer and tiny data."""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.digits + " .,!?:;'()-_+=*/<>#@\"")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '#' + m['content'] }}{% endfor %}{% if add_generation_prompt %}{{ '>' }}{% endif %}"
)
PROMPTS = [
    "hello world",
    "write a poem about cats",
    "what is two plus two?",
    "explain gravity briefly",
    "list three colors",
    "how do birds fly",
]


def make_tokenizer(vocab_size: int = 64, chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `vocab_size` ids (0 pad, 1 bos, 2 eos, 3 unk), built offline."""
    symbols = (SPECIALS + CHARS)[:vocab_size]
    vocab = {tok: i for i, tok in enumerate(symbols)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def write_prompts(path: Path, prompts=PROMPTS, extra: list[dict] | None = None) -> Path:
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(prompts)] + list(extra or [])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
