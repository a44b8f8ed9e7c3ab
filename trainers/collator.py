"""`DFlashDataCollator`: batches of `make-data` rows (and their cached target features) for `DFlashTrainer`."""

from __future__ import annotations

from typing import Any

import torch

from dflash_hf.data.batching import pad
from dflash_hf.special_tokens import first_token_id


class DFlashDataCollator:
    """Right-pads `input_ids`/`loss_mask` (and offline `context_hidden_states` / `target_final_hidden`), truncates to `max_length`."""

    def __init__(self, pad_token_id: int = 0, max_length: int | None = None) -> None:
        self.pad_token_id = int(pad_token_id)
        self.max_length = max_length

    @classmethod
    def for_tokenizer(cls, tokenizer, max_length: int | None = None) -> DFlashDataCollator:
        """The collator of a target's tokenizer: padding with its pad id (else its EOS id, else 0)."""
        pad_id = first_token_id(getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
        return cls(pad_token_id=pad_id or 0, max_length=max_length)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("Empty batch.")
        for key in ("input_ids", "loss_mask"):
            if key not in features[0]:
                raise ValueError(
                    f"Training rows need `input_ids` and `loss_mask` (got columns {sorted(features[0])}); make the "
                    "dataset with `dflash-hf make-data`."
                )
        ids = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        masks = [torch.as_tensor(f["loss_mask"], dtype=torch.long) for f in features]
        if self.max_length is not None:
            ids = [t[: self.max_length] for t in ids]
            masks = [t[: self.max_length] for t in masks]
        for t, m in zip(ids, masks):
            if t.shape != m.shape:
                raise ValueError(f"input_ids ({t.numel()}) and loss_mask ({m.numel()}) lengths differ in a row.")
        batch = {
            "input_ids": pad(ids, self.pad_token_id),
            "loss_mask": pad(masks, 0),
            "attention_mask": pad([torch.ones_like(t) for t in ids], 0),
        }
        for key in ("context_hidden_states", "target_final_hidden"):
            if key in features[0]:
                batch[key] = _pad_cached(key, [torch.as_tensor(f[key]) for f in features], ids)
        return batch


def _pad_cached(key: str, hidden: list[torch.Tensor], ids: list[torch.Tensor]) -> torch.Tensor:
    """Right-pad per-token cached features `(n_i, width)` of each row to `(batch, longest row, width)`."""
    for row, h in enumerate(hidden):
        if h.shape[0] < ids[row].numel():
            raise ValueError(
                f"Cached `{key}` covers {h.shape[0]} tokens but the row has {ids[row].numel()}: the features were "
                "cached with a smaller max length; rerun `dflash-hf cache-features` with --max-length >= the "
                "training max_length."
            )
    return pad([h[: row_ids.numel()] for h, row_ids in zip(hidden, ids)], 0)
