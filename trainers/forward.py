"""The forward passes of one training batch, as functions of the drafter and the frozen target (read through its
`TargetAdapter`): the drafter over every block of the batch with the sparse block mask ([`draft_forward`]), the
target's LM head on the labelled slots, over the draft vocabulary where it is reduced ([`slot_logits`]), and the
target's own next-token distribution there, the teacher of distillation, total variation and `hard_labels="target"`
([`teacher_probs`])."""

from __future__ import annotations

import torch

from dflash_hf.target.adapter import TargetAdapter

from .masks import BlockBatch, block_attention_mask, flex_block_mask


def draft_forward(
    model: torch.nn.Module,
    adapter: TargetAdapter,
    context: torch.Tensor,
    blocks: BlockBatch,
    implementation: str,
    markov_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One drafter forward over every block of the batch after its context features `context` `(b, n, k * H)`, with
    the sparse block mask (a flex `BlockMask` for `implementation="flex_attention"`, else a dense boolean mask).

    Returns the final hidden states `(b, A, B, H)` and, with `markov_head` (the drafter has one: it reads each slot's
    true previous token), the head's correction of the logits `(b, A, B, V)`; else `None`.
    """
    with torch.no_grad():
        noise_embeds = adapter.embed(blocks.block_ids)
    masking = flex_block_mask if implementation == "flex_attention" else block_attention_mask
    mask = masking(blocks.anchors, blocks.anchor_valid, blocks.context_length, blocks.labels.shape[-1])
    output = model(
        noise_embeds=noise_embeds,
        context_hidden_states=context,
        position_ids=blocks.position_ids,
        attention_mask=mask,
        draft_block_size=blocks.labels.shape[-1],  # a DFlash 2 drafter convolves each block alone
        **({"previous_token_ids": blocks.previous_ids} if markov_head else {}),
    )
    shape = (*blocks.labels.shape, -1)
    return output.last_hidden_state.view(shape), output.markov_bias.view(shape) if markov_head else None


def selector_scores(
    selector: torch.nn.Module,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    previous: torch.Tensor,
    draft_token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A DFlash 2 selector's scores `(n, K)` of the `n` labelled slots' top-`K` candidates under their draft logits
    `logits` `(n, V)` (over the draft vocabulary `draft_token_ids` where reduced), given each slot's true previous
    token `previous` `(n,)` (teacher forcing) and final hidden state `hidden` `(n, H)`; and the candidates' indices
    into `logits`' last dimension `(n, K)`."""
    unary, index = logits.topk(selector.top_k, dim=-1)
    candidates = index if draft_token_ids is None else draft_token_ids[index]
    term = selector.transition_scores(hidden, candidates, previous[:, None])[:, 0]
    return unary + term.float(), index


def slot_logits(
    adapter: TargetAdapter,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    draft_token_ids: torch.Tensor | None = None,
    target_to_draft: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft logits `(n, V)` of the `n` labelled slots' hidden states `(n, H)` (the target's LM head with the drafter's
    multiplier and softcap, `TargetAdapter.draft_logits`), and their labels `(n,)`.

    With a reduced draft vocabulary (`draft_token_ids`, on `hidden`'s device) the logits are over it and the labels
    are mapped to draft ids by `target_to_draft` (on `labels`' device): a label outside it becomes `-100`, a slot that
    cannot be drafted and counts as a miss.
    """
    if draft_token_ids is None:
        return adapter.draft_logits(hidden), labels
    return adapter.draft_logits(hidden, draft_token_ids), target_to_draft[labels]


@torch.no_grad()
def teacher_probs(
    adapter: TargetAdapter,
    teacher: torch.Tensor,
    positions: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    draft_token_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target's own next-token distribution `(n, V)` for each of `n` labelled slots (their places `index` in
    `positions`, `(b, A, B)`; `LabelledSlots.index` or a chunk of it): its final hidden state (`teacher`,
    `(b, seq, H)`) one position earlier, through the frozen LM head, over the draft vocabulary `draft_token_ids` where
    reduced (renormalised there)."""
    source = (positions - 1).clamp_min(0)[index]  # slot at position p is predicted from the target at p - 1
    hidden = teacher[index[0], source].to(adapter.lm_head.weight.dtype)
    draft_ids = None if draft_token_ids is None else draft_token_ids.to(hidden.device)
    return adapter.logits(hidden, draft_ids).float().softmax(dim=-1)
