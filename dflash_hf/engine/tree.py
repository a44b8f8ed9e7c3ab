"""Two candidates per verify: the DFlash block and a prompt-lookup branch, checked by one target forward.

The verified tokens form a small tree rooted at the anchor: node 0 is the anchor, nodes `1..k` the DFlash drafts
(branch 1) and nodes `k+1..k+m` a continuation found by n-gram lookup in the row's own text (branch 2, prompt and
generated tokens, as Transformers' prompt lookup finds it). Each node attends to the committed context and to its own
ancestors only (a 4-D additive mask) and sits at its depth's position, so the target's prediction at a node is
exactly its prediction after the path to that node. The longer accepted path wins; the caches and the drafter's
context features keep only that path ([`path_order`] lists its node indices).

Trees of any shape, given by parent pointers, are verified the same way ([`ancestor_mask`], [`accept_tree`],
[`tree_path`]): the draft trees of `candidates="tree"` (`draft_tree`), one per row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .draft_tree import DEFAULT_TREE_NODES

# what a verify checks: the DFlash block alone, with a lookup branch, or a draft tree (`draft_tree`) with one
CANDIDATE_SOURCES = ("dflash", "dflash+lookup", "tree")
# the bench's rows with and without the lookup branch compare the two (docs/results.md)
DEFAULT_CANDIDATES = "dflash+lookup"
LOOKUP_NGRAM_SIZES = (3, 2)  # longest n-gram first, as prompt lookup does; 1-grams match too often to pay
# the bench's lookup-branch rows compare this length with shorter branches (docs/results.md); what a wider verify
# costs on a machine is in its `dflash-hf profile` output
DEFAULT_LOOKUP_TOKENS = 7


def lookup_branch_length(block: int, lookup_tokens: int | None = None) -> int:
    """Most tokens of the lookup branch verified with a `block`-token DFlash block: `lookup_tokens` when given, else
    [`DEFAULT_LOOKUP_TOKENS`] or `block - 1` if that is more."""
    return max(block - 1, DEFAULT_LOOKUP_TOKENS) if lookup_tokens is None else lookup_tokens


def verify_width(block: int, lookup_branch: bool, lookup_tokens: int | None = None, draft_tree: bool = False) -> int:
    """Tokens of the widest verify with a `block`-token DFlash block: the block, plus its longest lookup branch when
    the verify carries one, or the most nodes a draft tree adds to it (`candidates="tree"`, lookup tokens included);
    row-exact reduced-precision verification must cover them all."""
    if draft_tree:
        return block + DEFAULT_TREE_NODES
    return block + (lookup_branch_length(block, lookup_tokens) if lookup_branch else 0)


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


def tree_layout(
    anchors: torch.LongTensor, drafts: torch.LongTensor, lookups: list[list[int]], start: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor, torch.Tensor, torch.Tensor]:
    """Token ids, positions, the node-to-node visibility `(batch, W, W)` and the lookup validity `(batch, m)` of the
    trees `[anchor, drafts..., lookup...]` (lookups right-padded to the longest with the anchor token, never accepted).

    `start[i]` is the position of row `i`'s anchor."""
    batch, k = drafts.shape
    m = max(len(tokens) for tokens in lookups)
    device = drafts.device
    lookup_ids = anchors[:, None].repeat(1, m)
    valid = torch.zeros(batch, m, dtype=torch.bool, device=device)
    for i, tokens in enumerate(lookups):
        if tokens:
            lookup_ids[i, : len(tokens)] = torch.tensor(tokens, device=device)
            valid[i, : len(tokens)] = True
    ids = torch.cat([anchors[:, None], drafts, lookup_ids], dim=1)
    depth = torch.cat([torch.arange(k + 1, device=device), torch.arange(1, m + 1, device=device)])
    sees = ancestor_mask(_two_branch_parents(k, m, device)[None])
    positions = start[:, None] + depth[None, :]
    return ids, positions, sees.expand(batch, -1, -1), valid


def _two_branch_parents(k: int, m: int, device) -> torch.LongTensor:
    """Parent of every node of `[anchor, k drafts, m lookup tokens]`: both branches hang from the root."""
    lookup = [0] + list(range(k + 1, k + m)) if m else []
    return torch.tensor([0, *range(k), *lookup], dtype=torch.long, device=device)


