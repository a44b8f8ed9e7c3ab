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


def make_tiny_target(family: str = "llama", seed: int = 0, vocab_size: int = 64):
    """A tiny random target (hidden 64, 6 layers) of a supported family, built offline (see `conftest.make_target`)."""
    from conftest import make_target

    return make_target(family, seed=seed, vocab_size=vocab_size)


def one_thread():
    """Context manager: torch on one thread (tiny models run ~10x faster than on 2 contended threads)."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def manager():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return manager()


def tiny_train_config(output_dir, **overrides):
    """`DFlashTrainingConfig` of a tiny CPU run (B=4, 2 draft layers, 2 taps, 8 anchors), with `overrides`."""
    from dflash_hf.trainers import DFlashTrainingConfig

    base = dict(
        output_dir=str(output_dir),
        block_size=4,
        num_anchors=8,
        num_draft_layers=2,
        num_target_features=2,
        per_device_train_batch_size=3,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    base.update(overrides)
    return DFlashTrainingConfig(**base)
