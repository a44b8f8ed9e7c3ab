"""Block-size policies: how many tokens to draft and verify in the next cycle.

A cycle with block size `k` drafts `k - 1` tokens and verifies `k` positions; it commits `1 + (accepted drafts)`
tokens. Block size 1 is a plain decoding step: nothing is drafted (the drafter only reads the new context) and the
target verifies the anchor alone, committing its next token. Larger blocks commit more when the drafter is right but cost more to verify (on a CPU a 16-token verify
costs about twice a 1-token step). [`AdaptiveBlockSize`] picks, every cycle, the size with the best expected tokens
per second given the recent acceptance profile and the costs measured on this hardware during this call. Every
size is lossless: the policy only changes speed.
"""

from __future__ import annotations

import math
import numbers
from typing import Protocol


class BlockSizePolicy(Protocol):
    """Chooses the block size of each cycle and learns from what the cycle cost and committed."""

    def next_block_size(self) -> int:
        """Block size for the next cycle (>= 1; 1 is a plain step)."""

    def observe(self, block_size: int, committed: list[int], seconds: float) -> None:
        """Record one cycle: its block size, the tokens committed by every row, and its wall time."""


class FixedBlockSize:
    """Always the same block size."""

    def __init__(self, block_size: int) -> None:
        self.block_size = int(block_size)

    def next_block_size(self) -> int:
        return self.block_size

    def observe(self, block_size: int, committed: list[int], seconds: float) -> None:
        return None


def cost_line(costs: dict[int, float]) -> tuple[float, float, float]:
    """`(mean size, mean cost, slope)` of the least-squares line through measured costs per size (slope 0 with
    fewer than two sizes)."""
    sizes = sorted(costs)
    mean_k = sum(sizes) / len(sizes)
    mean_c = sum(costs[k] for k in sizes) / len(sizes)
    spread = sum((k - mean_k) ** 2 for k in sizes)
    slope = sum((k - mean_k) * (costs[k] - mean_c) for k in sizes) / spread if spread else 0.0
    return mean_k, mean_c, slope


class AdaptiveBlockSize:
    """Pick the block size that maximises expected committed tokens per second.

    * Acceptance profile: for every draft slot `i`, the probability that slot `i` is accepted given that slots
      `1..i-1` were, as an exponentially decayed count with a Beta(1, 1) prior (so a slot never verified yet is
      optimistic and gets explored; slots left unverified drift back to the prior, so larger blocks are re-tried
      now and then). Expected tokens with block `k`: `1 + sum_j prod_{i<=j} a_i` for `j < k`.
    * Costs: the wall time of a cycle at every size tried, as an exponentially decayed mean, and a straight line
      `cost(k) = a + b * k` fitted through those means for the sizes not tried yet. The largest and the smallest
      candidate are tried first (two cycles of exploration), then every cycle takes the best expected rate.
    * A plain step (block size 1, expected tokens 1) is a candidate too: where drafting and verifying a block costs
      more than the tokens it adds (a long context, a weak drafter), decoding falls back to plain steps. During plain
      steps the acceptance profile drifts back to the prior more slowly (`plain_step_decay`), so a block is re-tried
      every twenty-odd steps, and kept when it pays.

    Args:
        max_block_size: The drafter's trained block size (the largest candidate).
        candidates: Block sizes to choose from (default: 1 (a plain step), 2, 4, 6, 8, 12, 16, ... up to
            `max_block_size`).
        decay: Weight of the past per new observation (0.9 keeps roughly the last ten cycles).
        plain_step_decay: Weight of the acceptance profile's past per plain step.
    """

    def __init__(
        self,
        max_block_size: int,
        candidates: list[int] | None = None,
        decay: float = 0.9,
        plain_step_decay: float = 0.975,
    ) -> None:
        if max_block_size < 2:
            raise ValueError(f"max_block_size must be >= 2, got {max_block_size}.")
        if candidates is None:
            candidates = sorted({k for k in (1, 2, 4, 6, 8, 12, 16, 24, 32) if k <= max_block_size} | {max_block_size})
        bad = [k for k in candidates if not 1 <= int(k) <= max_block_size]
        if bad or not candidates:
            raise ValueError(f"candidate block sizes must lie in 1..{max_block_size}, got {list(candidates)}.")
        if not (0.0 < decay < 1.0 and 0.0 < plain_step_decay < 1.0):
            raise ValueError(f"decay and plain_step_decay must be in (0, 1), got {decay} and {plain_step_decay}.")
        self.candidates = sorted(int(k) for k in candidates)
        self.max_block_size = max(self.candidates)
        self.decay = decay
        self.plain_step_decay = plain_step_decay
        slots = self.max_block_size - 1
        self._reached = [0.0] * slots  # decayed number of cycles in which slot i was verified after slots < i passed
        self._accepted = [0.0] * slots
        self._cost: dict[int, float] = {}

    def acceptance_profile(self) -> list[float]:
        """Estimated conditional acceptance probability of each draft slot (1-based slot `i` at index `i - 1`)."""
        return [(acc + 1.0) / (reached + 2.0) for acc, reached in zip(self._accepted, self._reached)]

    def expected_tokens(self, block_size: int) -> float:
        """Expected tokens committed per cycle with `block_size` under the current acceptance profile."""
        total, survive = 1.0, 1.0
        for prob in self.acceptance_profile()[: block_size - 1]:
            survive *= prob
            total += survive
        return total

    def estimated_cost(self, block_size: int) -> float:
        """Measured mean cycle time at `block_size`, or the straight-line fit through the measured sizes."""
        if block_size in self._cost:
            return self._cost[block_size]
        mean_k, mean_c, slope = cost_line(self._cost)
        return max(mean_c + max(slope, 0.0) * (block_size - mean_k), 1e-9)

    def next_block_size(self) -> int:
        for size in (self.candidates[-1], self.candidates[0]):
            if size not in self._cost:
                return size
        return max(self.candidates, key=lambda k: self.expected_tokens(k) / self.estimated_cost(k))

    def observe(self, block_size: int, committed: list[int], seconds: float) -> None:
        if not committed or not math.isfinite(seconds):
            return
        old = self._cost.get(block_size)
        self._cost[block_size] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        weight = 1.0 / len(committed)
        decay = self.plain_step_decay if block_size == 1 else self.decay
        self._reached = [decay * r for r in self._reached]
        self._accepted = [decay * a for a in self._accepted]
        for tokens in committed:
            accepted_drafts = tokens - 1
            for slot in range(min(block_size - 1, len(self._reached))):
                if slot > accepted_drafts:
                    break
                self._reached[slot] += weight
                if slot < accepted_drafts:
                    self._accepted[slot] += weight


