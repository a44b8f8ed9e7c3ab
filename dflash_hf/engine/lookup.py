"""The prompt-lookup branch: a continuation of the row's own text, verified with the DFlash block in one forward.

The continuation is what followed the latest earlier occurrence of the row's trailing n-gram (prompt and generated
tokens, as Transformers' prompt lookup finds it). With the DFlash chain it forms a two-branch tree rooted at the
anchor ([`lookup_branch_trees`]): nodes `1..k` the drafts, nodes `k+1..k+m` the continuation; the longer accepted
branch wins. [`LookupBranchChoice`] decides, from what the call measures, whether a cycle verifies that tree or the
block alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime import upload
from .tree import TokenTrees

LOOKUP_NGRAM_SIZES = (3, 2)  # longest n-gram first, as prompt lookup does; 1-grams match too often to pay
# the bench's lookup-branch rows compare this length with shorter branches (docs/results.md); what a wider verify
# costs on a machine is in its `dflash-hf profile` output
DEFAULT_LOOKUP_TOKENS = 7


def lookup_branch_length(block: int, lookup_tokens: int | None = None) -> int:
    """Most tokens of the lookup branch verified with a `block`-token DFlash block: `lookup_tokens` when given, else
    [`DEFAULT_LOOKUP_TOKENS`] or `block - 1` if that is more."""
    return max(block - 1, DEFAULT_LOOKUP_TOKENS) if lookup_tokens is None else lookup_tokens


def lookup_continuation(sequence: list[int], max_tokens: int, ngram_sizes=LOOKUP_NGRAM_SIZES) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the sequence's trailing n-gram (at most
    `max_tokens`; empty when no n-gram of `ngram_sizes` recurs)."""
    length = len(sequence)
    for n in ngram_sizes:
        if length <= n:
            continue
        tail = sequence[-n:]
        for start in range(length - n - 1, -1, -1):
            if sequence[start : start + n] == tail:
                return sequence[start + n : start + n + max_tokens]
    return []


class Lookups:
    """The lookup continuations of a call's rows: `text(row)` gives a row's tokens so far, `remaining(rows)` the most
    tokens any of them may still generate (a continuation is never longer)."""

    def __init__(
        self,
        lookup_tokens: int | None,
        text: Callable[[int], list[int]],
        remaining: Callable[[list[int]], int],
    ) -> None:
        self.lookup_tokens, self.text, self.remaining = lookup_tokens, text, remaining

    def continuations(self, rows: list[int], block: int) -> list[list[int]] | None:
        """Every row's continuation (at most [`lookup_branch_length`] tokens), or `None` when no row has one."""
        length = min(lookup_branch_length(block, self.lookup_tokens), self.remaining(rows))
        found = [lookup_continuation(self.text(row), length) for row in rows]
        return found if any(found) else None


def lookup_branch_trees(anchors: torch.LongTensor, drafts: torch.LongTensor, lookups: list[list[int]]) -> TokenTrees:
    """The two-branch trees `[anchor, drafts..., lookup...]`: both branches hang from the anchor, the lookups
    right-padded to the longest with the anchor token (never valid, so never accepted)."""
    batch, k = drafts.shape
    m = max(len(tokens) for tokens in lookups)
    device = drafts.device
    table = upload([[len(tokens), *tokens] + [0] * (m - len(tokens)) for tokens in lookups], device)
    lookup_valid = torch.arange(m, device=device)[None, :] < table[:, :1]
    lookup_ids = torch.where(lookup_valid, table[:, 1:], anchors[:, None])
    valid = torch.cat([lookup_valid.new_ones(batch, k + 1), lookup_valid], dim=1)
    root = torch.zeros(1, dtype=torch.long, device=device)
    lookup_parents = torch.cat([root, torch.arange(k + 1, k + m, device=device)]) if m else root[:0]
    parents = torch.cat([root, torch.arange(k, device=device), lookup_parents])
    depths = torch.cat([torch.arange(k + 1, device=device), torch.arange(1, m + 1, device=device)])
    from_lookup = valid & (torch.arange(k + 1 + m, device=device) > k)
    return TokenTrees(
        ids=torch.cat([anchors[:, None], drafts, lookup_ids], dim=1),
        parents=parents.expand(batch, -1),
        depths=depths.expand(batch, -1),
        valid=valid,
        from_lookup=from_lookup,
        depth=max(k, m),
        widths=[k + 1 + len(tokens) for tokens in lookups],
        parent_lists=[[0, *range(k), *([0, *range(k + 1, k + m)] if m else [])]] * batch,
    )


class LookupBranchChoice:
    """Whether a cycle whose row has a lookup continuation verifies the two-branch tree or the block alone, chosen from
    what this call measured (in the spirit of the adaptive block size): committed tokens per second of the cycles of
    each kind, as exponentially decayed sums. The tree is tried first (it won on both bench prompt sets); every
    `explore_every`-th eligible cycle takes the other choice, so both rates stay measured and the choice follows
    the machine's verify costs and this text's lookup acceptance. Both choices are lossless."""

    def __init__(self, explore_every: int = 8, decay: float = 0.8) -> None:
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}.")
        self.explore_every = int(explore_every)
        self.decay = float(decay)
        self.tokens = {True: 0.0, False: 0.0}
        self.seconds = {True: 0.0, False: 0.0}
        self.eligible = 0

    def rate(self, tree: bool) -> float | None:
        """Measured committed tokens per second of tree (or block-only) cycles, `None` before the first one."""
        return self.tokens[tree] / self.seconds[tree] if self.seconds[tree] > 0 else None

    def use_tree(self) -> bool:
        """The choice for the next eligible cycle."""
        self.eligible += 1
        tree, block = self.rate(True), self.rate(False)
        best = True if tree is None or block is None else tree >= block
        return (not best) if self.eligible % self.explore_every == 0 else best

    def observe(self, tree: bool, committed: float, seconds: float) -> None:
        """Record one eligible cycle: whether it verified the tree, the tokens it committed, its wall time."""
        for kind in (True, False):
            self.tokens[kind] *= self.decay if kind == tree else 1.0
            self.seconds[kind] *= self.decay if kind == tree else 1.0
        self.tokens[tree] += committed
        self.seconds[tree] += seconds
