"""A draft tree per row over the drafter's own per-slot distributions, grown best-first within a cost-aware budget.

Node 0 is the anchor; a node at depth `d` holds a candidate for draft slot `d`, and its children are candidates for
slot `d + 1`: the top tokens of that slot's drafter distribution ([`SlotCandidates`]; with a Markov head the slot's
logits are corrected for the node's own token, as the chain's drafts are). A node's score is the chance that it is
accepted: the product of the drafter's probabilities along its path, calibrated by the acceptance this call observes
at its depth ([`DepthCalibration`]: observed over predicted), never above its parent's. [`grow_tree`] always keeps
the chain (each slot's top token after the one before: the DFlash block the block-size policy chose), then adds the
best-scoring candidate nodes one at a time while their score is at least what verifying one more token costs
([`TreeBudget`]) and at most `max_nodes` are added. The prompt-lookup continuation is one more branch: it leaves the
chain where it first differs from it and its nodes are scored by the lookup branch's own observed acceptance per
depth. One target forward verifies all trees ([`pack_trees`] packs them as `engine.tree.TokenTrees`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..runtime import upload
from .block_size import cost_line
from .tree import TokenTrees

DEFAULT_TREE_NODES = 16  # most nodes a tree verifies beyond the DFlash block (side branches and lookup tokens)
TREE_CHILDREN = 4  # candidates considered under a node: its next slot's top tokens
MIN_NODE_PROBABILITY = 0.05  # a node less likely than this to be accepted is never verified, whatever it costs
# before two verify widths are measured, one more verified token is taken to cost 1/16 of a cycle (on the CPUs of
# docs/design.md a 16-token verify costs about twice a one-token step)
PRIOR_COST_PER_TOKEN = 1 / 16

# the children of a node at `depth` holding `token`: probabilities (descending) and tokens for slot `depth + 1`
Children = Callable[[int, int], tuple[list[float], list[int]]]


@dataclass
class DraftTree:
    """One row's draft tree. Node `i` holds `tokens[i]` at depth `depths[i]` under `parents[i]` (node 0, the anchor, is
    its own parent); nodes `1..chain` are the DFlash chain, added first, the others follow in best-first order."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [0])
    depths: list[int] = field(default_factory=lambda: [0])
    predicted: list[float] = field(default_factory=lambda: [1.0])  # the drafter's path probability (lookup: 1)
    scores: list[float] = field(default_factory=lambda: [1.0])  # calibrated chance of acceptance
    from_lookup: list[bool] = field(default_factory=lambda: [False])
    chain: int = 0
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int) -> int | None:
        """The node holding `token` under `parent`, if there is one."""
        return self._children.get((parent, token))

    def add(self, parent: int, token: int, predicted: float, score: float, from_lookup: bool = False) -> int:
        """Append a node under `parent`; returns its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.predicted.append(predicted)
        self.scores.append(score)
        self.from_lookup.append(from_lookup)
        self._children[(parent, token)] = len(self.tokens) - 1
        return len(self.tokens) - 1


def grow_tree(
    anchor: int,
    children: Children,
    slots: int,
    min_probability: float,
    max_nodes: int,
    calibrate: Callable[[int, float], float] = lambda depth, predicted: predicted,
    lookup: Sequence[int] = (),
    lookup_score: Callable[[int], float] = lambda depth: 1.0,
) -> DraftTree:
    """The chain of `slots` drafts, then up to `max_nodes` more nodes best-first while their score is at least
    `min_probability` (see the module docstring).

    `calibrate(depth, predicted)` turns a drafter path probability into a node's chance of acceptance;
    `lookup_score(depth)` is a lookup node's. A candidate equal to a node already under the same parent is skipped."""
    tree = DraftTree([anchor])
    frontier: list[tuple[float, int, int, int]] = []  # (-score, arrival, parent, rank; a lookup index as -1 - i)
    arrival = itertools.count()

    def score(parent: int, value: float) -> float:
        return min(tree.scores[parent], value)

    def push_child(parent: int, rank: int) -> None:
        probs, tokens = children(tree.depths[parent], tree.tokens[parent])
        if rank < len(tokens):
            value = score(parent, calibrate(tree.depths[parent] + 1, tree.predicted[parent] * probs[rank]))
            heapq.heappush(frontier, (-value, next(arrival), parent, rank))

    def push_lookup(parent: int, index: int) -> None:
        if index < len(lookup):
            value = score(parent, lookup_score(tree.depths[parent] + 1))
            heapq.heappush(frontier, (-value, next(arrival), parent, -1 - index))

    node = 0
    for _ in range(slots):
        probs, tokens = children(tree.depths[node], tree.tokens[node])
        push_child(node, 1)
        predicted = tree.predicted[node] * probs[0]
        node = tree.add(node, tokens[0], predicted, score(node, calibrate(tree.depths[node] + 1, predicted)))
    tree.chain = slots
    shared = 0  # the lookup branch follows the chain as long as their tokens agree
    while shared < min(slots, len(lookup)) and lookup[shared] == tree.tokens[shared + 1]:
        shared += 1
    push_lookup(shared, shared)
    while frontier and len(tree) - 1 - slots < max_nodes:
        negative, _, parent, rank = heapq.heappop(frontier)
        if -negative < min_probability:
            break
        if rank < 0:
            index = -1 - rank
            node = tree.child(parent, lookup[index])
            if node is None:
                node = tree.add(parent, lookup[index], 1.0, -negative, from_lookup=True)
            push_lookup(node, index + 1)
            continue
        probs, tokens = children(tree.depths[parent], tree.tokens[parent])
        push_child(parent, rank + 1)
        if tree.child(parent, tokens[rank]) is not None:
            continue
        node = tree.add(parent, tokens[rank], tree.predicted[parent] * probs[rank], -negative)
        if tree.depths[node] < slots:
            push_child(node, 0)
    return tree


