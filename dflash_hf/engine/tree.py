"""Token trees verified by one target forward: the candidates of a cycle, given by parent pointers.

Node 0 of a row's tree is the anchor; every other node holds a candidate token under its parent, at its depth's
position. Each node attends to the committed context and to its own ancestors only (a 4-D additive mask,
[`tree_attention_mask`] of [`ancestor_mask`]), so the target's prediction at a node is exactly its prediction after the
path to that node. Greedy acceptance keeps each row's longest accepted path ([`accept_tree`]); the caches and the
drafter's context features keep only that path ([`tree_path`] lists its node indices). The candidate sources build
such trees (`candidates`): the DFlash chain with a prompt-lookup branch (`lookup`), or a draft tree per row
(`draft_tree`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenTrees(NamedTuple):
    """A batch of token trees, each tensor `(batch, W)`: node ids, parent pointers (the root, node 0, is its own
    parent), depths, whether a node is a real candidate (padding nodes never are) and whether it came from a lookup
    continuation. The host knows their shape from building them: the deepest node's `depth` and each row's number of
    real nodes (`widths`, the root included), and each row's parent pointers up to its last real node
    (`parent_lists`: a hybrid target verifies each root-to-leaf path on a state of its own,
    `target.linear_attention.path_batch`)."""

    ids: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    valid: torch.Tensor
    from_lookup: torch.Tensor
    depth: int
    widths: list[int]
    parent_lists: list[list[int]]


def ancestor_mask(parents: torch.LongTensor, depth: int) -> torch.Tensor:
    """Node-to-node visibility `(batch, W, W)` of trees given by parent pointers `(batch, W)` (the root, node 0, is
    its own parent) whose deepest node is at `depth`: node `i` sees node `j` when `j` is `i` or one of its
    ancestors."""
    batch, width = parents.shape
    sees = torch.eye(width, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    node = torch.arange(width, device=parents.device).repeat(batch, 1)
    for _ in range(depth):  # a path is at most `depth` steps long
        node = parents.gather(1, node)
        sees.scatter_(2, node[:, :, None], True)
    return sees


def tree_attention_mask(
    padding: torch.Tensor,
    sees: torch.Tensor,
    dtype: torch.dtype,
    positions: torch.LongTensor | None = None,
    sliding_window: int | None = None,
    keys: int | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive 4-D mask `(batch, 1, W, context + W)` of a tree verify: padded context positions and non-ancestor
    nodes hidden. With a `sliding_window` (Gemma 3), a mask per layer type: the sliding layers also hide the context
    keys at least `sliding_window` positions before a node (`positions`: the nodes' positions; the context is
    right-aligned and contiguous, so its positions follow from `padding`). `keys`: the mask covers that many keys (a
    static cache's length), those after the nodes hidden."""
    width = sees.shape[-1]
    context = padding.bool()[:, None, :].expand(-1, width, -1)
    visible = torch.cat([context, sees], dim=-1)
    after = 0 if keys is None else keys - visible.shape[-1]
    visible = torch.nn.functional.pad(visible, (0, after))[:, None]
    full = _additive(visible, dtype)
    if sliding_window is None:
        return full
    key_positions = torch.cat([padding.long().cumsum(-1) - 1, positions], dim=-1)
    near = torch.nn.functional.pad(key_positions[:, None, :] > positions[:, :, None] - sliding_window, (0, after))
    return {"full_attention": full, "sliding_attention": _additive(visible & near[:, None], dtype)}


def pad_trees(trees: TokenTrees, width: int) -> TokenTrees:
    """`trees` padded to `width` nodes per row with copies of the root under the root (never valid, so never
    accepted), as a compiled verify of fixed width needs."""
    extra = width - trees.ids.shape[1]
    if extra <= 0:
        return trees

    def padded(tensor: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_full((tensor.shape[0], extra), value)], dim=1)

    roots = trees.ids[:, :1].expand(-1, extra)
    return trees._replace(
        ids=torch.cat([trees.ids, roots], dim=1),
        parents=padded(trees.parents, 0),
        depths=padded(trees.depths, 1),
        valid=padded(trees.valid, False),
        from_lookup=padded(trees.from_lookup, False),
    )


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, the dtype's minimum elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


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
    depth: int,
) -> PathAcceptance:
    """Greedy acceptance on trees given by parent pointers: a node is accepted when it is `valid`, its parent was
    accepted and its token is the target's argmax at its parent; the deepest accepted node wins (the first one in
    node order among equals). All tensors are `(batch, W)`; node 0 is the root (its own parent); the deepest node is
    at `depth`."""
    match = valid & (ids == target_tokens.gather(1, parents))
    match[:, 0] = True
    accepted = match
    for _ in range(depth - 1):  # depth-1 nodes are right already; each pass settles one level more
        accepted = match & accepted.gather(1, parents)
    best = torch.where(accepted, depths, -1).argmax(dim=1)
    length = depths.gather(1, best[:, None]).squeeze(1)
    next_token = target_tokens.gather(1, best[:, None]).squeeze(1)
    return PathAcceptance(length, best, next_token, accepted)


def tree_path(parents: torch.LongTensor, best: torch.Tensor, accepted: torch.Tensor, width: int) -> torch.LongTensor:
    """Node indices of each row's path from the root to `best` (`accepted` steps long, fewer than `width`), padded to
    `width` by repeating `best` (the padding is masked out like any short row)."""
    order = best[:, None].repeat(1, width)
    node = best
    for step in range(width):
        depth = (accepted - step).clamp_min(0)[:, None]
        on_path = (accepted >= step)[:, None]
        order.scatter_(1, depth, torch.where(on_path, node[:, None], order.gather(1, depth)))
        node = parents.gather(1, node[:, None]).squeeze(1)
    return order