def ancestor_mask(parents: torch.LongTensor) -> torch.Tensor:
    """Node-to-node visibility `(batch, W, W)` of trees given by parent pointers `(batch, W)` (the root, node 0, is
    its own parent): node `i` sees node `j` when `j` is `i` or one of its ancestors."""
    batch, width = parents.shape
    sees = torch.eye(width, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    node = torch.arange(width, device=parents.device).repeat(batch, 1)
    for _ in range(width - 1):  # a path is at most W - 1 steps long
        if not bool(node.any()):
            break
        node = parents.gather(1, node)
        sees.scatter_(2, node[:, :, None], True)
    return sees


def tree_attention_mask(
    padding: torch.Tensor,
    sees: torch.Tensor,
    dtype: torch.dtype,
    positions: torch.LongTensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive 4-D mask `(batch, 1, W, context + W)` of a tree verify: padded context positions and non-ancestor
    nodes hidden. With a `sliding_window` (Gemma 3), a mask per layer type: the sliding layers also hide the context
    keys at least `sliding_window` positions before a node (`positions`: the nodes' positions; the context is
    right-aligned and contiguous, so its positions follow from `padding`)."""
    width = sees.shape[-1]
    context = padding.bool()[:, None, :].expand(-1, width, -1)
    visible = torch.cat([context, sees], dim=-1)[:, None]
    full = _additive(visible, dtype)
    if sliding_window is None:
        return full
    key_positions = torch.cat([padding.long().cumsum(-1) - 1, positions], dim=-1)
    near = key_positions[:, None, :] > positions[:, :, None] - sliding_window
    return {"full_attention": full, "sliding_attention": _additive(visible & near[:, None], dtype)}


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, the dtype's minimum elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


class TreeAcceptance(NamedTuple):
    """What greedy verification of the two-branch tree accepted, per row."""

    accepted: torch.Tensor  # tokens accepted on the winning branch
    next_token: torch.Tensor  # the target's token after them
    lookup_won: torch.Tensor  # whether the lookup branch won
    block_accepted: torch.Tensor  # tokens the DFlash block alone would have had accepted (for the block-size policy)


def tree_accept(
    ids: torch.LongTensor, target_tokens: torch.LongTensor, k: int, lookup_valid: torch.Tensor
) -> TreeAcceptance:
    """Greedy acceptance on both branches of the tree `ids` (`[anchor, k drafts, lookup tokens]`).

    `target_tokens[:, j]` is the target's argmax at node `j` (its prediction of node j's child)."""
    batch, width = ids.shape
    parents = _two_branch_parents(k, width - 1 - k, ids.device)
    depths = torch.cat([torch.arange(k + 1, device=ids.device), torch.arange(1, width - k, device=ids.device)])
    valid = torch.cat([lookup_valid.new_ones(batch, k + 1), lookup_valid], dim=1)
    result = accept_tree(ids, parents.expand(batch, -1), depths.expand(batch, -1), valid, target_tokens)
    block_accepted = result.node_accepted[:, 1 : k + 1].sum(dim=1)
    return TreeAcceptance(result.accepted, result.next_token, result.best > k, block_accepted)


class PathAcceptance(NamedTuple):
    """What greedy verification of a tree accepted, per row."""

    accepted: torch.Tensor  # tokens accepted on the longest accepted path
    best: torch.Tensor  # the node that path ends at (the root when nothing was accepted)
    next_token: torch.Tensor  # the target's token after it
    node_accepted: torch.Tensor  # `(batch, W)`: whether each node is on an accepted path


def accept_tree(
    ids: torch.LongTensor,
    parents: torch.LongTensor,
    depths: torch.LongTensor,
    valid: torch.Tensor,
    target_tokens: torch.LongTensor,
) -> PathAcceptance:
    """Greedy acceptance on trees given by parent pointers: a node is accepted when it is `valid`, its parent was
    accepted and its token is the target's argmax at its parent; the deepest accepted node wins (the first one in
    node order among equals). All arguments are `(batch, W)`; node 0 is the root (its own parent)."""
    match = valid & (ids == target_tokens.gather(1, parents))
    match[:, 0] = True
    accepted = match
    for _ in range(int(depths.max()) - 1):  # depth-1 nodes are right already; each pass settles one level more
        accepted = match & accepted.gather(1, parents)
    best = torch.where(accepted, depths, -1).argmax(dim=1)
    length = depths.gather(1, best[:, None]).squeeze(1)
    next_token = target_tokens.gather(1, best[:, None]).squeeze(1)
    return PathAcceptance(length, best, next_token, accepted)


def tree_path(parents: torch.LongTensor, best: torch.Tensor, accepted: torch.Tensor, width: int) -> torch.LongTensor:
    """Node indices of each row's path from the root to `best` (`accepted` steps long), padded to `width` by
    repeating `best` (the padding is masked out like any short row)."""
    order = best[:, None].repeat(1, width)
    node = best
    for step in range(int(accepted.max()) + 1):
        depth = (accepted - step).clamp_min(0)[:, None]
        on_path = (accepted >= step)[:, None]
        order.scatter_(1, depth, torch.where(on_path, node[:, None], order.gather(1, depth)))
        node = parents.gather(1, node[:, None]).squeeze(1)
    return order


def path_order(accepted: torch.Tensor, lookup_won: torch.Tensor, k: int, width: int) -> torch.LongTensor:
    """Node indices of each row's accepted path `[anchor, accepted tokens...]`, padded to `width` by repeating the
    last one (the padding is masked out like any short row)."""
    steps = torch.arange(width, device=accepted.device)[None, :]
    depth = torch.minimum(steps, accepted[:, None])
    return torch.where(lookup_won[:, None] & (depth > 0), k + depth, depth)


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
