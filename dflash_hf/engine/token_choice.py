"""Token choice of one generation call: the first token, the drafted slots and the target's verdict on them.

Greedy decoding takes the processed argmax; sampling draws from the processed distribution, and drafted slots are
either each slot's argmax (a point-mass proposal) or a draw from the slot's own distribution (`sampling_proposal`).
With a Markov head the slots are drafted one after another, each corrected for the token drafted before it; a DFlash
2 drafter's candidate selector walks each slot's top candidates from the anchor the same way.
Verification accepts the longest prefix equal to the target's argmax, or rejection-samples (`acceptance`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .acceptance import greedy_accept, rejection_sample, sample
from .draft_tree import SlotCandidates, corrected_logits
from .processing import BlockLogitsProcessor

Drafts = tuple[torch.LongTensor, torch.Tensor | None]
"""Drafted tokens `(batch, slots)` and the distributions they were sampled from `(batch, slots, vocab)` (`None`:
argmaxes)."""


def finite_slots(draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logits, finite)`: a slot with non-finite logits (a diverged or overflowing drafter) gets zero logits, so that
    drafting stays well-defined; `finite` `(batch, slots)` says which slots kept theirs."""
    finite = torch.isfinite(draft_logits).all(dim=-1)
    return torch.where(finite[..., None], draft_logits, torch.zeros_like(draft_logits)), finite


