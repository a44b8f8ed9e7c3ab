"""A spot check of served rows (`dflash-hf make-data --server URL --server-verify N`): the target, loaded here,
recomputes random rows and every response token must be its own greedy choice.

Past the vocabulary and tokenization probe ([`server.ServerResponder.check`]), a server's answers are taken as the
target's greedy answers; this check is what tests them. Each checked row takes one forward of the target over its
prompt and response: every response token must be the target's most likely token after the tokens before it (the
end-of-turn token too), or within `NEAR_TIE_NATS` of it, a near tie that a server's quantized weights or other kernels
may break the other way. Another model, other sampling settings, a made-up end of turn or an answer to another prompt
fail it.
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel

NEAR_TIE_NATS = 2.0


def check_weights(target: PreTrainedModel) -> None:
    """Raise a `ValueError` when `target` has no weights to recompute rows with (a shell on the meta device)."""
    if any(parameter.device.type == "meta" for parameter in target.parameters()):
        raise ValueError(
            "The server's rows are checked with the target's weights, and this target has none (a shell on the "
            "meta device): load it with `targets.load_target`, or drop the spot check (--server-verify 0)."
        )


@torch.no_grad()
def spot_check(target: PreTrainedModel, rows: list[dict], count: int, folder: str) -> int:
    """Recompute `count` random rows of `rows` (make-data records: `id`, `input_ids`, `prompt_length`) of the folder
    `folder` with `target`; returns how many were checked. A `ValueError` names the first response token that is not
    the target's greedy choice (beyond a near tie) and the fix."""
    device = next(target.parameters()).device
    checked = random.sample(rows, min(count, len(rows)))
    for row in checked:
        ids, start = row["input_ids"], row["prompt_length"]
        response = torch.tensor(ids[start:], device=device)
        logits = target(
            input_ids=torch.tensor([ids], device=device), logits_to_keep=len(response) + 1, use_cache=False
        ).logits[0, :-1]
        log_probs = logits.float().log_softmax(-1)
        best, choice = log_probs.max(-1)
        gaps = best - log_probs.gather(-1, response[:, None])[:, 0]
        far = (gaps > NEAR_TIE_NATS).nonzero()
        if len(far):
            i = int(far[0])
            raise ValueError(
                f"The served response of row {row['id']!r} in {folder} is not the target's: its token {i} is "
                f"{int(response[i])}, {float(gaps[i]):.2f} nats less likely than the target's own choice "
                f"{int(choice[i])} (a near tie is up to {NEAR_TIE_NATS:g}). The server answers as another model, "
                "with other settings or to other prompts: fix it, delete the folder and rerun."
            )
    return len(checked)
