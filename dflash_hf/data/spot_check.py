"""A spot check of served rows (`dflash-hf make-data --server URL --server-verify N`): the target, loaded here,
recomputes random rows and every response token must be its own greedy choice.

Past the vocabulary and tokenization probe ([`server.ServerResponder.check`]), a server's answers are taken as the
target's greedy answers; this check is what tests them. Each checked row takes one forward of the target over its
prompt and response: every response token must be the target's most likely token after the tokens before it (the
end-of-turn token too), or within `NEAR_TIE_NATS` of it, a near tie that a server's quantized weights or other kernels
may break the other way. Another model, other sampling settings, a made-up end of turn or an answer to another prompt
fail it.

What a check finds stays with the folder (`OUT/parts`): the ids of every row verified so far (`spot-checked.json`,
so that the manifest's `verified_rows` counts the rows verified over the whole folder, not one run's draws), and a
failed check's verdict (`spot-check-failed.json`): the folder's served rows can then no longer be vouched for, and
every later run into it refuses to resume or publish them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..fileio import atomic_write_text, read_json

NEAR_TIE_NATS = 2.0
VERIFIED_NAME = "spot-checked.json"
FAILED_NAME = "spot-check-failed.json"


def refuse_failed_folder(out: Path) -> None:
    """Raise a `ValueError` when a spot check of the make-data folder `out` failed: its served rows are never resumed
    or published."""
    failed = out / "parts" / FAILED_NAME
    if failed.exists():
        raise ValueError(
            f"A spot check of {out} found a served row that is not the target's answer ({failed}): none of the "
            "folder's served rows can be vouched for, so they are never resumed or published. Fix the server, delete "
            f"{out} and rerun make-data."
        )


def check_weights(target: PreTrainedModel) -> None:
    """Raise a `ValueError` when `target` has no weights to recompute rows with (a shell on the meta device)."""
    if any(parameter.device.type == "meta" for parameter in target.parameters()):
        raise ValueError(
            "The server's rows are checked with the target's weights, and this target has none (a shell on the "
            "meta device): load it with `targets.load_target`, or drop the spot check (--server-verify 0)."
        )


def spot_check(target: PreTrainedModel, rows: list[dict], count: int, folder: str) -> int:
    """Recompute `count` random rows of `rows` (make-data records: `id`, `input_ids`, `prompt_length`) of the folder
    `folder` with `target`, rows no earlier check verified first; returns how many of `rows` have been verified over
    the folder's runs. A `ValueError` names the first response token that is not the target's greedy choice (beyond a
    near tie) and the fix, and the folder is marked failed ([`refuse_failed_folder`])."""
    parts = Path(folder) / "parts"
    verified = _verified_ids(parts)
    fresh = [row for row in rows if row["id"] not in verified]
    checked = random.sample(fresh, min(count, len(fresh)))
    if len(checked) < count:
        seen = [row for row in rows if row["id"] in verified]
        checked += random.sample(seen, min(count - len(checked), len(seen)))
    for row in checked:
        problem = _first_wrong_token(target, row)
        if problem is not None:
            message = (
                f"The served response of row {row['id']!r} in {folder} is not the target's: {problem} The server "
                "answers as another model, with other settings or to other prompts: fix it, delete the folder and "
                "rerun."
            )
            atomic_write_text(parts / FAILED_NAME, json.dumps({"row": row["id"], "reason": message}, indent=1))
            raise ValueError(message)
        verified.add(row["id"])
    atomic_write_text(parts / VERIFIED_NAME, json.dumps(sorted(verified)))
    return sum(row["id"] in verified for row in rows)


def _verified_ids(parts: Path) -> set[str]:
    path = parts / VERIFIED_NAME
    if not path.is_file():
        return set()
    ids = read_json(path, f"delete {path}: the rows it lists are checked again.")
    if not isinstance(ids, list) or not all(isinstance(row_id, str) for row_id in ids):
        raise ValueError(f"{path} is no list of row ids: delete it (the rows it lists are checked again).")
    return set(ids)


@torch.no_grad()
def _first_wrong_token(target: PreTrainedModel, row: dict) -> str | None:
    """What is wrong with `row`'s response as the target's greedy answer, `None` when nothing is."""
    device = next(target.parameters()).device
    ids, start = row["input_ids"], row["prompt_length"]
    response = torch.tensor(ids[start:], device=device)
    logits = target(
        input_ids=torch.tensor([ids], device=device), logits_to_keep=len(response) + 1, use_cache=False
    ).logits[0, :-1]
    log_probs = logits.float().log_softmax(-1)
    best, choice = log_probs.max(-1)
    gaps = best - log_probs.gather(-1, response[:, None])[:, 0]
    far = (gaps > NEAR_TIE_NATS).nonzero()
    if not len(far):
        return None
    i = int(far[0])
    return (
        f"its token {i} is {int(response[i])}, {float(gaps[i]):.2f} nats less likely than the target's own choice "
        f"{int(choice[i])} (a near tie is up to {NEAR_TIE_NATS:g})."
    )
