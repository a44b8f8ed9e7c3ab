"""One DFlash generation call: its state (sequences, both KV caches, statistics) and the steps of its loop.

[`GenerationCall`] runs prefill, then draft / re-align / verify / commit cycles until every row has stopped
(docs/design.md, "The inference cycle"); `dflash_hf.engine.generation` holds the public entry points around it.
The steps are methods of one class because they all read and edit the same call state (sequences, caches, active
rows, statistics). The pure parts live next to it: option checks (`checks`), acceptance rules (`acceptance`), cache
edits (`cache_ops`), block-size policies (`block_size`), tree verification (`tree`) and the draft tree's search
(`draft_tree`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..modeling import DFlashDraftModel
from ..runtime import Stopwatch
from ..special_tokens import first_token_id
from ..target import row_exact
from ..target.adapter import TargetAdapter
from ..target.grouped_attention import grouped_attention
from ..target.windows import sliding_window_of
from .acceptance import DEFAULT_SAMPLING_PROPOSAL, greedy_accept, rejection_sample
from .block_size import BlockSizePolicy, make_block_size_policy
from .cache_ops import keep_path, select_rows, shift_cache_right, shift_right, truncate_cache
from .checks import check_drafter, check_options
from .draft_tree import DraftTree, DraftTreeSearch, SlotCandidates, corrected_logits, pack_trees
from .output import DFlashGenerateOutput
from .processing import BlockLogitsProcessor
from .tree import (
    DEFAULT_CANDIDATES,
    LookupBranchChoice,
    accept_tree,
    ancestor_mask,
    lookup_branch_length,
    lookup_continuation,
    path_order,
    tree_accept,
    tree_attention_mask,
    tree_layout,
    tree_path,
    verify_width,
)


def _plain_stop_token_ids(stopping_criteria: StoppingCriteriaList) -> set[int] | None:
    """EOS ids when the criteria are only max-length and EOS (then a run is checked in one pass), else `None`."""
    stop_ids: set[int] = set()
    for criterion in stopping_criteria:
        if isinstance(criterion, EosTokenCriteria):
            stop_ids.update(int(t) for t in torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
        elif not isinstance(criterion, MaxLengthCriteria):
            return None
    return stop_ids


def _mask_or_none(mask: torch.Tensor, block: int = 0) -> torch.Tensor | None:
    """`mask` extended by `block` attended positions, or `None` when nothing is padded (unmasked fast path)."""
    if bool(mask.all()):
        return None
    return torch.cat([mask, mask.new_ones(mask.shape[0], block)], dim=1) if block else mask


def _finite_slots(draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logits, finite)`: a slot with non-finite logits (a diverged or overflowing drafter) gets zero logits, so that
    drafting stays well-defined; `finite` `(batch, slots)` says which slots kept theirs."""
    finite = torch.isfinite(draft_logits).all(dim=-1)
    return torch.where(finite[..., None], draft_logits, torch.zeros_like(draft_logits)), finite


class _Cycle(NamedTuple):
    """What one cycle committed and verified, for the policies that learn from it."""

    kept: list[int]  # tokens committed per row
    block_kept: list[int]  # what the DFlash block alone would have committed per row (the block-size policy's lesson)
    width: int  # tokens verified per row
    lookup_choice: bool | None  # with a lookup continuation in a two-branch cycle: whether the tree was verified


def _row_exact_verification(target: PreTrainedModel, max_block: int) -> bool:
    """Whether verify forwards must run row-exact (a bf16/fp16 target on CPU, see `row_exact`); warns once if that
    cannot be made bit-exact on this machine."""
    exact = row_exact.install_if_needed(target, max_block)
    if exact is False:
        warnings.warn(
            f"Verifying {max_block}-token blocks in {str(target.dtype).replace('torch.', '')} on this CPU does not "
            "give every token the bits a one-token step gives it, so greedy outputs may drift from plain greedy "
            "decoding: load the target in float32 for exact outputs (or use `sdpa` attention, which dflash-hf can "
            "make row-exact).",
            stacklevel=4,
        )
    return bool(exact)


