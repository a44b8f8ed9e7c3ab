"""Exact verification in reduced precision: every block row gets the bits a one-token decode step would give it.

Plain greedy decoding runs the target one token at a time; a verify forward runs a block of k tokens at once. In
float32 the two agree to the last bit almost always, so greedy argmaxes never differ in practice. In bfloat16 on CPU
they do not: a block's attention reduces over keys in a different order for each query row than a one-token step does,
the hidden states differ in their last bits, and bfloat16 logits (8 bits of mantissa) then tie or swap often enough
that a block-verified answer drifts away from plain greedy decoding within a few dozen tokens.

The cure here is in two parts:

* Attention: inside an [`attention`] block (the engine's calls) a target that [`install`] probed runs
  [`ATTENTION_NAME`] instead of `sdpa`; outside every such block the user's model is as it was. It *is* `sdpa` (same
  function, same masks) except inside [`verification`]: there each query row is attended on its own, over exactly the keys a
  one-token step at that position would see, with the mask that step would get (`None` when nothing is masked). The
  per-row calls then have the shapes of decode steps and give their bits. A tree verify (`engine.tree`, the
  prompt-lookup branch) is handled the same way: each node attends over the cache and its own ancestors, gathered in
  the order its decode step would have cached them. A sliding-window layer (Gemma 3) attends over the last `window`
  of those keys only, as its decode step does: Transformers' sliding-window cache keeps `window - 1` keys.
* Linear layers: norms, rotary embeddings and activations are per row by construction, matmuls only if the kernel
  gives a row the same bits whatever the number of rows. That depends on the CPU, the weight shape and the kernels
  torch picks (on an AMD EPYC with avx512_bf16, SmolLM2's 1536 -> 576 `down_proj` differs, its other linears do not),
  so [`install`] measures every linear shape and recomputes only the ones that differ row by row inside a
  verification (forward hooks, attached within [`attention`] blocks only), then checks the whole target with
  [`block_rows_match_decode`], bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..transformers_compat import cache_keyword
from .attention_registry import SdpaVariant
from .linear_attention import new_target_cache
from .windows import sliding_window_of

ATTENTION_NAME = "row_exact_sdpa"

# target -> (largest block probed, whether its verify forwards were bit-exact)
_INSTALLED: "weakref.WeakKeyDictionary[PreTrainedModel, tuple[int, bool]]" = weakref.WeakKeyDictionary()
_INSTALL_LOCK = threading.RLock()
# target -> open [`attention`] blocks and the attention it had before them; its linears recomputed row by row, and their hooks while attached
_USERS: "weakref.WeakKeyDictionary[PreTrainedModel, tuple[int, str]]" = weakref.WeakKeyDictionary()
_ROW_BY_ROW: "weakref.WeakKeyDictionary[PreTrainedModel, list[nn.Module]]" = weakref.WeakKeyDictionary()
_HANDLES: "weakref.WeakKeyDictionary[PreTrainedModel, list]" = weakref.WeakKeyDictionary()


def _row_exact_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`sdpa`, or inside [`verification`] one `sdpa` call per query row with that row's decode-step keys and mask."""
    rows = query.shape[2]
    if rows == 1 or not _ROW_EXACT.is_flagged():  # flagged: inside a verification
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if _trees_differ(attention_mask, key.shape[2] - rows):  # draft trees shaped per sequence: one sequence at a time
        outputs = [
            _row_exact_sdpa(
                module, query[i : i + 1], key[i : i + 1], value[i : i + 1], attention_mask[i : i + 1], **kwargs
            )[0]
            for i in range(query.shape[0])
        ]
        return torch.cat(outputs), None
    kwargs.pop("is_causal", None)  # a single query row never uses the causal flag
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    context = key.shape[2] - rows
    outputs = []
    for row in range(rows):
        keys = _decode_step_keys(attention_mask, row, context, rows)
        if keys is None:  # a causal block: the cache and the block up to this row, a contiguous prefix
            end = context + row + 1
            start = max(end - window, 0) if window else 0
            row_key, row_value = key[:, :, start:end], value[:, :, start:end]
            mask = None if attention_mask is None else attention_mask[:, :, row : row + 1, start:end]
        else:  # a tree verify: the cache and this node's ancestors, in the order its decode step caches them
            keys = keys[-window:] if window else keys
            row_key, row_value = key.index_select(2, keys), value.index_select(2, keys)
            mask = attention_mask[:, :, row : row + 1].index_select(3, keys)
        step_mask = _as_step_mask(mask, query, row_key.shape[2], window)
        out, _ = sdpa_attention_forward(module, query[:, :, row : row + 1], row_key, row_value, step_mask, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def _trees_differ(mask: torch.Tensor | None, context: int) -> bool:
    """Whether the sequences of a batch verify trees of different shapes (a draft tree per row, `engine.draft_tree`):
    the block keys a row sees differ between sequences."""
    if mask is None or mask.shape[0] == 1:
        return False
    block = mask[:, 0, :, context:]
    sees = block if block.dtype == torch.bool else block == 0
    return bool((sees != sees[:1]).any())


def _decode_step_keys(mask: torch.Tensor | None, row: int, context: int, rows: int) -> torch.LongTensor | None:
    """The key indices a one-token step for block row `row` would attend over when the block's mask is not causal
    (a tree verify's mask, `engine.tree`: a node sees its ancestors only), else `None`. Every sequence of the batch has
    the same tree here ([`_trees_differ`] splits a batch whose trees differ), so the first one's mask says which block
    keys a row sees."""
    if mask is None:
        return None
    block = mask[0, 0, row, context : context + rows]
    sees = block if block.dtype == torch.bool else block == 0
    if bool(sees[: row + 1].all()) and not bool(sees[row + 1 :].any()):
        return None
    ancestors = torch.nonzero(sees).flatten() + context
    return torch.cat([torch.arange(context, device=ancestors.device), ancestors])


def _as_step_mask(mask: torch.Tensor | None, query: torch.Tensor, keys: int, window: int | None) -> torch.Tensor | None:
    """The mask Transformers gives a one-token `sdpa` step over `keys` keys: boolean (an additive tree mask converted),
    and `None` when every key is visible, except in a sliding-window layer whose keys fill the window, which gets its
    all-visible mask (with it `sdpa` rounds differently than without)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask == 0
    if mask is not None and not bool(mask.all()):
        return mask
    if not window or keys < window:
        return None
    if mask is None:
        mask = torch.ones(query.shape[0], 1, 1, keys, dtype=torch.bool, device=query.device)
    return mask


_ROW_EXACT = SdpaVariant(ATTENTION_NAME, _row_exact_sdpa)


def _rows_match(linear: torch.nn.Linear, max_rows: int, generator: torch.Generator) -> bool:
    """Whether `linear` gives each of 2..`max_rows` rows the bits it gives that row alone.

    A kernel that sums in another order for several rows changes an output's bf16 rounding only now and then (SmolLM2's
    `down_proj` on an AMD EPYC: about one output in 7,000), so small layers are probed with several random inputs
    (about 2^17 outputs in all, at most 16 inputs per row count); a large LM head gets one."""
    weight = linear.weight
    per_input = linear.out_features * sum(range(2, max_rows + 1))
    inputs = min(16, max(1, -(-(2**17) // max(per_input, 1))))
    for _ in range(inputs):
        for rows in range(2, max_rows + 1):
            x = torch.randn(rows, linear.in_features, generator=generator).to(weight.device, weight.dtype)
            together = linear(x)
            if not all(torch.equal(together[i], linear(x[i : i + 1])[0]) for i in range(rows)):
                return False
    return True


def _one_row_at_a_time(module: torch.nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """Forward hook: inside [`verification`], recompute a multi-row output row by row (the decode-step kernel)."""
    # A hook, not a replaced `forward`: it leaves the user's module (and accelerate's own hooks) as they are, at the
    # price of the discarded multi-row result (part of a row-exact verify's cost in `dflash-hf profile`).
    (x,) = args
    if not _ROW_EXACT.is_flagged() or x.shape[:-1].numel() == 1:
        return None
    flat = x.reshape(-1, x.shape[-1])
    rows = [nn.functional.linear(flat[i : i + 1], module.weight, module.bias) for i in range(flat.shape[0])]
    return torch.cat(rows).view(output.shape)


@torch.no_grad()
def install(target: PreTrainedModel, max_rows: int) -> bool:
    """Make `target`'s verify forwards of up to `max_rows` tokens give each row its one-token-step bits, if it can.

    Probes `sdpa` attention as [`ATTENTION_NAME`] (which the target then runs inside [`attention`] blocks) and, for
    every linear-layer shape of the decoder whose kernel gives a row different bits inside a multi-row call
    (measured here, on this machine), adds a forward hook that recomputes it row by row inside [`verification`]. Outside [`verification`] the target computes exactly as
    before. The LM head is probed (and hooked) the same way. Then checks the whole target with
    [`block_rows_match_decode`] and returns the result (`False` also for attention implementations other than `sdpa`,
    which are left alone). Installing again for as many rows or fewer returns the first result.
    """
    with _INSTALL_LOCK:  # concurrent calls on a shared target install once
        known = _INSTALLED.get(target)
        if known is not None and known[0] >= max_rows:
            return known[1]
        exact = _install(target, max_rows)
        _INSTALLED[target] = (max_rows, exact)
        return exact


def install_if_needed(target: PreTrainedModel, max_rows: int) -> bool | None:
    """[`install`] where `target` needs it, in reduced precision (bfloat16, float16) on CPU: whether its verify
    forwards of up to `max_rows` tokens are then bit-exact; `None` for a target that needs nothing (float32, or not on
    CPU)."""
    if target.device.type != "cpu" or target.dtype == torch.float32:
        return None
    return install(target, max_rows)


def _install(target: PreTrainedModel, max_rows: int) -> bool:
    """[`install`] without its cache and lock; the target runs [`ATTENTION_NAME`] and the row-by-row hooks only while
    it is probed (and inside [`attention`] blocks)."""
    current = getattr(target.config, "_attn_implementation", None)
    if current not in ("sdpa", ATTENTION_NAME):
        return False
    target.set_attn_implementation(ATTENTION_NAME)
    try:
        _ROW_BY_ROW[target] = _linears_to_recompute(target, max_rows)
        _hook(target)
        return block_rows_match_decode(target, max_rows)
    finally:
        if not _USERS.get(target):
            _unhook(target)
        if current == "sdpa" and target.config._attn_implementation == ATTENTION_NAME:
            target.set_attn_implementation("sdpa")


@contextlib.contextmanager
def attention(target: PreTrainedModel) -> Iterator[None]:
    """Within this block a target [`install`] made row-exact runs [`ATTENTION_NAME`] and the row-by-row hooks of its
    linears (outside [`verification`] both compute as `sdpa` and the plain linears do); outside every such block the
    user's model is back as it was, for its own calls, other threads' and `torch.compile`. Blocks may overlap across
    threads: the model goes back when the last one ends."""
    with _INSTALL_LOCK:
        users, before = _USERS.get(target, (0, None))
        if users == 0:
            before = target.config._attn_implementation
        switch = users > 0 or (target in _INSTALLED and before in ("sdpa", ATTENTION_NAME))
        if switch:
            if users == 0:
                target.set_attn_implementation(ATTENTION_NAME)
                _hook(target)
            _USERS[target] = (users + 1, before)
    try:
        yield
    finally:
        if switch:
            with _INSTALL_LOCK:
                users, before = _USERS[target]
                _USERS[target] = (users - 1, before)
                if users == 1:
                    del _USERS[target]
                    _unhook(target)
                    if target.config._attn_implementation == ATTENTION_NAME:  # unless someone switched it meanwhile
                        target.set_attn_implementation(before)


def _linears_to_recompute(target: PreTrainedModel, max_rows: int) -> list[nn.Module]:
    """The decoder's linears (and the LM head) whose kernel gives a row other bits inside a multi-row call, measured
    per weight shape on this machine."""
    generator = torch.Generator().manual_seed(0)
    verdicts: dict[tuple, bool] = {}
    modules = []
    for module in [*target.get_decoder().modules(), target.get_output_embeddings()]:
        if not isinstance(module, nn.Linear):
            continue
        shape = (tuple(module.weight.shape), module.weight.dtype, module.bias is not None)
        if shape not in verdicts:
            verdicts[shape] = _rows_match(module, max_rows, generator)
        if not verdicts[shape]:
            modules.append(module)
    return modules


def _hook(target: PreTrainedModel) -> None:
    """Make the linears [`_linears_to_recompute`] found recompute multi-row calls row by row inside
    [`verification`]."""
    handles = _HANDLES.setdefault(target, [])
    for module in _ROW_BY_ROW.get(target, []):
        if not getattr(module, "_row_exact_hooked", False):
            handles.append(module.register_forward_hook(_one_row_at_a_time))
            module._row_exact_hooked = True


def _unhook(target: PreTrainedModel) -> None:
    """Give the linears back their own forward."""
    for handle in _HANDLES.pop(target, []):
        handle.remove()
    for module in _ROW_BY_ROW.get(target, []):
        module._row_exact_hooked = False


def is_row_exact(target: PreTrainedModel) -> bool:
    """Whether [`install`] made `target`'s verifies bit-exact: the engine's calls then run it in [`attention`] (and not
    in grouped attention)."""
    return bool(_INSTALLED.get(target, (0, False))[1])


def head_is_hooked(head: nn.Module) -> bool:
    """Whether [`install`] made this LM head recompute multi-row calls row by row inside [`verification`] (callers
    that project with the head's weight directly must then call the module instead)."""
    return bool(getattr(head, "_row_exact_hooked", False))


def verification(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this block (and this thread / task), row-exact attention attends block rows one by one (`enabled`) and
    hooked linears recompute multi-row calls row by row."""
    return _ROW_EXACT.flagged(enabled)


@torch.no_grad()
def block_rows_match_decode(target: PreTrainedModel, block_size: int, context: int = 24, seed: int = 0) -> bool:
    """Whether a `block_size`-token forward gives every row the same logits, bit for bit, as one-token steps.

    Runs on `target` itself (after [`install`]): a random context, then the same `block_size` tokens once as a block
    under [`verification`] (on the engine's full-length cache) and once one at a time as stock `generate` runs them
    (on the target's own cache, whose sliding-window layers keep only their window). With sliding-window layers the
    context is longer than the window, so that the check covers decode steps past it. Block sizes up to `block_size`
    use the same kernels for their rows only if each of them matches, so callers probe every size they will verify
    with.
    """
    window = sliding_window_of(target.config)
    context = max(context, window + 8) if window else context
    generator = torch.Generator().manual_seed(seed)
    vocab = int(target.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (1, context + block_size), generator=generator).to(target.device)
    cache_kwarg = cache_keyword(target.forward)

    def prefilled(cache: Cache) -> Cache:
        target(ids[:, :context], use_cache=True, **{cache_kwarg: cache})
        return cache

    engine_cache = prefilled(new_target_cache(target))
    with attention(target), verification():
        block = target(ids[:, context:], use_cache=True, **{cache_kwarg: engine_cache}).logits[0]
    cache = prefilled(DynamicCache(config=target.config))
    steps = [
        target(ids[:, i : i + 1], use_cache=True, **{cache_kwarg: cache}).logits[0, -1]
        for i in range(context, context + block_size)
    ]
    return torch.equal(block, torch.stack(steps))
