"""Target adapters: one object that knows how to run a target LLM for DFlash.

It captures only the tapped decoder layers, through the forward call itself (Transformers' selective
`output_hidden_states=[i + 1, ...]`, recorded per call in a context variable, so concurrent calls on one target never
see each other's states), computes LM-head logits only where the caller needs them, embeds block tokens with the
target's own (possibly scaled) embedding and applies the target's final-logit softcapping.

Tap `i` is `hidden_states[i + 1]` in Transformers terms: the output of decoder layer `i`, and for the last layer the
final normed hidden state (as in Transformers' native DFlash path).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import CompileConfig

from ..modeling import DFlashDraftModel
from ..runtime import compiled_call, forwards_alone
from ..transformers_compat import cache_keyword
from . import row_exact
from .grouped_attention import grouped_attention, uses_grouped_attention
from .support import check_built_for, check_supported, text_config

# oneDNN-prepacked copies of frozen LM-head weights (the few most recent ones). On CPU in fp32 a prepacked head is
# faster than `nn.Linear` for the 1-16 rows a decode step needs (`dflash-hf profile`'s matmul rows time the head this
# way). Entries hold the weight itself, so an identity check can never match a different tensor that reused the
# same memory.
_PREPACKED: "OrderedDict[int, tuple[torch.Tensor, int, nn.Module]]" = OrderedDict()
_PREPACKED_MAX = 4
_PREPACKED_LOCK = threading.Lock()


def _can_prepack(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        hidden_states.device.type == "cpu"
        and weight.dtype == torch.float32
        and hidden_states.dtype == torch.float32
        and not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
        and torch.backends.mkldnn.is_available()
    )


def _prepacked_linear(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`hidden_states @ weight.T` through a oneDNN-prepacked copy of `weight`, re-packed if the weight changed."""
    with _PREPACKED_LOCK:  # concurrent generate calls share the table
        entry = _PREPACKED.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")  # no random init
            linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
            with warnings.catch_warnings():  # torch's MkldnnLinear is a ScriptModule: silence its deprecation notice
                warnings.simplefilter("ignore", DeprecationWarning)
                from torch.utils import mkldnn

                packed = mkldnn.to_mkldnn(linear)
            entry = (weight, weight._version, packed)
            _PREPACKED[id(weight)] = entry
            while len(_PREPACKED) > _PREPACKED_MAX:
                _PREPACKED.popitem(last=False)
        _PREPACKED.move_to_end(id(weight))
    flat = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
    return entry[2](flat).view(*hidden_states.shape[:-1], weight.shape[0])