class TokenChoice:
    """How one call turns logits into tokens.

    Args:
        process: The call's logits processors, applied per row and drafted token.
        do_sample: Whether the call samples.
        sample_slots: Whether drafted slots are sampled (`sampling_proposal="sample"` with sampling).
        vocab_size: The target's vocabulary size.
        draft_token_ids: Target ids of a reduced draft vocabulary, or `None`.
        markov_head: The drafter's Markov head, or `None`.
        sequence: A row's tokens so far (prefix-dependent processors read them).
        selector: A DFlash 2 drafter's candidate selector, or `None`.
        temperature: The call's sampling temperature (a selector samples its candidates at it).
    """

    def __init__(
        self,
        process: BlockLogitsProcessor,
        do_sample: bool,
        sample_slots: bool,
        vocab_size: int,
        draft_token_ids: torch.LongTensor | None,
        markov_head: torch.nn.Module | None,
        sequence: Callable[[int], torch.LongTensor],
        selector: torch.nn.Module | None = None,
        temperature: float = 1.0,
    ) -> None:
        self.process, self.do_sample, self.sample_slots = process, do_sample, sample_slots
        self.vocab_size, self.draft_token_ids, self.markov_head = vocab_size, draft_token_ids, markov_head
        self.sequence, self.selector, self.temperature = sequence, selector, float(temperature)

    @property
    def drafts_in_order(self) -> bool:
        """Whether each slot's draft depends on the one before it (a Markov head or a candidate selector): the
        slots' final hidden states and the anchors are then needed ([`propose`])."""
        return self.markov_head is not None or self.selector is not None

    def first(self, logits: torch.Tensor, rows: list[int]) -> torch.LongTensor:
        """The token every row gets from the prefill's last logits (processed, then argmax or sampled)."""
        scores = self.process(logits[:, None, :], rows, lambda: [self.sequence(row) for row in rows])[:, 0]
        if self.do_sample:
            return sample(torch.softmax(scores, dim=-1))
        return scores.argmax(dim=-1)

    def propose(
        self,
        draft_logits: torch.Tensor,
        rows: list[int],
        markov_inputs: tuple[torch.LongTensor, torch.Tensor] | None = None,
    ) -> Drafts:
        """Draft tokens (and their proposal distributions when sampling) from per-slot drafter logits.

        When sampling with the `argmax` proposal the drafted tokens are the processed argmax and the proposal
        distribution is a point mass on them: the rejection sampler then accepts `d` with probability `p(d)` and on
        rejection samples from `p` with `d` removed, which is exactly the target's distribution.

        `markov_inputs` `(anchors, slot hidden states)`: the drafter has a Markov head or a candidate selector, so
        the slots are drafted one after another ([`draft_chain`], [`draft_selected`]).

        A slot with non-finite logits (a diverged or overflowing drafter) proposes nothing: its logits are zeroed so
        that drafting stays well-defined, and (sampling) its proposal distribution is zero, which `rejection_sample`
        always rejects; greedy verification keeps only drafts equal to the target's tokens anyway.
        """
        draft_logits, finite = finite_slots(draft_logits)
        if markov_inputs is None:
            tokens, probs = self.draft_tokens(draft_logits, rows)
        elif self.selector is not None:
            tokens, probs = self.draft_selected(draft_logits, *markov_inputs)
        else:
            tokens, probs = self.draft_chain(draft_logits, rows, *markov_inputs)
        if self.do_sample and probs is None:
            probs = torch.nn.functional.one_hot(tokens, self.vocab_size).to(torch.float32)
        if self.do_sample:
            probs = probs * finite[..., None]
        return tokens, probs

    def draft_chain(
        self, draft_logits: torch.Tensor, rows: list[int], anchors: torch.LongTensor, hidden_states: torch.Tensor
    ) -> Drafts:
        """Slots drafted in order through the drafter's Markov head: slot `k`'s logits plus the head's correction for
        the token drafted at slot `k - 1` (the anchor for slot 1), then chosen like any slot's ([`draft_tokens`]).

        Greedy: each slot's argmax given the argmax before it. Sampling: each slot is drawn from its corrected
        distribution given the token drawn before it, and those exact conditional distributions are the proposal
        distributions returned, which keeps rejection sampling exact.
        """
        tokens, probs = draft_logits.new_empty(draft_logits.shape[:2], dtype=torch.long), []
        previous = anchors
        for slot in range(draft_logits.shape[1]):
            slot_logits, slot_hidden = draft_logits[:, slot : slot + 1], hidden_states[:, slot : slot + 1]
            corrected = corrected_logits(self.markov_head, slot_logits, previous[:, None], slot_hidden)
            token, prob = self.draft_tokens(corrected, rows, drafted=tokens[:, :slot])
            tokens[:, slot] = previous = token[:, 0]
            probs.append(prob)
        return tokens, None if probs[0] is None else torch.cat(probs, dim=1)

    def draft_selected(
        self, draft_logits: torch.Tensor, anchors: torch.LongTensor, hidden_states: torch.Tensor
    ) -> Drafts:
        """DFlash 2: each slot's token among its top `selector_top_k` draft logits, walking from the anchor with the
        selector's term for the token chosen before it. The `(slots, K, K)` lattice of those terms is scored at once
        and the walk only gathers from it, on the device.

        Greedy (and the `argmax` proposal): each slot's best candidate given the one before. Sampling: each slot's
        candidate drawn from `q = softmax(scores / temperature)` over its `K` candidates, and `q` spread onto their
        ids is the proposal distribution rejection sampling reads. The call's logits processors are not applied to
        the drafts (any proposal keeps the output exact); they shape the target's distribution as always.
        """
        unary, index = draft_logits.float().topk(self.selector.top_k, dim=-1)
        candidates = index if self.draft_token_ids is None else self.draft_token_ids[index]
        lattice = self.selector.lattice(hidden_states, candidates, anchors).float()
        batch, slots, width = unary.shape
        chosen = torch.zeros(batch, 1, 1, dtype=torch.long, device=unary.device)  # slot 1: every row is the anchor
        picks, probs = [], []
        for slot in range(slots):
            scores = unary[:, slot] + lattice[:, slot].gather(1, chosen.expand(-1, 1, width))[:, 0]
            if self.sample_slots:
                q = torch.softmax(scores / self.temperature, dim=-1)
                pick = sample(q)
                probs.append(q.new_zeros(batch, self.vocab_size).scatter_(-1, candidates[:, slot], q))
            else:
                pick = scores.argmax(dim=-1)
            picks.append(pick)
            chosen = pick[:, None, None]
        tokens = candidates.gather(-1, torch.stack(picks, dim=1)[..., None])[..., 0]
        return tokens, torch.stack(probs, dim=1) if probs else None

    def draft_tokens(
        self, draft_logits: torch.Tensor, rows: list[int], drafted: torch.LongTensor | None = None
    ) -> Drafts:
        """The drafted tokens, and the per-slot distributions they were sampled from (`None` when they are argmaxes).

        With a reduced draft vocabulary, an argmax without processors maps back to target ids directly; otherwise the
        logits are spread over the full vocabulary (-inf outside the draft vocabulary) so that processors and the
        rejection sampler see ordinary distributions. `drafted`: tokens drafted before these slots, which
        prefix-dependent processors see after the row's sequence.
        """
        if self.draft_token_ids is not None:
            if self.process.is_identity and not self.sample_slots:
                return self.draft_token_ids[draft_logits.argmax(dim=-1)], None
            draft_logits = self._full_vocabulary(draft_logits)
        if self.process.is_identity or self.process.prefix_free:
            scores = self.process(draft_logits, rows, lambda: [])
            if not self.sample_slots:
                return scores.argmax(dim=-1), None
            probs = torch.softmax(scores, dim=-1)
            return sample(probs), probs
        return self._draft_in_order(draft_logits, rows, drafted)

    def _draft_in_order(self, draft_logits: torch.Tensor, rows: list[int], drafted: torch.LongTensor | None) -> Drafts:
        """Prefix-dependent processors: slot `j`'s scores depend on the tokens drafted before it, row by row."""
        batch, slots, _ = draft_logits.shape
        tokens = torch.empty(batch, slots, dtype=torch.long, device=draft_logits.device)
        probs = torch.empty_like(draft_logits) if self.sample_slots else None
        drafted = tokens[:, :0] if drafted is None else drafted
        for i, row in enumerate(rows):
            sequence = self.sequence(row)
            for slot in range(slots):
                prefix = torch.cat([sequence, drafted[i], tokens[i, :slot]])
                scores = self.process.for_row(row, prefix[None], draft_logits[i, slot][None])[0]
                if self.sample_slots:
                    probs[i, slot] = torch.softmax(scores, dim=-1)
                    tokens[i, slot] = sample(probs[i, slot])
                else:
                    tokens[i, slot] = scores.argmax()
        return tokens, probs

    def _full_vocabulary(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the reduced draft vocabulary spread over the target's (-inf outside the draft vocabulary)."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_token_ids, draft_logits)

    def slot_candidates(
        self, draft_logits: torch.Tensor, hidden_states: torch.Tensor, anchors: torch.LongTensor
    ) -> SlotCandidates:
        """The children of the draft trees' nodes (the trees rooted at `anchors`): each slot's top tokens under the
        processed distribution the chain drafts its argmax from ([`draft_tokens`]), through the Markov head when the
        drafter has one."""
        reduced = self.draft_token_ids is not None and self.process.is_identity

        def probabilities(logits: torch.Tensor) -> torch.Tensor:
            if self.draft_token_ids is not None and not reduced:
                logits = self._full_vocabulary(logits)
            return torch.softmax(self.process(logits[:, None], [], lambda: [])[:, 0], dim=-1)

        token_ids = self.draft_token_ids if reduced else None
        return SlotCandidates(draft_logits, probabilities, token_ids, self.markov_head, hidden_states, anchors=anchors)

    def accept(
        self,
        target_logits: torch.Tensor,
        block_tokens: torch.LongTensor,
        draft_tokens: torch.LongTensor,
        draft_probs: torch.Tensor | None,
        rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepted drafts of a chain and the target's next token per row (greedy prefix match, or rejection
        sampling); `block_tokens` is `[anchor, drafts]`."""

        def prefixes() -> list[torch.LongTensor]:
            return [torch.cat([self.sequence(row), block_tokens[i, 1:]]) for i, row in enumerate(rows)]

        scores = self.process(target_logits, rows, prefixes)
        if self.do_sample:
            return rejection_sample(draft_tokens, draft_probs, torch.softmax(scores, dim=-1))
        return greedy_accept(draft_tokens, scores.argmax(dim=-1))

    def node_tokens(self, target_logits: torch.Tensor, rows: list[int]) -> torch.LongTensor:
        """The target's (processed) argmax at every node of a tree verify (trees are verified greedily, with
        processors that score every node alone)."""
        return self.process(target_logits, rows, lambda: []).argmax(dim=-1)
