"""Verification: one target forward over a cycle's candidates, and the target's verdict on them.

The chain is verified by a causal forward over `[anchor, drafts]` (greedy prefix match or rejection sampling, through
the call's `token_choice.TokenChoice`); trees by a forward over their nodes with an ancestor mask, each row keeping its
longest accepted path (`tree`). In reduced precision on CPU the forward runs row-exact (`target.row_exact`) so that
every token gets the bits a one-token step gives it.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import CompileConfig

from ..runtime import Stopwatch
from ..target import row_exact
from ..target.adapter import TargetAdapter
from ..target.linear_attention import LINEAR_ATTENTION, LinearAttentionStates, path_batch
from ..target.windows import sliding_window_of
from .cache_ops import attention_layer
from .candidates import Proposal, Verdict
from .rows import ActiveRows
from .token_choice import TokenChoice
from .tree import accept_tree, ancestor_mask, pad_trees, tree_attention_mask, tree_path


def row_exact_verification(target: PreTrainedModel, verify_width: int) -> bool:
    """Whether verify forwards must run row-exact (a bf16/fp16 target on CPU, see `row_exact`); warns once if that
    cannot be made bit-exact on this machine."""
    exact = row_exact.install_if_needed(target, verify_width)
    if exact is False:
        warnings.warn(
            f"Verifying {verify_width}-token blocks in {str(target.dtype).replace('torch.', '')} on this CPU does not "
            "give every token the bits a one-token step gives it, so greedy outputs may drift from plain greedy "
            "decoding: load the target in float32 for exact outputs (or use `sdpa` attention, which dflash-hf can "
            "make row-exact).",
            stacklevel=6,
        )
    return bool(exact)


class Verifier:
    """The verify forwards of one call, on its target cache; `verify_width` is the widest verify it will run.

    With a `compile_config` (and a static cache), every forward runs compiled at a fixed shape: trees padded to
    `verify_width`, masks over the whole cache (`compilation`); row-exact verification is then not installed."""

    def __init__(
        self,
        adapter: TargetAdapter,
        cache: Cache,
        choice: TokenChoice,
        verify_width: int,
        timer: Stopwatch,
        compile_config: CompileConfig | None = None,
        linear_states: LinearAttentionStates | None = None,
    ) -> None:
        self.adapter, self.cache, self.choice, self.timer = adapter, cache, choice, timer
        self.linear_states = linear_states
        self.verify_width, self.compile_config = verify_width, compile_config
        self.row_exact = compile_config is None and row_exact_verification(adapter.target, verify_width)
        target = adapter.target
        if compile_config is not None and target.device.type == "cpu" and target.dtype != torch.float32:
            warnings.warn(
                f"compile=True verifies blocks in compiled {str(target.dtype).replace('torch.', '')} forwards, which on "
                "a CPU do not give each token the bits of a one-token step: the output may drift from plain greedy "
                "decoding. The eager engine (compile=False) verifies row-exact and is exact in this precision.",
                stacklevel=6,
            )
        self.sliding_window = sliding_window_of(adapter.target.config)
        self.keys = attention_layer(cache).max_cache_len if compile_config is not None else None

    @staticmethod
    def _layer_masks(mask: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """A hybrid target's masks by layer type, made here: the attention layers' 4-D ones, and none for its
        linear-attention layers, whose verified tokens are never padding (left to Transformers, a padded batch's 2-D
        mask would be read on the host to find that out)."""
        masks = dict(mask) if isinstance(mask, dict) else {"full_attention": mask}
        return {**masks, LINEAR_ATTENTION: None}

    def _new_keys(self, state: ActiveRows, width: int) -> int:
        """Positions the verify's mask adds after the cached ones: the verified ones, or the rest of a static
        cache."""
        return width if self.keys is None else self.keys - state.mask.shape[1]

    def verify(self, state: ActiveRows, block_pos: torch.LongTensor, proposal: Proposal) -> Verdict:
        """The target's verdict on `proposal`, whose candidates enter the target cache (the caller keeps the path).
        The verify timer covers the forward and the token choice on its logits."""
        if proposal.trees is None:
            return self._chain(state, block_pos, proposal)
        return self._trees(state, block_pos, proposal)

    def _chain(self, state: ActiveRows, block_pos: torch.LongTensor, proposal: Proposal) -> Verdict:
        block_ids = torch.cat([state.anchors[:, None], proposal.tokens], dim=1)
        recording = self.linear_states.verifying() if self.linear_states is not None else contextlib.nullcontext()
        with self.timer, row_exact.verification(self.row_exact), recording:
            mask = state.attention_mask(self._new_keys(state, block_ids.shape[1]))
            if self.linear_states is not None and mask is not None:
                width = block_ids.shape[1]
                causal = torch.ones(width, width, dtype=torch.bool, device=block_ids.device).tril()
                dtype = self.adapter.embed_tokens.weight.dtype
                causal = causal.expand(len(state.rows), -1, -1)
                mask = self._layer_masks(
                    tree_attention_mask(state.mask, causal, dtype, block_pos, self.sliding_window, self.keys)
                )
            step = self.adapter.forward(block_ids, mask, block_pos, self.cache, self.compile_config)
            target_logits = self.adapter.logits(step.last_hidden_state)
            accepted, next_tokens = self.choice.accept(
                target_logits, block_ids, proposal.tokens, proposal.probs, state.rows
            )
        return Verdict(accepted, next_tokens, step, proposal.tokens, [proposal.block] * len(state.rows))

    def _trees(self, state: ActiveRows, block_pos: torch.LongTensor, proposal: Proposal) -> Verdict:
        trees = proposal.trees if self.compile_config is None else pad_trees(proposal.trees, self.verify_width)
        positions = block_pos[:, :1] + trees.depths
        sees = ancestor_mask(trees.parents, trees.depth)
        recording = contextlib.nullcontext()
        if self.linear_states is not None:  # each root-to-leaf path on a recurrent state of its own
            paths = path_batch(trees.parent_lists, trees.ids.shape[1], trees.ids.device)
            recording = self.linear_states.verifying(paths)
        with self.timer, row_exact.verification(self.row_exact), recording:
            dtype = self.adapter.embed_tokens.weight.dtype
            mask = tree_attention_mask(state.mask, sees, dtype, positions, self.sliding_window, self.keys)
            if self.linear_states is not None:
                mask = self._layer_masks(mask)
            step = self.adapter.forward(trees.ids, mask, positions, self.cache, self.compile_config)
            target_tokens = self.choice.node_tokens(self.adapter.logits(step.last_hidden_state), state.rows)
        result = accept_tree(trees.ids, trees.parents, trees.depths, trees.valid, target_tokens, trees.depth)
        order = tree_path(trees.parents, result.best, result.accepted, trees.depth + 1)
        return Verdict(
            accepted=result.accepted,
            next_tokens=result.next_token,
            step=step,
            path=trees.ids.gather(1, order)[:, 1:],
            widths=trees.widths,
            block_kept=result.node_accepted[:, 1 : proposal.block].sum(dim=1) + 1,
            order=order,
            node_accepted=result.node_accepted,
            lookup_won=trees.from_lookup.gather(1, result.best[:, None]).squeeze(1),
        )
