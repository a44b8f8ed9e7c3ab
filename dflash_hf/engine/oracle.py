"""Oracle drafts: the DFlash chain's proposal replaced by a known continuation, each slot kept with probability P.

`dflash-hf bench --oracle P` measures the engine's own cost at real sizes without a trained drafter. The drafter's
forward runs as in every cycle (its cost is real); then, on the device, its proposed tokens are replaced by the
target's own greedy continuation (`OracleDrafts.reference`, from a plain greedy run on the same prompt), each slot
kept with probability `keep` and every other slot given a token that differs from the reference. The target accepts
the drafts up to the first slot not kept, so a cycle of block B commits `1 + accepted` tokens with
`tau = (1 - P^B) / (1 - P)` on average (B at P = 1), whatever the drafter.

The output is still the target's own greedy decoding: the oracle only changes what is proposed. Where the engine's
verify argmax differs from the reference (a near-tie in reduced precision), the row leaves the reference and the
oracle's later slots no longer match its text (the bench reports where outputs differ).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from ..runtime import upload
from ..special_tokens import token_ids
from .candidates import DFlashChain, Proposal, Readout
from .rows import ActiveRows


@dataclass(frozen=True)
class OracleDrafts:
    """What an oracle call replays: `reference` `(batch, length)`, each row's new tokens (prompt excluded) as plain
    greedy decoding produced them; `keep`, the probability that a slot keeps its reference token; `seed`, the seed of
    the slots' draws (a call is reproducible)."""

    reference: torch.LongTensor
    keep: float
    seed: int = 0

    def __post_init__(self) -> None:
        reference = self.reference
        if not isinstance(reference, torch.Tensor) or reference.dim() != 2 or reference.dtype != torch.long:
            raise ValueError("The oracle's reference must be a (batch, length) LongTensor of each row's new tokens.")
        if reference.shape[1] < 1:
            raise ValueError("The oracle's reference is empty: pass each row's greedy continuation.")
        if reference.is_meta:
            raise ValueError("The oracle's reference is on the meta device: pass a tensor that holds the token ids.")
        keep = self.keep
        if isinstance(keep, bool) or not isinstance(keep, numbers.Real) or not 0.0 <= float(keep) <= 1.0:
            raise ValueError(f"The oracle's keep probability must lie in [0, 1], got {keep!r}.")


class OracleChain:
    """The DFlash chain whose drafts are replaced by [`OracleDrafts`] (see the module docstring); the drafter's
    forward still runs, inside the chain's draft timer."""

    def __init__(self, chain: DFlashChain, oracle: OracleDrafts, prompt_lengths: torch.LongTensor, vocab_size: int):
        device = prompt_lengths.device
        self.chain, self.timer, self.vocab_size = chain, chain.timer, int(vocab_size)
        self.reference = oracle.reference.to(device)
        self.prompt_lengths = prompt_lengths  # a row's first new token sits at this position
        self.keep = float(oracle.keep)
        self.generator = torch.Generator(device=device).manual_seed(int(oracle.seed))
        self._rows: tuple[tuple[int, ...], torch.LongTensor] | None = None

    def propose(self, state: ActiveRows, block: int, block_pos: torch.LongTensor) -> Proposal:
        """The chain's proposal (one drafter forward) with its drafts replaced by the oracle's."""
        proposal = self.chain.propose(state, block, block_pos)
        if block == 1:  # a plain step: nothing drafted
            return proposal
        with self.timer:
            return proposal._replace(tokens=self.drafts(state.rows, block_pos[:, 1:]))

    def drafts(self, rows: list[int], positions: torch.LongTensor) -> torch.LongTensor:
        """The reference tokens of `rows` at the draft `positions` `(rows, slots)`, each kept with the oracle's
        probability; a slot not kept holds the next token id instead (never the reference's)."""
        index = self._row_index(rows)
        reference = self.reference.index_select(0, index)
        slots = positions - self.prompt_lengths.index_select(0, index)[:, None]
        # past the reference's end a row has stopped at its EOS: what is proposed there is never committed
        tokens = reference.gather(1, slots.clamp(0, reference.shape[1] - 1))
        kept = torch.rand(tokens.shape, generator=self.generator, device=tokens.device) < self.keep
        return torch.where(kept, tokens, (tokens + 1) % self.vocab_size)

    def _row_index(self, rows: list[int]) -> torch.LongTensor:
        """`rows` as an index tensor on the device, built again only when the active rows change."""
        key = tuple(rows)
        if self._rows is None or self._rows[0] != key:
            self._rows = key, upload(list(key), self.reference.device)
        return self._rows[1]

    def learn(self, proposal: Proposal, readout: Readout) -> None:
        """The chain's own learning (none)."""
        self.chain.learn(proposal, readout)

    def observe(self, proposal: Proposal, committed: float, seconds: float) -> None:
        """The chain's own cost following (none)."""
        self.chain.observe(proposal, committed, seconds)


def oracle_chain(
    chain: DFlashChain,
    oracle: OracleDrafts,
    *,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | torch.Tensor | None,
    do_sample: bool,
    candidates: str,
    vocab_size: int,
) -> OracleChain:
    """`chain` wrapped in an [`OracleChain`] once the call can replay `oracle`: greedy decoding, candidates that
    verify the DFlash chain (`"dflash"`, or with a lookup branch), a reference row per prompt of token ids in the
    vocabulary that covers `max_new_tokens` or ends at an EOS token; a `ValueError` naming the fix otherwise."""
    if not isinstance(oracle, OracleDrafts):
        raise ValueError(f"oracle must be an OracleDrafts(reference, keep), got {type(oracle).__name__}.")
    if do_sample:
        raise ValueError("Oracle drafts replay greedy decoding: pass do_sample=False (sampling has no one reference).")
    if candidates == "tree":
        raise ValueError(
            "Oracle drafts replace the DFlash chain's tokens; a draft tree grows from the drafter's own distributions: "
            'pass candidates="dflash" (or "dflash+lookup").'
        )
    reference = oracle.reference
    if reference.shape[0] != prompt_mask.shape[0]:
        raise ValueError(
            f"The oracle's reference has {reference.shape[0]} rows for {prompt_mask.shape[0]} prompts: pass one row of "
            "new tokens per prompt."
        )
    low, high = torch.stack([reference.min(), reference.max()]).tolist()  # the set-up's one read of the reference
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"The oracle's reference holds token ids from {low} to {high}, outside the target's vocabulary "
            f"[0, {vocab_size}): pass token ids only (pad the rows that end early with their EOS token)."
        )
    if reference.shape[1] < max_new_tokens:
        eos = torch.tensor(token_ids(eos_token_id), dtype=torch.long, device=reference.device)
        ended = torch.isin(reference, eos).any(dim=1)
        if not bool(ended.all()):
            short = torch.nonzero(~ended).flatten().tolist()
            raise ValueError(
                f"The oracle's reference holds {reference.shape[1]} tokens per row, fewer than max_new_tokens="
                f"{max_new_tokens}, and rows {short} end at no EOS token: pass the whole greedy continuation (or "
                "lower max_new_tokens)."
            )
    return OracleChain(chain, oracle, prompt_mask.sum(-1), vocab_size)