@dataclass
class _ActiveRows:
    """The rows still generating: ids, next anchors, committed-token counts, and the tapped target features the
    drafter has not seen yet (`pending_context_hidden_states`, at positions `pending_pos`).

    `mask` is the padding mask over the target cache (which already holds the pending context); `pending_shift` is
    how far each row must move right to be contiguous again once the drafter has ingested the pending context.
    """

    rows: list[int]
    anchors: torch.LongTensor
    committed: torch.LongTensor
    mask: torch.Tensor
    pending_context_hidden_states: torch.Tensor
    pending_pos: torch.LongTensor
    pending_shift: torch.LongTensor

    def select(self, index: torch.LongTensor) -> None:
        """Keep only the rows at `index` (positions in the current batch)."""
        self.rows = [self.rows[i] for i in index.tolist()]
        for name in ("anchors", "committed", "mask", "pending_context_hidden_states", "pending_pos", "pending_shift"):
            setattr(self, name, getattr(self, name)[index])


class GenerationCall:
    """The state of one DFlash generation call (sequences, caches, statistics) and the steps of its loop."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDraftModel,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        logits_processor: LogitsProcessorList | None,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        streamer,
        block_size: int | str | BlockSizePolicy | None,
        sampling_proposal: str = DEFAULT_SAMPLING_PROPOSAL,
        candidates: str = DEFAULT_CANDIDATES,
        lookup_tokens: int | None = None,
    ) -> None:
        check_options(candidates, sampling_proposal, lookup_tokens)
        check_drafter(drafter)
        self.adapter = TargetAdapter.for_drafter(target, drafter)
        self.drafter = drafter
        self.policy = make_block_size_policy(block_size, int(drafter.config.block_size))
        self.max_block = int(getattr(self.policy, "max_block_size", getattr(self.policy, "block_size", 0)))
        self.device = input_ids.device
        self.do_sample = bool(generation_config.do_sample)
        self.sample_slots = self.do_sample and sampling_proposal == "sample"
        self.process = BlockLogitsProcessor(logits_processor)
        # trees (the lookup branch, the draft tree) need greedy verification and a processor that scores every node
        # alone; sampling verifies the DFlash block (the chain) alone
        tree_verify = not self.do_sample and (self.process.is_identity or self.process.prefix_free)
        self.lookup_branch = candidates in ("dflash+lookup", "tree") and tree_verify
        self.tree_search = DraftTreeSearch() if candidates == "tree" and tree_verify else None
        self.lookup_tokens = None if lookup_tokens is None else int(lookup_tokens)
        widest = verify_width(self.max_block, self.lookup_branch, self.lookup_tokens, self.tree_search is not None)
        self.row_exact = _row_exact_verification(target, widest)
        self.sliding_window = sliding_window_of(target.config)
        self.tree_choice = LookupBranchChoice()
        self.stopping_criteria = stopping_criteria
        self.stop_token_ids = _plain_stop_token_ids(stopping_criteria)
        self.judged = input_ids.shape[1]  # general criteria have judged the columns before this one
        self.streamer = streamer
        self.streamed = input_ids.shape[1]  # steps sent to the streamer end at this column
        self.mask_token_id = int(drafter.config.mask_token_id)
        draft_ids = getattr(drafter, "draft_token_ids", None)
        self.draft_token_ids = None if draft_ids is None else draft_ids.to(self.device)
        self.markov_head = getattr(drafter, "markov_head", None)
        pad = first_token_id(
            getattr(generation_config, "_pad_token_tensor", None),
            generation_config.pad_token_id,
            generation_config.eos_token_id,
        )
        self.pad_token_id = 0 if pad is None else pad

        batch, prompt_len = input_ids.shape
        self.batch = batch
        self.prompt_len = prompt_len
        self.max_length = int(generation_config.max_length)
        width = max(self.max_length, prompt_len) + int(drafter.config.block_size) + 1
        self.sequences = torch.full((batch, width), self.pad_token_id, dtype=torch.long, device=self.device)
        self.sequences[:, :prompt_len] = input_ids
        self.lengths = [prompt_len] * batch
        self.finished = [False] * batch
        self.accepted_lengths: list[list[int]] = [[] for _ in range(batch)]
        self.lookup_wins = [0] * batch
        self.block_sizes: list[list[int]] = [[] for _ in range(batch)]
        self.verify_widths: list[list[int]] = [[] for _ in range(batch)]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.prompt_mask = attention_mask.to(torch.long)

        self.target_cache, self.draft_cache = DynamicCache(), DynamicCache()
        self.draft_timer = Stopwatch(self.device)
        self.verify_timer = Stopwatch(self.device)
        self.prefill_timer = Stopwatch(self.device)

    # ----------------------------------------------------------------------------------------------------------
    # token selection
    def _row_prefixes(self, rows: list[int], block_tokens: torch.LongTensor) -> list[torch.LongTensor]:
        """Per active row: its sequence so far followed by `block_tokens[i, 1:]` (the anchor is already in it)."""
        prefixes = []
        for i, row in enumerate(rows):
            prefixes.append(torch.cat([self.sequences[row, : self.lengths[row]], block_tokens[i, 1:]]))
        return prefixes

    def _first_token(self, logits: torch.Tensor) -> torch.LongTensor:
        """The token every row gets from the prefill's last logits (processed, then argmax or sampled)."""

        def prefixes():
            return [self.sequences[row, : self.lengths[row]] for row in range(self.batch)]

        scores = self.process(logits[:, None, :], list(range(self.batch)), prefixes)[:, 0]
        if self.do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return scores.argmax(dim=-1)

    def _propose(
        self,
        draft_logits: torch.Tensor,
        rows: list[int],
        markov_inputs: tuple[torch.LongTensor, torch.Tensor] | None = None,
    ):
        """Draft tokens (and their proposal distributions when sampling) from per-slot drafter logits.

        When sampling with the `argmax` proposal the drafted tokens are the processed argmax and the proposal
        distribution is a point mass on them: the rejection sampler then accepts `d` with probability `p(d)` and on
        rejection samples from `p` with `d` removed, which is exactly the target's distribution.

        `markov_inputs` `(anchors, slot hidden states)`: the drafter has a Markov head, so the slots are drafted one
        after another (`_draft_chain`).

        A slot with non-finite logits (a diverged or overflowing drafter) proposes nothing: its logits are zeroed so
        that drafting stays well-defined, and (sampling) its proposal distribution is zero, which `rejection_sample`
        always rejects; greedy verification keeps only drafts equal to the target's tokens anyway.
        """
        draft_logits, finite = _finite_slots(draft_logits)
        if markov_inputs is None:
            tokens, probs = self._draft_tokens(draft_logits, rows)
        else:
            tokens, probs = self._draft_chain(draft_logits, rows, *markov_inputs)
        if self.do_sample and probs is None:
            probs = torch.nn.functional.one_hot(tokens, self.adapter.vocab_size).to(torch.float32)
        if self.do_sample:
            probs = probs * finite[..., None]
        return tokens, probs

    def _draft_chain(self, draft_logits: torch.Tensor, rows: list[int], anchors, hidden_states: torch.Tensor):
        """Slots drafted in order through the drafter's Markov head: slot `k`'s logits plus the head's correction for
        the token drafted at slot `k - 1` (the anchor for slot 1), then chosen like any slot's (`_draft_tokens`).

        Greedy: each slot's argmax given the argmax before it. Sampling: each slot is drawn from its corrected
        distribution given the token drawn before it, and those exact conditional distributions are the proposal
        distributions returned, which keeps rejection sampling exact.
        """
        tokens, probs = draft_logits.new_empty(draft_logits.shape[:2], dtype=torch.long), []
        previous = anchors
        for slot in range(draft_logits.shape[1]):
            slot_logits, slot_hidden = draft_logits[:, slot : slot + 1], hidden_states[:, slot : slot + 1]
            corrected = corrected_logits(self.markov_head, slot_logits, previous[:, None], slot_hidden)
            token, prob = self._draft_tokens(corrected, rows, drafted=tokens[:, :slot])
            tokens[:, slot] = previous = token[:, 0]
            probs.append(prob)
        return tokens, None if probs[0] is None else torch.cat(probs, dim=1)

    def _draft_tokens(self, draft_logits: torch.Tensor, rows: list[int], drafted: torch.LongTensor | None = None):
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
            flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), num_samples=1)
            return flat.view(probs.shape[:2]), probs
        # prefix-dependent processors: slot j's scores depend on the tokens drafted before it
        batch, slots, _ = draft_logits.shape
        tokens = torch.empty(batch, slots, dtype=torch.long, device=draft_logits.device)
        probs = torch.empty_like(draft_logits) if self.sample_slots else None
        drafted = tokens[:, :0] if drafted is None else drafted
        for i, row in enumerate(rows):
            sequence = self.sequences[row, : self.lengths[row]]
            for slot in range(slots):
                prefix = torch.cat([sequence, drafted[i], tokens[i, :slot]])
                scores = self.process.for_row(row, prefix[None], draft_logits[i, slot][None])[0]
                if self.sample_slots:
                    probs[i, slot] = torch.softmax(scores, dim=-1)
                    tokens[i, slot] = torch.multinomial(probs[i, slot], num_samples=1)[0]
                else:
                    tokens[i, slot] = scores.argmax()
        return tokens, probs

    def _full_vocabulary(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the reduced draft vocabulary spread over the target's (-inf outside the draft vocabulary)."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.adapter.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_token_ids, draft_logits)

    def _slot_candidates(self, draft_logits: torch.Tensor, hidden_states: torch.Tensor) -> SlotCandidates:
        """The children of the draft trees' nodes: each slot's top tokens under the processed distribution the chain
        drafts its argmax from (`_draft_tokens`), through the Markov head when the drafter has one."""
        reduced = self.draft_token_ids is not None and self.process.is_identity

        def probabilities(logits: torch.Tensor) -> torch.Tensor:
            if self.draft_token_ids is not None and not reduced:
                logits = self._full_vocabulary(logits)
            return torch.softmax(self.process(logits[:, None], [], lambda: [])[:, 0], dim=-1)

        token_ids = self.draft_token_ids if reduced else None
        return SlotCandidates(draft_logits, probabilities, token_ids, self.markov_head, hidden_states)

    def _accept(self, target_logits: torch.Tensor, block_tokens, draft_tokens, draft_probs, rows):
        """Accepted drafts and the target's next token per row (greedy prefix match, or rejection sampling)."""
        scores = self.process(target_logits, rows, lambda: self._row_prefixes(rows, block_tokens))
        if self.do_sample:
            return rejection_sample(draft_tokens, draft_probs, torch.softmax(scores, dim=-1))
        return greedy_accept(draft_tokens, scores.argmax(dim=-1))

    # ----------------------------------------------------------------------------------------------------------
    # emission
    def _emit(self, row: int, tokens: list[int]) -> int:
        """Append `tokens` to `row` (cut at the length limit, and with only EOS / max-length criteria at the first
        EOS); returns how many were appended. Other criteria judge the rows later, column by column
        ([`_judge_columns`])."""
        start = self.lengths[row]
        tokens = tokens[: self.max_length - start]
        stop = None
        if self.stop_token_ids is not None:  # only max-length / EOS criteria: each row is judged alone, at once
            stop = next((i for i, token in enumerate(tokens) if token in self.stop_token_ids), None)
            if stop is not None:
                tokens = tokens[: stop + 1]
        self.sequences[row, start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self.lengths[row] = start + len(tokens)
        self.finished[row] = stop is not None or self.lengths[row] >= self.max_length
        return self.lengths[row] - start

    def _judge_columns(self) -> None:
        """Call general stopping criteria as plain `generate` does: once per generated column, on the whole batch
        (rows that stopped padded), for every column all running rows have reached. A row found stopped at a column
        loses the tokens it drafted past it (its statistics too)."""
        if self.stop_token_ids is not None:
            return
        while True:
            running = [row for row in range(self.batch) if not self.finished[row]]
            reached = min(self.lengths[row] for row in running) if running else max(self.lengths)
            if self.judged >= reached:
                return
            column = self.judged
            stops = self.stopping_criteria(self.sequences[:, : column + 1], None)
            for row in range(self.batch):  # rows that stopped at the length limit are judged up to it too
                if self.lengths[row] > column and bool(stops[row]):
                    self._truncate(row, column + 1)
            self.judged += 1

    def _truncate(self, row: int, length: int) -> None:
        """End `row` at `length` tokens: later tokens become padding and leave the per-cycle statistics."""
        extra = self.lengths[row] - length
        self.sequences[row, length:] = self.pad_token_id
        self.lengths[row] = length
        self.finished[row] = True
        while extra > 0 and self.accepted_lengths[row]:
            last = self.accepted_lengths[row][-1]
            if last > extra:
                self.accepted_lengths[row][-1] = last - extra
                break
            extra -= last
            for statistic in (self.accepted_lengths, self.block_sizes, self.verify_widths):
                statistic[row].pop()

    def _stream(self) -> None:
        """Send the streamer the steps every row has reached, as plain decoding sends them: one `(batch,)` tensor
        of token ids per step, the pad token in rows that have stopped."""
        if self.streamer is None:
            return
        running = [length for length, done in zip(self.lengths, self.finished) if not done]
        reached = min(running) if running else max(self.lengths)
        for column in range(self.streamed, reached):
            self.streamer.put(self.sequences[:, column].cpu())
        self.streamed = max(self.streamed, reached)

    # ----------------------------------------------------------------------------------------------------------
    def _remaining(self, rows: list[int]) -> int:
        """Most tokens any of `rows` may still generate."""
        return max(self.max_length - self.lengths[row] for row in rows)

    def run(self) -> DFlashGenerateOutput:
        """Prefill, then draft / re-align / verify / commit cycles until every row has stopped."""
        with grouped_attention(self.adapter.target), grouped_attention(self.drafter):
            return self._run()

    def _run(self) -> DFlashGenerateOutput:
        state = self._prefill()
        self._stream()
        while state.rows:
            block = max(1, min(self.policy.next_block_size(), self._remaining(state.rows) + 1))
            cycle_start = time.perf_counter()
            block_pos = state.committed[:, None] + torch.arange(block, device=self.device)[None, :]
            if self.tree_search is not None and block > 1:
                cycle = self._draft_tree_cycle(state, block, block_pos)
            else:
                cycle = self._block_cycle(state, block, block_pos)
            seconds = time.perf_counter() - cycle_start
            # the block-size policy learns the DFlash block's own acceptance, not the other branches' wins
            self.policy.observe(block, cycle.block_kept, seconds)
            committed = sum(cycle.kept) / len(cycle.kept)
            if cycle.lookup_choice is not None:
                self.tree_choice.observe(cycle.lookup_choice, committed, seconds)
            if self.tree_search is not None:
                self.tree_search.budget.observe(cycle.width, committed, seconds)
            self._judge_columns()
            self._drop_finished(state)
            self._stream()
        if self.streamer is not None:
            self.streamer.end()
        return self._output()

    def _prefill(self) -> _ActiveRows:
        """1. One target forward over the prompts: fills the target cache, gives every row its first token."""
        mask = self.prompt_mask
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        with self.prefill_timer:
            step = self.adapter.forward(
                self.sequences[:, : self.prompt_len], _mask_or_none(mask), positions, self.target_cache
            )
            first = self._first_token(self.adapter.logits(step.last_hidden_state[:, -1]))
        for row, token in enumerate(first.tolist()):
            self._emit(row, [token])
        self._judge_columns()
        state = _ActiveRows(
            rows=list(range(self.batch)),
            anchors=first,
            committed=mask.sum(-1),
            mask=mask,
            pending_context_hidden_states=step.context_hidden_states,
            pending_pos=positions,
            pending_shift=torch.zeros(self.batch, dtype=torch.long, device=self.device),
        )
        self._drop_finished(state)
        return state

    def _block_cycle(self, state: _ActiveRows, block: int, block_pos: torch.LongTensor) -> _Cycle:
        """2-5 with the DFlash block: draft, re-align, verify the block (or the two-branch tree with the row's lookup
        continuation, as `tree_choice` decides), commit."""
        draft_tokens, draft_probs = self._draft(state, block, block_pos)
        self._realign(state)
        lookups = self._lookups(state, block) if block > 1 else None  # block 1: a plain step
        tree = lookups is not None and self.tree_choice.use_tree()
        if not tree:
            accepted, next_tokens, step = self._verify(state, block_pos, draft_tokens, draft_probs)
            kept = self._commit(state, block, draft_tokens, accepted, next_tokens, step)
            return _Cycle(kept, kept, block, None if lookups is None else False)
        result, step, order, ids = self._verify_tree(state, block_pos, draft_tokens, lookups)
        path = ids.gather(1, order)[:, 1:]
        widths = [block + len(lookup) for lookup in lookups]
        kept = self._commit(state, block, path, result.accepted, result.next_token, step, order, widths)
        for row, lookup_won in zip(state.rows, result.lookup_won.tolist()):
            self.lookup_wins[row] += int(lookup_won)
        return _Cycle(kept, (result.block_accepted + 1).tolist(), ids.shape[1], True)

    def _draft_tree_cycle(self, state: _ActiveRows, block: int, block_pos: torch.LongTensor) -> _Cycle:
        """2-5 with draft trees (`draft_tree`): draft, grow every row's tree, re-align, verify all trees in one target
        forward, commit each row's longest accepted path. When no tree has a node beyond the chain, the chains are
        verified as the DFlash block."""
        lookups = self._lookups(state, block) or [[] for _ in state.rows]
        with self.draft_timer:
            draft_logits, hidden_states = self._draft_slots(state, block, block_pos)
            draft_logits, _ = _finite_slots(draft_logits)
            candidates = self._slot_candidates(draft_logits, hidden_states)
            trees = self.tree_search.grow(state.anchors.tolist(), candidates, block - 1, lookups)
        self._realign(state)
        if all(len(tree) == block for tree in trees):
            chains = torch.tensor([tree.tokens[1:] for tree in trees], dtype=torch.long, device=self.device)
            accepted, next_tokens, step = self._verify(state, block_pos, chains, None)
            kept = self._commit(state, block, chains, accepted, next_tokens, step)
            on_path = torch.arange(block, device=self.device)[None, :] <= accepted[:, None]
            self.tree_search.observe(trees, on_path.tolist())
            return _Cycle(kept, kept, block, None)
        result, step, order, ids = self._verify_draft_trees(state, block_pos, trees)
        path, widths = ids.gather(1, order)[:, 1:], [len(tree) for tree in trees]
        kept = self._commit(state, block, path, result.accepted, result.next_token, step, order, widths)
        self.tree_search.observe(trees, result.node_accepted.tolist())
        for row, tree, best in zip(state.rows, trees, result.best.tolist()):
            self.lookup_wins[row] += int(tree.from_lookup[best])
        return _Cycle(kept, (result.node_accepted[:, 1:block].sum(dim=1) + 1).tolist(), ids.shape[1], None)

    def _draft(self, state: _ActiveRows, block: int, block_pos: torch.LongTensor):
        """2. The draft tokens (and proposal distributions) of the block, from one drafter forward (`_draft_slots`)."""
        with self.draft_timer:
            if block == 1:  # a plain step: the drafter reads the new context, nothing is drafted
                self._draft_slots(state, block, block_pos)
                none = torch.empty(len(state.rows), 0, dtype=torch.long, device=self.device)
                probs = torch.empty(len(state.rows), 0, self.adapter.vocab_size, device=self.device)
                return none, probs if self.do_sample else None
            draft_logits, hidden_states = self._draft_slots(state, block, block_pos)
            if self.markov_head is None:
                return self._propose(draft_logits, state.rows)
            return self._propose(draft_logits, state.rows, (state.anchors, hidden_states))

    def _draft_slots(self, state: _ActiveRows, block: int, block_pos: torch.LongTensor):
        """One drafter forward over `[anchor, MASK * (block-1)]`: the pending context enters the draft cache, the
        block's own K/V are dropped right after. Returns the draft slots' logits and final hidden states."""
        noise_ids = torch.full((len(state.rows), block), self.mask_token_id, dtype=torch.long, device=self.device)
        noise_ids[:, 0] = state.anchors
        out = self.drafter(
            noise_embeds=self.adapter.embed(noise_ids),
            context_hidden_states=state.pending_context_hidden_states,
            position_ids=torch.cat([state.pending_pos, block_pos], dim=1),
            attention_mask=_mask_or_none(state.mask, block),
            past_key_values=self.draft_cache,
        )
        truncate_cache(self.draft_cache, state.mask.shape[1])
        hidden_states = out.last_hidden_state[:, 1:]
        return self.adapter.logits(hidden_states, self.draft_token_ids), hidden_states

    def _realign(self, state: _ActiveRows) -> None:
        """3. Shift right the rows that committed fewer tokens last cycle (both caches now have the same layout)."""
        if not bool(state.pending_shift.any()):
            return
        shift = state.pending_shift
        shift_cache_right(self.target_cache, shift)
        shift_cache_right(self.draft_cache, shift)
        state.mask = shift_right(state.mask, shift, dim=1)
        state.mask[torch.arange(state.mask.shape[1], device=self.device)[None, :] < shift[:, None]] = 0

    def _verify(self, state: _ActiveRows, block_pos: torch.LongTensor, draft_tokens, draft_probs):
        """4. One target forward over the whole block; returns `(accepted drafts, next tokens, target step)`."""
        block_ids = torch.cat([state.anchors[:, None], draft_tokens], dim=1)
        with self.verify_timer, row_exact.verification(self.row_exact):
            verify_mask = _mask_or_none(state.mask, block_ids.shape[1])
            step = self.adapter.forward(block_ids, verify_mask, block_pos, self.target_cache)
            target_logits = self.adapter.logits(step.last_hidden_state)
            accepted, next_tokens = self._accept(target_logits, block_ids, draft_tokens, draft_probs, state.rows)
        return accepted, next_tokens, step

    def _lookups(self, state: _ActiveRows, block: int) -> list[list[int]] | None:
        """4b. The prompt-lookup continuation of every active row (at most `block - 1` tokens), or `None` when no row
        has one: then the cycle verifies the block alone."""
        if not self.lookup_branch:
            return None
        length = min(lookup_branch_length(block, self.lookup_tokens), self._remaining(state.rows))
        lookups = [lookup_continuation(self._text(row), length) for row in state.rows]
        return lookups if any(lookups) else None

    def _text(self, row: int) -> list[int]:
        """The tokens of `row` so far, prompt padding left out."""
        padding = self.prompt_len - int(self.prompt_mask[row].sum())
        return self.sequences[row, padding : self.lengths[row]].tolist()

    def _verify_tree(self, state: _ActiveRows, block_pos, draft_tokens, lookups: list[list[int]]):
        """4b. One target forward over the tree `[anchor, drafts, lookup]`; returns `(acceptance, target step, path
        order, tree ids)`."""
        ids, positions, sees, valid = tree_layout(state.anchors, draft_tokens, lookups, block_pos[:, 0])
        step, target_tokens = self._verify_nodes(state, ids, positions, sees)
        result = tree_accept(ids, target_tokens, draft_tokens.shape[1], valid)
        order = path_order(result.accepted, result.lookup_won, draft_tokens.shape[1], int(result.accepted.max()) + 1)
        return result, step, order, ids

    def _verify_draft_trees(self, state: _ActiveRows, block_pos, trees: list[DraftTree]):
        """4c. One target forward over every row's draft tree; returns `(acceptance, target step, path order, tree
        ids)`."""
        ids, parents, depths, valid = pack_trees(trees, self.device)
        step, target_tokens = self._verify_nodes(state, ids, block_pos[:, :1] + depths, ancestor_mask(parents))
        result = accept_tree(ids, parents, depths, valid, target_tokens)
        order = tree_path(parents, result.best, result.accepted, int(result.accepted.max()) + 1)
        return result, step, order, ids

    def _verify_nodes(self, state: _ActiveRows, ids, positions, sees):
        """One target forward over tree nodes `ids` at `positions`, each attending to the context and the nodes `sees`
        marks; returns the target step and its (processed) argmax at every node."""
        with self.verify_timer, row_exact.verification(self.row_exact):
            dtype = self.adapter.embed_tokens.weight.dtype
            mask = tree_attention_mask(state.mask, sees, dtype, positions, self.sliding_window)
            step = self.adapter.forward(ids, mask, positions, self.target_cache)
            scores = self.process(self.adapter.logits(step.last_hidden_state), state.rows, lambda: [])
        return step, scores.argmax(dim=-1)

    def _commit(
        self, state: _ActiveRows, block: int, path_tokens, accepted, next_tokens, step, order=None, widths=None
    ) -> list[int]:
        """5. Anchor + accepted drafts enter the caches, the target's token becomes the next anchor, tokens are
        emitted. `order` (a tree verify): the verified positions of each row's accepted path, in order, which alone
        stay in the cache; `widths`: the tokens verified per row (default: the block). Returns the tokens kept per
        row."""
        kept = accepted + 1
        width = int(kept.max())
        features = step.context_hidden_states
        if order is None:
            truncate_cache(self.target_cache, state.mask.shape[1] + width)
        else:
            keep_path(self.target_cache, state.mask.shape[1], order[:, :width])
            features = features.gather(1, order[:, :width, None].expand(-1, -1, features.shape[-1]))
        slots = torch.arange(width, device=self.device)
        state.mask = torch.cat([state.mask, (slots[None, :] < kept[:, None]).to(state.mask.dtype)], dim=1)
        state.pending_context_hidden_states = features[:, :width]
        state.pending_pos = state.committed[:, None] + slots[None, :]  # a lookup path may be longer than the block
        state.pending_shift = width - kept
        state.committed = state.committed + kept
        state.anchors = next_tokens
        kept_list, draft_list, next_list = kept.tolist(), path_tokens.tolist(), next_tokens.tolist()
        for i, row in enumerate(state.rows):
            emitted = self._emit(row, draft_list[i][: kept_list[i] - 1] + [next_list[i]])
            self.accepted_lengths[row].append(emitted)
            self.block_sizes[row].append(block)
            self.verify_widths[row].append(block if widths is None else widths[i])
        return kept_list

    def _drop_finished(self, state: _ActiveRows) -> None:
        """Remove the finished rows from the active rows and from both caches."""
        keep = [i for i, row in enumerate(state.rows) if not self.finished[row]]
        if len(keep) == len(state.rows):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for cache in (self.target_cache, self.draft_cache):
            select_rows(cache, index)
        state.select(index)

    def _output(self) -> DFlashGenerateOutput:
        """The sequences (finished rows right-padded) and the statistics of the call."""
        total = max(self.lengths)
        sequences = self.sequences[:, :total].clone()
        for row, length in enumerate(self.lengths):
            sequences[row, length:] = self.pad_token_id
        lengths = [n for row in self.accepted_lengths for n in row]
        return DFlashGenerateOutput(
            sequences=sequences,
            accepted_lengths=self.accepted_lengths,
            cycles=[len(row) for row in self.accepted_lengths],
            tau=(sum(lengths) / len(lengths)) if lengths else 0.0,
            draft_time=self.draft_timer.total,
            verify_time=self.verify_timer.total,
            prefill_time=self.prefill_timer.total,
            block_size=self.max_block,
            block_sizes=self.block_sizes,
            lookup_wins=self.lookup_wins if self.lookup_branch else [],
            verify_widths=self.verify_widths,
        )