class BoundedBlockSize:
    """A caller's policy object, held to block sizes 2..`trained_block_size` (drafters do not generalise to blocks
    larger than they were trained on). It keeps learning through `observe`.

    Raises a `ValueError` when the policy declares a larger `max_block_size` (or `block_size`), or proposes a size
    outside 1..`max_block_size` (1: a plain step).
    """

    def __init__(self, policy: BlockSizePolicy, trained_block_size: int) -> None:
        declared = getattr(policy, "max_block_size", getattr(policy, "block_size", trained_block_size))
        if isinstance(declared, bool) or not isinstance(declared, numbers.Integral) or declared > trained_block_size:
            raise ValueError(
                f"The block-size policy {type(policy).__name__} drafts blocks of up to {declared!r} tokens but the "
                f"drafter was trained on blocks of {trained_block_size}: build it for at most {trained_block_size} "
                f"(e.g. `AdaptiveBlockSize({trained_block_size})`)."
            )
        self.policy = policy
        self.max_block_size = int(declared)

    def next_block_size(self) -> int:
        size = self.policy.next_block_size()
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or not 1 <= size <= self.max_block_size:
            raise ValueError(
                f"The block-size policy {type(self.policy).__name__} proposed block size {size!r}: "
                f"`next_block_size()` must return an int in 1..{self.max_block_size} (1: a plain step)."
            )
        return int(size)

    def observe(self, block_size: int, committed: list[int], seconds: float) -> None:
        self.policy.observe(block_size, committed, seconds)


def make_block_size_policy(block_size: int | str | BlockSizePolicy | None, trained_block_size: int) -> BlockSizePolicy:
    """Turn a `block_size` argument (None, an int, `"adaptive"` or a policy object) into a policy."""
    if block_size is None:
        return FixedBlockSize(trained_block_size)
    if isinstance(block_size, str):
        if block_size != "adaptive":
            raise ValueError(f"block_size must be an int, 'adaptive' or a BlockSizePolicy, got {block_size!r}.")
        return AdaptiveBlockSize(trained_block_size)
    if hasattr(block_size, "next_block_size") and hasattr(block_size, "observe"):
        return BoundedBlockSize(block_size, trained_block_size)
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise ValueError(f"block_size must be an int, 'adaptive' or a BlockSizePolicy, got {block_size!r}.")
    size = int(block_size)
    if size < 2:
        raise ValueError(f"block_size must be >= 2 (anchor + at least one drafted token), got {size}.")
    if size > trained_block_size:
        raise ValueError(
            f"block_size {size} exceeds the drafter's trained block size {trained_block_size}; drafters generalise to "
            "smaller blocks, not larger ones."
        )
    return FixedBlockSize(size)
