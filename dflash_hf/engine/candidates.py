"""What a cycle verifies: the candidate sources and the plan that chooses them once per call.

A source proposes each cycle's candidates for the active rows as a [`Proposal`]: the DFlash chain (the block's
drafts, verified by a causal forward; the one shape sampling verifies) or token trees given by parent pointers
(`tree.TokenTrees`, verified with an ancestor mask). After verification it learns what was accepted (the
[`Verdict`] as the host reads it once per cycle, a [`Readout`]), then what the cycle cost, which its own adaptive
choices follow. Three sources:

* [`DFlashChain`]: the DFlash block alone, drafted by one drafter forward (`candidates="dflash"`).
* [`LookupBranch`]: the chain, plus the row's prompt-lookup continuation as a second branch from the anchor when
  `lookup.LookupBranchChoice` finds it pays (`candidates="dflash+lookup"`).
* [`DraftTreeCandidates`]: a draft tree per row over the drafter's top tokens per slot, the lookup continuation one
  more branch (`draft_tree`, `candidates="tree"`).

[`CandidatePlan`] names the source from the call's options ([`candidate_source`] builds it) and owns the widest
verify, which the engine's row-exact set-up, `dflash-hf generate` and the bench read.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import CompileConfig

from ..modeling.modeling_dflash import key_positions
from ..runtime import Stopwatch, compiled_call, forwards_alone, upload
from ..target.adapter import TargetAdapter, TargetStep
from .cache_ops import drop_leading, truncate_cache
from .draft_tree import DEFAULT_TREE_NODES, DraftTree, DraftTreeSearch, pack_trees
from .lookup import LookupBranchChoice, Lookups, lookup_branch_length, lookup_branch_trees
from .rows import ActiveRows
from .token_choice import TokenChoice, finite_slots
from .tree import TokenTrees

# what a verify checks: the DFlash block alone, with a lookup branch, or a draft tree (`draft_tree`) with one
CANDIDATE_SOURCES = ("dflash", "dflash+lookup", "tree")
# the bench's rows with and without the lookup branch compare the two (docs/results.md)
DEFAULT_CANDIDATES = "dflash+lookup"


@dataclass(frozen=True)
class CandidatePlan:
    """The candidates of a call, decided once from its options.

    Args:
        candidates: What the caller asked for, one of [`CANDIDATE_SOURCES`].
        max_block: The largest DFlash block of the call.
        lookup_tokens: Most tokens of a lookup branch (`None`: [`lookup.lookup_branch_length`]'s default).
        tree_verify: Whether the call can verify trees: greedy decoding, with logits processors that score every
            node alone. Without, every cycle verifies the DFlash chain, whatever `candidates` asked.
    """

    candidates: str
    max_block: int
    lookup_tokens: int | None = None
    tree_verify: bool = True

    @property
    def source(self) -> str:
        """The candidates every cycle draws from."""
        return self.candidates if self.tree_verify else "dflash"

    @property
    def lookup_branch(self) -> bool:
        """Whether cycles verify a prompt-lookup continuation with the block."""
        return self.source in ("dflash+lookup", "tree")

    @property
    def verify_width(self) -> int:
        """Tokens of the widest verify: the block, plus its longest lookup branch, or the most nodes a draft tree adds
        to it (lookup tokens included); row-exact reduced-precision verification must cover them all."""
        if self.source == "tree":
            return self.max_block + DEFAULT_TREE_NODES
        if self.lookup_branch:
            return self.max_block + lookup_branch_length(self.max_block, self.lookup_tokens)
        return self.max_block


class Proposal(NamedTuple):
    """One cycle's candidates for the active rows: the DFlash chain (`tokens`, with their proposal distributions
    `probs` when sampling) or `trees`. `lookup_choice`: with a lookup continuation, whether the tree was chosen;
    `draft_trees`: the rows' draft trees, when a draft tree source grew them (verified as `trees`, or as the chain
    when none grew beyond it)."""

    block: int
    tokens: torch.LongTensor | None = None
    probs: torch.Tensor | None = None
    trees: TokenTrees | None = None
    lookup_choice: bool | None = None
    draft_trees: list[DraftTree] | None = None

    @property
    def width(self) -> int:
        """Tokens verified per row (trees: padded to the widest row's)."""
        return self.block if self.trees is None else self.trees.ids.shape[1]


class Verdict(NamedTuple):
    """What the target's verify forward decided, per row, on the device: `accepted` candidates on the kept path, the
    target's `next_tokens` after them, the `path` tokens after the anchor, and `order` (trees: the kept path's node
    indices). `widths` (on the host, known from the proposal) are the tokens verified per row; `block_kept` what the
    DFlash block alone would have committed (`None`: the block was verified alone); `node_accepted` (trees) marks the
    accepted nodes; `lookup_won` (trees) whether a lookup node ended the path. [`read`] brings what the host needs."""

    accepted: torch.Tensor
    next_tokens: torch.Tensor
    step: TargetStep
    path: torch.LongTensor
    widths: list[int]
    block_kept: torch.Tensor | None = None
    order: torch.LongTensor | None = None
    node_accepted: torch.Tensor | None = None
    lookup_won: torch.Tensor | None = None

    def read(self) -> Readout:
        """The cycle's one read of the device: every row's committed tokens and counts, packed in one tensor."""
        kept = self.accepted + 1
        block_kept = kept if self.block_kept is None else self.block_kept
        lookup_won = torch.zeros_like(kept) if self.lookup_won is None else self.lookup_won
        nodes = self.path[:, :0] if self.node_accepted is None else self.node_accepted
        columns = [kept[:, None], block_kept[:, None], lookup_won[:, None], self.next_tokens[:, None], self.path, nodes]
        packed = torch.cat([column.long() for column in columns], dim=1).tolist()
        width = self.path.shape[1]
        return Readout(
            kept=[row[0] for row in packed],
            block_kept=[row[1] for row in packed],
            lookup_won=[bool(row[2]) for row in packed],
            tokens=[row[4 : 4 + row[0] - 1] + [row[3]] for row in packed],
            node_accepted=None
            if self.node_accepted is None
            else [[bool(node) for node in row[4 + width :]] for row in packed],
        )


class Readout(NamedTuple):
    """A [`Verdict`] as the host reads it, per row: the tokens `kept` (accepted candidates + the target's own), the
    committed `tokens` themselves, what the DFlash block alone would have kept (`block_kept`), whether a lookup node
    ended the path (`lookup_won`), and (trees) which nodes were accepted (`node_accepted`)."""

    kept: list[int]
    block_kept: list[int]
    lookup_won: list[bool]
    tokens: list[list[int]]
    node_accepted: list[list[bool]] | None = None


class CandidateSource(Protocol):
    """A source of candidates: proposes each cycle's candidates and learns from what was accepted and what it cost."""

    def propose(self, state: ActiveRows, block: int, block_pos: torch.LongTensor) -> Proposal:
        """The candidates of the active rows' next blocks of `block` tokens at positions `block_pos`."""

    def learn(self, proposal: Proposal, readout: Readout) -> None:
        """What the target accepted of `proposal` (within the cycle's time)."""

    def observe(self, proposal: Proposal, committed: float, seconds: float) -> None:
        """What the cycle cost: the tokens it committed per row and its wall time."""


class DFlashChain:
    """The DFlash block: one drafter forward over `[anchor, MASK * (block-1)]` per row, the slots' tokens chosen by
    the call's [`TokenChoice`]; the pending context enters the draft cache, the block's own K/V are dropped."""

    def __init__(
        self,
        drafter: PreTrainedModel,
        adapter: TargetAdapter,
        cache: Cache,
        choice: TokenChoice,
        timer: Stopwatch,
        compile_config: CompileConfig | None = None,
        context_width: int = 0,
    ) -> None:
        """With `compile_config` (and a static `cache`) the drafter's forward runs compiled at one shape per block
        size: the pending context padded to `context_width` tokens (hidden), the mask over the whole cache; the first
        forward (it allocates the cache) and a longer pending context run eagerly."""
        self.drafter, self.adapter, self.cache, self.choice, self.timer = drafter, adapter, cache, choice, timer
        self.mask_token_id = int(drafter.config.mask_token_id)
        self.compile_config, self.context_width = compile_config, context_width
        # a drafter whose every layer slides over a window: the leading context positions its cache no longer holds
        window = drafter.config.context_window
        self.kept_context = None if window is None or compile_config is not None else window + 2 * context_width
        self.dropped = 0

    def attention_mask(self, state: ActiveRows, block: int) -> torch.Tensor | None:
        """The drafter's mask over its keys (cache, pending context, block): `None` when no row is padded, else in
        the 4-D boolean form its attention takes (the 2-D one for flash attention), as the host knows the rows are
        padded (given a 2-D mask, the drafter reads it to find out)."""
        mask = state.attention_mask(block)
        if mask is not None and self.dropped:
            mask = mask[:, self.dropped :]
        if mask is None or "flash" in (self.drafter.config._attn_implementation or ""):
            return mask
        return mask.bool()[:, None, None, :].expand(-1, 1, block, -1)

    def slots(self, state: ActiveRows, block: int, block_pos: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward; returns the draft slots' logits and final hidden states."""
        noise_ids = torch.full((len(state.rows), block), self.mask_token_id, dtype=torch.long, device=block_pos.device)
        noise_ids[:, 0] = state.anchors
        context, context_pos, mask = state.pending_context_hidden_states, state.pending_pos, None
        call = self.drafter
        if self.compile_config is None:
            mask = self.attention_mask(state, block)
        else:
            hidden = max(0, self.context_width - context.shape[1])
            if hidden:  # padded to the compiled width: hidden keys, written where the block's own are dropped
                context = torch.nn.functional.pad(context, (0, 0, 0, hidden))
                context_pos = torch.cat([context_pos, context_pos[:, -1:].expand(-1, hidden)], dim=1)
            if context.shape[1] == self.context_width and self.cache.layers[0].is_initialized:  # not the first call
                call = compiled_call(self.drafter, self.compile_config)
            mask = self.static_mask(state, block, hidden)
        position_ids = torch.cat([context_pos, block_pos], dim=1)
        with forwards_alone() if call is self.drafter else contextlib.nullcontext():
            out = call(
                noise_embeds=self.adapter.embed(noise_ids),
                context_hidden_states=context,
                position_ids=position_ids,
                attention_mask=mask,
                cache=self.cache,
                **self.key_positions(state, position_ids, block),
            )
        truncate_cache(self.cache, state.mask.shape[1] - self.dropped)
        self._forget_past_the_window(state)
        hidden_states = out.last_hidden_state[:, 1:]
        if call is not self.drafter:  # a copy that a later replay of the drafter's CUDA graphs does not overwrite
            hidden_states = hidden_states.clone()
        return self.adapter.draft_logits(hidden_states, self.choice.draft_token_ids), hidden_states

    def key_positions(self, state: ActiveRows, position_ids: torch.LongTensor, block: int) -> dict:
        """For a drafter whose layers see less than every key (sliding windows, causal blocks): the positions of the
        keys its layers attend over, the cached context (right-aligned) directly before the new context, then the
        block and a static cache's unfilled end. Known here on the host, so that a compiled forward never reads its
        static cache's filled length."""
        if not self.drafter.config.restricts_attention:
            return {}
        cached = state.mask.shape[1] - self.dropped - state.pending_pos.shape[1]
        keys = self.cache.layers[0].max_cache_len if self.compile_config is not None else 0
        keys = max(keys, cached + position_ids.shape[1])
        return {"key_position_ids": key_positions(position_ids, cached, keys, None)}

    def _forget_past_the_window(self, state: ActiveRows) -> None:
        """A drafter that sees only the last `W - 1` context positions keeps no more than those in its cache (and the
        most a commit and a re-alignment move a row by): long contexts cost it nothing more. The positions dropped
        first are out of every slot's window, so the drafts are the same."""
        if self.kept_context is None:
            return
        held = state.mask.shape[1] - self.dropped
        if held > 2 * self.kept_context:  # now and then, not every cycle
            drop_leading(self.cache, held - self.kept_context, held)
            self.dropped += held - self.kept_context

    def static_mask(self, state: ActiveRows, block: int, hidden: int) -> torch.Tensor:
        """The drafter's 4-D boolean mask over its static cache: the cached and pending context as the rows' padding
        says, `hidden` padding tokens hidden, the block seen, the rest of the cache hidden."""
        keys = self.cache.layers[0].max_cache_len
        rows, context = state.mask.shape
        seen = torch.cat(
            [
                state.mask.bool(),
                state.mask.new_zeros(rows, hidden, dtype=torch.bool),
                state.mask.new_ones(rows, block, dtype=torch.bool),
                state.mask.new_zeros(rows, keys - context - hidden - block, dtype=torch.bool),
            ],
            dim=1,
        )
        return seen[:, None, None, :].expand(-1, 1, block, -1)

    def propose(self, state: ActiveRows, block: int, block_pos: torch.LongTensor) -> Proposal:
        """The chain's drafts (block 1: a plain step, the drafter reads the new context and nothing is drafted)."""
        with self.timer:
            if block == 1:
                self.slots(state, block, block_pos)
                tokens = torch.empty(len(state.rows), 0, dtype=torch.long, device=block_pos.device)
                probs = torch.empty(len(state.rows), 0, self.adapter.vocab_size, device=block_pos.device)
                return Proposal(block, tokens, probs if self.choice.do_sample else None)
            draft_logits, hidden_states = self.slots(state, block, block_pos)
            if not self.choice.drafts_in_order:
                return Proposal(block, *self.choice.propose(draft_logits, state.rows))
            return Proposal(block, *self.choice.propose(draft_logits, state.rows, (state.anchors, hidden_states)))

    def learn(self, proposal: Proposal, readout: Readout) -> None:
        """The chain learns nothing (the block-size policy learns from every cycle)."""

    def observe(self, proposal: Proposal, committed: float, seconds: float) -> None:
        """The chain follows no cost."""


class LookupBranch:
    """The chain plus each row's lookup continuation as a second branch from the anchor, in cycles where a row has
    one and [`LookupBranchChoice`] chooses the tree."""

    def __init__(self, chain: DFlashChain, lookups: Lookups) -> None:
        self.chain, self.lookups, self.branch_choice = chain, lookups, LookupBranchChoice()

    def propose(self, state: ActiveRows, block: int, block_pos: torch.LongTensor) -> Proposal:
        """The chain's drafts, with the rows' lookup continuations as the two-branch trees when chosen."""
        proposal = self.chain.propose(state, block, block_pos)
        found = self.lookups.continuations(state.rows, block) if block > 1 else None  # block 1: a plain step
        if found is None:
            return proposal
        if not self.branch_choice.use_tree():
            return proposal._replace(lookup_choice=False)
        return Proposal(block, trees=lookup_branch_trees(state.anchors, proposal.tokens, found), lookup_choice=True)

    def learn(self, proposal: Proposal, readout: Readout) -> None:
        """The choice follows committed tokens per second, not acceptance."""

    def observe(self, proposal: Proposal, committed: float, seconds: float) -> None:
        """A cycle with a lookup continuation counts for the kind it verified (tree or block alone)."""
        if proposal.lookup_choice is not None:
            self.branch_choice.observe(proposal.lookup_choice, committed, seconds)


class DraftTreeCandidates:
    """A draft tree per row (`draft_tree`), grown within the budget the call measures; the chain alone when no tree
    grew beyond it, and for plain steps."""

    def __init__(self, chain: DFlashChain, lookups: Lookups) -> None:
        self.chain, self.lookups, self.search = chain, lookups, DraftTreeSearch()

    def propose(self, state: ActiveRows, block: int, block_pos: torch.LongTensor) -> Proposal:
        """Every row's draft tree (its lookup continuation one more branch), or the chains when no tree grew beyond
        them; block 1 is a plain step."""
        if block == 1:
            return self.chain.propose(state, block, block_pos)
        lookups = self.lookups.continuations(state.rows, block) or [[] for _ in state.rows]
        with self.chain.timer:
            draft_logits, hidden_states = self.chain.slots(state, block, block_pos)
            draft_logits, _ = finite_slots(draft_logits)
            candidates = self.chain.choice.slot_candidates(draft_logits, hidden_states, state.anchors)
            trees = self.search.grow(state.anchor_ids, candidates, block - 1, lookups)
        if all(len(tree) == block for tree in trees):
            chains = upload([tree.tokens[1:] for tree in trees], block_pos.device)
            return Proposal(block, chains, draft_trees=trees)
        return Proposal(block, trees=pack_trees(trees, block_pos.device), draft_trees=trees)

    def learn(self, proposal: Proposal, readout: Readout) -> None:
        """Calibrate the drafter and lookup nodes' acceptance per depth from the verified trees."""
        if proposal.draft_trees is None:
            return
        accepted = readout.node_accepted
        if accepted is None:  # verified as the chain: its nodes up to the accepted ones
            accepted = [[node < kept for node in range(proposal.block)] for kept in readout.kept]
        self.search.observe(proposal.draft_trees, accepted)

    def observe(self, proposal: Proposal, committed: float, seconds: float) -> None:
        """The budget learns the cost of the cycle's verify width."""
        self.search.budget.observe(proposal.width, committed, seconds)


def candidate_source(plan: CandidatePlan, chain: DFlashChain, lookups: Lookups) -> CandidateSource:
    """The source `plan` chose."""
    if plan.source == "tree":
        return DraftTreeCandidates(chain, lookups)
    if plan.source == "dflash+lookup":
        return LookupBranch(chain, lookups)
    return chain