def head_projection(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(hidden_states, weight, bias)` the engine's way: through a oneDNN-prepacked weight where that is faster
    (a bias-free float32 head on CPU), else `nn.functional.linear`."""
    if bias is None and _can_prepack(hidden_states, weight):
        return _prepacked_linear(hidden_states, weight)
    # As rows of a matrix: `linear` on a strided 3-D slice (the drafter's block minus its anchor) would run a batched
    # matmul on a transposed copy of the whole weight, every call (every draft would copy the LM head).
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    return nn.functional.linear(flat, weight, bias).view(*hidden_states.shape[:-1], weight.shape[0])


class _EngineLMHead(nn.Module):
    """The target's LM head computed the way the engine computes verification logits (prepacked where it can)."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return head_projection(hidden_states, self.head.weight, self.head.bias)


def _prepacks_head(target: PreTrainedModel) -> bool:
    head = target.get_output_embeddings()
    return target.device.type == "cpu" and head.bias is None and head.weight.dtype == torch.float32


def uses_engine_kernels(target: PreTrainedModel) -> bool:
    """Whether the engine computes `target`'s own layers with other kernels than `target.generate` does (today: the
    oneDNN-prepacked LM head of a float32 target on CPU, and grouped-query `sdpa` attention on CPU without key/value
    copies, `target.grouped_attention`; a row-exact target runs its own `sdpa` bits instead), so that a fair plain
    baseline needs them too."""
    return _prepacks_head(target) or (uses_grouped_attention(target) and not row_exact.is_row_exact(target))


@contextlib.contextmanager
def engine_kernels(target: PreTrainedModel) -> Iterator[None]:
    """Within this block `target`'s own forward computes its layers with the engine's kernels (see
    [`uses_engine_kernels`]): plain decoding with the same kernels as the engine, for honest baselines."""
    head = target.get_output_embeddings()
    prepack = _prepacks_head(target)
    if prepack:
        target.set_output_embeddings(_EngineLMHead(head))
    try:
        with grouped_attention(target):
            yield
    finally:
        if prepack:
            target.set_output_embeddings(head)


def _softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


@dataclass
class TargetStep:
    """Result of one target forward: final normed hidden states and the concatenated tapped layer outputs."""

    last_hidden_state: torch.Tensor
    context_hidden_states: torch.Tensor


class TargetAdapter:
    """Runs a supported decoder-only target for DFlash drafting and verification."""

    def __init__(
        self, target: PreTrainedModel, target_layer_ids: list[int], built_for: PreTrainedConfig | None = None
    ) -> None:
        """`built_for`: the drafter's config, checked against the target before its layer ids are; its
        `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` decide how the block is embedded
        ([`embed`]) and how draft logits are made ([`draft_logits`])."""
        check_supported(target)
        config = text_config(target)
        if built_for is not None:
            check_built_for(built_for, target)
        self.target = target
        self.config = config
        self.base_model: nn.Module = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        self.layers: nn.ModuleList = self.base_model.layers
        self.lm_head: nn.Linear = target.get_output_embeddings()
        self.embed_tokens: nn.Module = target.get_input_embeddings()
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.multiplier = float(getattr(config, "output_multiplier", None) or 1.0)  # Muse-Glimmer's, before the cap
        self.block_embedding_scale: float | None = getattr(built_for, "input_embedding_scale", None)
        self.draft_multiplier = float(getattr(built_for, "output_multiplier", None) or 1.0)
        draft_softcap = getattr(built_for, "final_logit_softcapping", None)
        self.draft_softcap: float | None = self.softcap if draft_softcap is None else (float(draft_softcap) or None)
        num_layers = len(self.layers)
        for layer_id in target_layer_ids:
            if not 0 <= layer_id < num_layers:
                raise ValueError(
                    f"target_layer_ids {list(target_layer_ids)} is out of range for this {num_layers}-layer "
                    f"target (valid ids: 0..{num_layers - 1})."
                )
        self.target_layer_ids = list(target_layer_ids)
        self._hidden_state_indices = [i + 1 for i in self.target_layer_ids]
        self._head_rows_key: tuple | None = None
        self._head_rows_cache: torch.Tensor | None = None
        self._cache_kwarg = cache_keyword(self.base_model.forward)

    @classmethod
    def for_drafter(cls, target: PreTrainedModel, drafter: DFlashDraftModel) -> "TargetAdapter":
        """The adapter tapping `drafter`'s layers of `target`, once the drafter is known to be built for it."""
        adapter = cls(target, drafter.config.target_layer_ids, built_for=drafter.config)
        adapter.check_drafter(drafter)
        return adapter

    @property
    def num_layers(self) -> int:
        """The target's number of decoder layers."""
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size (rows of its LM head)."""
        return int(self.embed_tokens.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        """The target's hidden size."""
        return int(self.config.hidden_size)

    def check_drafter(self, drafter: DFlashDraftModel) -> None:
        """Raise a `ValueError` if `drafter` was not built for this target."""
        dconf = drafter.config
        check_built_for(dconf, self.target)
        if int(dconf.hidden_size) != self.hidden_size:
            raise ValueError(
                f"Drafter hidden size {dconf.hidden_size} does not match the target's {self.hidden_size}: a DFlash "
                "drafter shares the target's embedding and LM head, so it must be built for this target "
                "(`DFlashConfig.from_target(target.config)`)."
            )
        if dconf.vocab_size is not None and int(dconf.vocab_size) != self.vocab_size:
            raise ValueError(
                f"Drafter vocab size {dconf.vocab_size} does not match the target embedding's {self.vocab_size} "
                "rows: this drafter was built for a different target."
            )
        if not 0 <= int(dconf.mask_token_id) < self.vocab_size:
            raise ValueError(
                f"mask_token_id {dconf.mask_token_id} is not a row of the target embedding ({self.vocab_size} rows)."
            )

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Embed a drafter's block ids: with the target's input embedding module (Gemma's sqrt(H) scaling included),
        or, for a drafter with an `input_embedding_scale`, the raw embedding table times that scale."""
        if self.block_embedding_scale is None:
            return self.embed_tokens(input_ids)
        return nn.functional.embedding(input_ids, self.embed_tokens.weight) * self.block_embedding_scale

    def logits(self, hidden_states: torch.Tensor, token_ids: torch.LongTensor | None = None) -> torch.Tensor:
        """Project final hidden states with the target's LM head (times its `output_multiplier`, then softcapped) in
        float32: the target's logits.

        With `token_ids`, only those rows of the head are computed (a reduced draft vocabulary): the last dimension
        then indexes `token_ids`.
        """
        logits = self._head(hidden_states, token_ids)
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        return _softcapped(logits, self.softcap)

    def draft_logits(self, hidden_states: torch.Tensor, token_ids: torch.LongTensor | None = None) -> torch.Tensor:
        """A drafter's logits of its final hidden states: the target's LM head (rows `token_ids` where given) in
        float32, times the drafter's `output_multiplier`, softcapped by its `final_logit_softcapping` (by default
        the target's own)."""
        logits = self._head(hidden_states, token_ids)
        if self.draft_multiplier != 1.0:
            logits = logits * self.draft_multiplier
        return _softcapped(logits, self.draft_softcap)

    def _head(self, hidden_states: torch.Tensor, token_ids: torch.LongTensor | None) -> torch.Tensor:
        hidden_states = hidden_states.to(self.lm_head.weight.dtype)
        if token_ids is None and row_exact.head_is_hooked(self.lm_head):
            return self.lm_head(hidden_states).float()  # row by row inside a row-exact verification
        weight = self.lm_head.weight if token_ids is None else self._head_rows(token_ids)
        bias = self.lm_head.bias if token_ids is None else None
        return head_projection(hidden_states, weight, bias).float()

    def _head_rows(self, token_ids: torch.LongTensor) -> torch.Tensor:
        """Rows `token_ids` of the (frozen) LM head, gathered once per vocabulary and kept contiguous."""
        weight = self.lm_head.weight
        key = (token_ids.data_ptr(), token_ids.numel(), weight.data_ptr())
        if self._head_rows_key != key:
            self._head_rows_cache = weight.detach()[token_ids.to(weight.device)].contiguous()
            self._head_rows_key = key
        return self._head_rows_cache

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor,
        cache: Cache,
        compile_config: CompileConfig | None = None,
    ) -> TargetStep:
        """Run the base decoder on `input_ids`, appending to `cache`, and return normed + tapped hidden states.

        Only the tapped layers' outputs are kept (selective `output_hidden_states`); nothing is registered on the
        target's modules, so concurrent calls on a shared target are independent. With `compile_config` the decoder
        runs compiled (`runtime.compiled_call`; give it a static cache), and the states come back as copies, which
        a later replay of its CUDA graphs does not overwrite.
        """
        call = self.base_model if compile_config is None else compiled_call(self.base_model, compile_config)
        with forwards_alone() if compile_config is None else contextlib.nullcontext():
            outputs = call(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                output_hidden_states=self._hidden_state_indices,
                **{self._cache_kwarg: cache},
            )
        hidden_states = outputs.hidden_states
        tapped = torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
        last = outputs.last_hidden_state if compile_config is None else outputs.last_hidden_state.clone()
        return TargetStep(last_hidden_state=last, context_hidden_states=tapped)