def corrected_logits(
    markov_head, logits: torch.Tensor, previous: torch.LongTensor, hidden_states: torch.Tensor
) -> torch.Tensor:
    """Slot logits plus the Markov head's correction for the tokens `previous` before those slots (`hidden_states`:
    the slots' final hidden states, read by the gated head); a non-finite correction (a diverged head) has no say."""
    bias = markov_head(previous, hidden_states).to(logits.dtype)
    return logits + bias.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class SlotCandidates:
    """The children of the tree nodes of a batch of rows: the `top` most likely tokens of the next draft slot.

    `logits` `(batch, slots, draft vocabulary)` are the drafter's slot logits; `probabilities` turns logits
    `(n, draft vocabulary)` into the processed distributions `(n, vocabulary)` the drafter proposes from, whose
    indices `token_ids` maps to target ids (`None`: they are target ids). With a `markov_head`, slot `d + 1`'s logits
    are corrected for the token of the node at depth `d` ([`corrected_logits`], `hidden_states` `(batch, slots,
    hidden)`), so each node's children follow its own token; without one, every node at a depth has the same.

    The children are read from the device at once: every slot's without a Markov head; with one and the rows'
    `anchors`, those of every node whose parent is on the chain (the chain's own included); a node further off the
    chain has its children read when the search reaches it."""

    def __init__(
        self,
        logits: torch.Tensor,
        probabilities: Callable[[torch.Tensor], torch.Tensor],
        token_ids: torch.LongTensor | None = None,
        markov_head=None,
        hidden_states: torch.Tensor | None = None,
        top: int = TREE_CHILDREN,
        anchors: torch.LongTensor | None = None,
    ) -> None:
        self.logits, self.probabilities, self.token_ids = logits, probabilities, token_ids
        self.markov_head, self.hidden_states = markov_head, hidden_states
        self.top = top
        self._cache: dict[tuple[int, int, int], tuple[list[float], list[int]]] = {}
        if markov_head is None:
            batch, slots, _ = logits.shape
            probs, tokens = self._read(*self._top(logits.reshape(batch * slots, -1)))
            for index, (p, t) in enumerate(zip(probs, tokens)):
                self._cache[(index // slots, index % slots, -1)] = (p, t)
        elif anchors is not None:
            self._read_near_chain(anchors)

    def _top(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.LongTensor]:
        """The top probabilities and tokens `(n, top)` of each row of `logits` `(n, draft vocabulary)`."""
        probs = self.probabilities(logits)
        values, indices = probs.topk(min(self.top, probs.shape[-1]), dim=-1)
        return values, indices if self.token_ids is None else self.token_ids[indices]

    @staticmethod
    def _read(values: torch.Tensor, tokens: torch.LongTensor) -> tuple[list, list]:
        """`values` and `tokens` (same shape) read from the device at once, as lists."""
        values, tokens = torch.stack([values.double(), tokens.double()]).tolist()  # token ids are exact in float64
        return values, [[int(token) for token in row] for row in tokens]

    def _corrected_top(self, depth: int, previous: torch.LongTensor) -> tuple[torch.Tensor, torch.LongTensor]:
        """The top children `(batch, n, top)` of the nodes at `depth` holding `previous` `(batch, n)`."""
        batch, n = previous.shape
        logits = self.logits[:, depth, None].expand(-1, n, -1)
        hidden = self.hidden_states[:, depth, None].expand(-1, n, -1)
        values, tokens = self._top(corrected_logits(self.markov_head, logits, previous, hidden).flatten(0, 1))
        return values.view(batch, n, -1), tokens.view(batch, n, -1)

    def _read_near_chain(self, anchors: torch.LongTensor) -> None:
        """With a Markov head: the children of every node whose parent is on the chain, slot by slot on the device
        (each depth's nodes are the top children of the chain's node above), read at once."""
        previous, depths, tables = anchors[:, None], [], []
        for depth in range(self.logits.shape[1]):
            values, tokens = self._corrected_top(depth, previous)
            tables.append(torch.cat([previous[..., None].double(), values.double(), tokens.double()], dim=-1))
            depths += [depth] * previous.shape[1]
            previous = tokens[:, 0]  # the chain node's children: the next depth's nodes under the chain
        top = tables[0].shape[-1] // 2
        for row, entries in enumerate(torch.cat(tables, dim=1).tolist()):
            for depth, (parent, *table) in zip(depths, entries):
                self._cache[(row, depth, int(parent))] = (table[:top], [int(token) for token in table[top:]])

    def for_row(self, row: int) -> Children:
        """The [`Children`] function of batch row `row`'s tree."""

        def children(depth: int, token: int) -> tuple[list[float], list[int]]:
            key = (row, depth, -1 if self.markov_head is None else token)
            if key not in self._cache:
                previous = upload([token], self.logits.device)
                logits = corrected_logits(
                    self.markov_head, self.logits[row, depth][None], previous, self.hidden_states[row, depth][None]
                )
                probs, tokens = self._read(*self._top(logits))
                self._cache[key] = (probs[0], tokens[0])
            return self._cache[key]

        return children


class DepthCalibration:
    """Calibrated acceptance probabilities: per tree depth, the acceptances observed in this call over those predicted
    (exponentially decayed sums per cycle, with a prior of one of each, so a depth not verified yet trusts the
    prediction and a depth left unverified drifts back to it), times the predicted probability, at most 1."""

    def __init__(self, decay: float = 0.9, prior: float = 1.0) -> None:
        self.decay, self.prior = decay, prior
        self.predicted: list[float] = []
        self.observed: list[float] = []

    def ratio(self, depth: int) -> float:
        """Observed over predicted acceptances at `depth` (1-based)."""
        if depth > len(self.predicted):
            return 1.0
        return (self.observed[depth - 1] + self.prior) / (self.predicted[depth - 1] + self.prior)

    def __call__(self, depth: int, predicted: float) -> float:
        return min(1.0, predicted * self.ratio(depth))

    def observe(self, nodes: Iterable[tuple[int, float, bool]]) -> None:
        """Record one cycle's verified nodes as `(depth, predicted probability, accepted)`."""
        self.predicted = [self.decay * value for value in self.predicted]
        self.observed = [self.decay * value for value in self.observed]
        for depth, predicted, accepted in nodes:
            while len(self.predicted) < depth:
                self.predicted.append(0.0)
                self.observed.append(0.0)
            self.predicted[depth - 1] += predicted
            self.observed[depth - 1] += float(accepted)


def node_threshold(marginal_cost: float, rate: float, floor: float = MIN_NODE_PROBABILITY) -> float:
    """The least chance of acceptance worth verifying a node for: verifying it adds its chance `q` to a cycle's
    expected committed tokens and `marginal_cost` seconds to its time, which raises a rate of `rate` committed tokens
    per second only when `q / marginal_cost > rate`, i.e. `q > marginal_cost * rate`; at least `floor`, at most 1."""
    return min(1.0, max(floor, marginal_cost * rate))


class TreeBudget:
    """The cost side of the draft tree, measured in this call: the rate (committed tokens per second per row, decayed
    sums) and the marginal cost of one more verified token (the slope of the least-squares line through the mean cycle
    time at each verify width, [`cost_line`]; [`PRIOR_COST_PER_TOKEN`] of the mean cycle while one width is known).
    [`threshold`] is [`node_threshold`] of the two; before the first cycle it is the floor, so the first trees are the
    widest and their cost gets measured. Where verifying costs nothing more per token the trees grow to `max_nodes`."""

    def __init__(
        self, max_nodes: int = DEFAULT_TREE_NODES, floor: float = MIN_NODE_PROBABILITY, decay: float = 0.9
    ) -> None:
        self.max_nodes, self.floor, self.decay = int(max_nodes), float(floor), float(decay)
        self._cost: dict[int, float] = {}
        self._tokens = self._seconds = 0.0

    def marginal_cost(self) -> float | None:
        """Seconds one more verified token adds to a cycle, `None` before the first cycle."""
        if not self._cost:
            return None
        _, mean_cost, slope = cost_line(self._cost)
        return max(slope, 0.0) if len(self._cost) > 1 else PRIOR_COST_PER_TOKEN * mean_cost

    def rate(self) -> float | None:
        """Committed tokens per second per row, `None` before the first cycle."""
        return self._tokens / self._seconds if self._seconds > 0 else None

    def threshold(self) -> float:
        """The least calibrated chance of acceptance a node needs to be verified."""
        cost, rate = self.marginal_cost(), self.rate()
        return self.floor if cost is None or rate is None else node_threshold(cost, rate, self.floor)

    def observe(self, width: int, committed: float, seconds: float) -> None:
        """Record one cycle: its verify width (tokens per row), the mean tokens committed per row, its wall time."""
        old = self._cost.get(width)
        self._cost[width] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self._tokens = self.decay * self._tokens + committed
        self._seconds = self.decay * self._seconds + seconds


class DraftTreeSearch:
    """The draft trees of one generation call: their budget and the calibration of drafter and lookup nodes, learned
    from every cycle's verification."""

    def __init__(self, max_nodes: int = DEFAULT_TREE_NODES) -> None:
        self.budget = TreeBudget(max_nodes)
        self.drafts = DepthCalibration()
        self.lookups = DepthCalibration()

    def grow(
        self, anchors: list[int], candidates: SlotCandidates, slots: int, lookups: list[list[int]]
    ) -> list[DraftTree]:
        """Every row's tree: `slots` chain drafts, side branches and the row's lookup continuation, in budget."""
        threshold, max_nodes = self.budget.threshold(), self.budget.max_nodes

        def lookup_score(depth: int) -> float:
            return self.lookups(depth, 1.0)

        return [
            grow_tree(anchor, candidates.for_row(i), slots, threshold, max_nodes, self.drafts, lookup, lookup_score)
            for i, (anchor, lookup) in enumerate(zip(anchors, lookups))
        ]

    def observe(self, trees: list[DraftTree], node_accepted: list[list[bool]]) -> None:
        """Calibrate from one cycle: which nodes of each verified tree were accepted."""
        drafts, lookups = [], []
        for tree, accepted in zip(trees, node_accepted):
            for node in range(1, len(tree)):
                entry = (tree.depths[node], tree.predicted[node], accepted[node])
                (lookups if tree.from_lookup[node] else drafts).append(entry)
        self.drafts.observe(drafts)
        self.lookups.observe(lookups)


def pack_trees(trees: list[DraftTree], device: torch.device) -> TokenTrees:
    """The rows' trees as one [`TokenTrees`], padded to the widest with copies of the root under the root (never
    valid, so never accepted)."""
    width = max(len(tree) for tree in trees)

    def padded(tree: DraftTree) -> list[list[int]]:
        pad = width - len(tree)
        return [
            tree.tokens + [tree.tokens[0]] * pad,
            tree.parents + [0] * pad,
            tree.depths + [1] * pad,
            [1] * len(tree) + [0] * pad,
            [int(node) for node in tree.from_lookup] + [0] * pad,
        ]

    ids, parents, depths, valid, from_lookup = upload([padded(tree) for tree in trees], device).unbind(1)
    depth = max(max(tree.depths) for tree in trees)
    widths = [len(tree) for tree in trees]
    return TokenTrees(
        ids, parents, depths, valid.bool(), from_lookup.bool(), depth, widths, [list(tree.parents) for tree in trees]
    )
