"""Token ids: lists of them from the shapes configs and tokenizers give them in (an id, a list of ids, a tensor or
`None`), and the fallbacks for EOS and padding that make a model's generation config usable."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def token_ids(*values: int | list[int] | tuple[int, ...] | torch.Tensor | None) -> list[int]:
    """Every distinct token id among `values` (each an id, a list of ids, a tensor of any shape or `None`), in
    order."""
    ids: list[int] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            value = value.reshape(-1).tolist()
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def first_token_id(*values: int | list[int] | tuple[int, ...] | torch.Tensor | None) -> int | None:
    """The first token id among `values` (the pad-id fallback chain: pad token, else EOS), or `None`."""
    ids = token_ids(*values)
    return ids[0] if ids else None


def configure_generation(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make `model.generation_config` usable as is: every EOS id the model or tokenizer declares, and a pad id.

    The pad id is the tokenizer's pad token, else the first EOS id; the tokenizer gets the same pad token.
    """
    generation_config = model.generation_config
    text = model.config.get_text_config(decoder=True)  # a multimodal wrapper's ids live in its text config
    eos_ids = token_ids(generation_config.eos_token_id, getattr(text, "eos_token_id", None), tokenizer.eos_token_id)
    if eos_ids:
        generation_config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad_id = first_token_id(tokenizer.pad_token_id, generation_config.pad_token_id, eos_ids)
    if pad_id is not None:
        generation_config.pad_token_id = int(pad_id)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(pad_id))
    if generation_config.bos_token_id is None and tokenizer.bos_token_id is not None:
        generation_config.bos_token_id = int(tokenizer.bos_token_id)
