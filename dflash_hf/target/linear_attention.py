"""Hybrid targets (Qwen3.5 / Qwen3.6 / Qwen3.8, Qwen3-Next): Gated DeltaNet linear-attention layers, whose cache is a
recurrent state and a convolution state rather than keys and values, and how a verify rolls them back.

A verify forward over `w` tokens moves each linear-attention layer's states past all of them; a row that accepts `m`
of them needs the states after its `m`-th. [`LinearAttentionStates`] does it without a second target forward:

* around the verify ([`LinearAttentionStates.verifying`]) it keeps each layer's recurrent state as it was (one copy),
  lets Transformers' cache layer record the convolution inputs of the block (`activate_past_recording`: the layer keeps
  `[previous kernel window, block inputs]`), and keeps each layer's input rows (a forward pre-hook, attached for that
  forward only);
* after the verdict ([`LinearAttentionStates.keep`]) each row's convolution state is the kernel window that ends at its
  `m`-th token, and its recurrent state is the kept one advanced over its `m` accepted tokens, on the queries, keys,
  values and gates the verify computed (convolved from the recorded inputs by the module's own `causal_conv1d_fn`; the
  small gate projections re-applied to the kept input rows): by the module's own recurrence where Transformers runs it
  on `flash-linear-attention`'s kernel, else by [`_state_after`], the same arithmetic without the per-token outputs
  Transformers' PyTorch recurrence also computes. Rows that accepted the same count share one call; rows that accepted
  the whole block keep the verify's own state.

A token tree (the lookup branch, a draft tree) cannot run through one recurrent state: its verify runs each layer on
the tree's root-to-leaf paths ([`path_batch`]), each with a copy of its row's states, and the kept path's states are
advanced from the untouched ones the same way. What differs between the hybrid families (where the gates come from)
is [`_gate_inputs`].
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from ..runtime import upload

LINEAR_ATTENTION = "linear_attention"
# the `LinearAttentionStates` whose verify runs in this thread or task: its hooks act for that forward alone
_VERIFYING: contextvars.ContextVar[LinearAttentionStates | None] = contextvars.ContextVar("verifying", default=None)


def linear_attention_layers(config) -> list[int]:
    """Indices of a target's linear-attention layers (`layer_types`), empty for a target without any."""
    text = config.get_text_config(decoder=True)
    return [i for i, kind in enumerate(getattr(text, "layer_types", None) or []) if kind == LINEAR_ATTENTION]


def is_stateful(target: PreTrainedModel) -> bool:
    """Whether `target` has layers with a recurrent state (a hybrid model): its verifies need
    [`LinearAttentionStates`]."""
    return bool(linear_attention_layers(target.config))


def new_target_cache(target: PreTrainedModel) -> Cache:
    """An empty cache for `target`'s forwards: a `DynamicCache` of full-length layers (sliding windows are masks), and
    for a hybrid target a `LinearAttentionLayer` in place of each linear-attention layer's."""
    linear = set(linear_attention_layers(target.config))
    if not linear:
        return DynamicCache()
    layers = target.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[LinearAttentionLayer() if i in linear else DynamicLayer() for i in range(layers)])


def _gate_inputs(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(b, a)` gate projections of a Gated DeltaNet module for `hidden_states`, shaped `(batch, seq, v_heads)`:
    separate `in_proj_b` / `in_proj_a` (Qwen3.5), or one `in_proj_ba` grouped per key head (Qwen3-Next)."""
    if hasattr(module, "in_proj_ba"):
        batch, seq = hidden_states.shape[:2]
        per_key_head = module.num_v_heads // module.num_k_heads
        grouped = module.in_proj_ba(hidden_states).view(batch, seq, module.num_k_heads, 2 * per_key_head)
        b, a = torch.split(grouped, [per_key_head, per_key_head], dim=3)
        return b.reshape(batch, seq, module.num_v_heads), a.reshape(batch, seq, module.num_v_heads)
    return module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)


class PathBatch(NamedTuple):
    """The root-to-leaf paths of a batch of token trees, as a batch of chains: a tree verify runs each linear-attention
    layer on its paths (`paths` per row, each `length` nodes, short ones repeating their leaf), every path with its own
    copy of the row's states, and gives each node the output of the first path through it."""

    nodes: torch.LongTensor  # (batch * paths * length,): the flat node (row * width + node) at each path position
    outputs: torch.LongTensor  # (batch * width,): the flat path position whose output each node takes
    node_path: torch.LongTensor  # (batch, width): the path each node's output comes from
    paths: int
    length: int


def path_batch(parents: list[list[int]], width: int, device: torch.device) -> PathBatch:
    """The [`PathBatch`] of trees given by each row's parent pointers on the host (node 0 the root, its own parent;
    nodes past a row's list are padding, which take the root's output), padded to `width` nodes."""
    rows = []
    for row_parents in parents:
        inner = {row_parents[node] for node in range(1, len(row_parents))}
        paths = []
        for leaf in (node for node in range(len(row_parents)) if node not in inner):
            path = [leaf]
            while path[-1] != 0:
                path.append(row_parents[path[-1]])
            paths.append(path[::-1])
        rows.append(paths)
    count = max(len(paths) for paths in rows)
    length = max(len(path) for paths in rows for path in paths)
    nodes, outputs, node_path = [], [], []
    for row, paths in enumerate(rows):
        paths = paths + [paths[0]] * (count - len(paths))
        source = [(0, 0)] * width
        for p, path in enumerate(reversed(paths)):  # the first path through a node wins
            for depth, node in enumerate(path):
                source[node] = (count - 1 - p, depth)
        for path in paths:
            nodes += [row * width + node for node in path + [path[-1]] * (length - len(path))]
        outputs += [((row * count) + p) * length + depth for p, depth in source]
        node_path.append([p for p, _ in source])
    return PathBatch(upload(nodes, device), upload(outputs, device), upload(node_path, device), count, length)


class LinearAttentionStates:
    """The linear-attention layers of a hybrid target and the rollback of their states after a verify (see the
    module docstring). One object per generation call, on that call's `cache`.

    A chain verify runs each layer on the main cache, recording. A tree verify ([`verifying`] with a [`PathBatch`])
    runs each layer on the tree's paths instead (a forward pre-hook swaps the layer's input rows and cache for the
    paths' and a forward hook maps the outputs back to the nodes), on a cache of its own whose states start as each
    path's row's; the main cache's states stay as they were until [`keep`] advances them along the accepted path."""

    def __init__(self, target: PreTrainedModel, base_model: nn.Module, cache: Cache) -> None:
        self.cache = cache
        self.modules = {i: base_model.layers[i].linear_attn for i in linear_attention_layers(target.config)}
        for i, module in self.modules.items():
            if not hasattr(module, "conv1d") or not (hasattr(module, "in_proj_ba") or hasattr(module, "in_proj_a")):
                raise ValueError(
                    f"Layer {i} of this {target.config.model_type} target is a linear-attention layer of a kind "
                    f"dflash-hf cannot roll back ({type(module).__name__}): supported are the Gated DeltaNet layers "
                    "of Qwen3.5/3.6 and Qwen3-Next."
                )
        self._kept_states: dict[int, torch.Tensor] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._paths: PathBatch | None = None
        self._path_cache: Cache | None = None

    def _layer(self, index: int) -> LinearAttentionCacheLayerMixin:
        return self.cache.layers[index]

    @contextlib.contextmanager
    def verifying(self, paths: PathBatch | None = None) -> Iterator[None]:
        """Around one verify forward: record each layer's convolution inputs and input rows; a chain also keeps each
        recurrent state (the verify moves it), a tree (`paths`) runs on its paths' own cache. The hooks act only in
        this thread's (or task's) context: a concurrent call's forward on the same target passes them by."""
        self._paths = paths
        token = _VERIFYING.set(self)
        if paths is not None:
            self._path_cache = self._paths_cache(paths.paths)
        handles = []
        for i, module in self.modules.items():
            if paths is None:
                layer = self._layer(i)
                self._kept_states[i] = layer.recurrent_states[0].clone()
                layer.activate_past_recording()
            else:  # registered first: the recorder then sees the paths' rows
                handles.append(module.register_forward_pre_hook(self._to_paths, with_kwargs=True))
                handles.append(module.register_forward_hook(self._to_nodes, with_kwargs=True))
            handles.append(module.register_forward_pre_hook(self._recorder(i), with_kwargs=True))
        try:
            yield
        finally:
            _VERIFYING.reset(token)
            for handle in handles:
                handle.remove()

    def _acts_here(self) -> bool:
        """Whether this object's hooks act for the forward running now: a verify of its own call (a compiled forward
        runs alone, `runtime.compiled_call`, and dynamo traces no context variable)."""
        return torch.compiler.is_compiling() or _VERIFYING.get() is self

    def _paths_cache(self, count: int) -> Cache:
        """A cache whose linear-attention layers start from the main cache's states, each row's repeated for its
        `count` paths, recording their convolution inputs."""
        layers = [LinearAttentionLayer() for _ in self.cache.layers]
        for i in self.modules:
            main, layer = self._layer(i), layers[i]
            conv, recurrent = main.conv_states[0], main.recurrent_states[0]
            layer.lazy_initialization(conv_states=conv, conv_kernel_size=main.conv_kernel_size[0])
            layer.lazy_initialization(recurrent_states=recurrent)
            layer.conv_states[0] = conv.repeat_interleave(count, dim=0)
            layer.recurrent_states[0] = recurrent.repeat_interleave(count, dim=0)
            layer.has_previous_state[0] = True
            layer.activate_past_recording()
        return Cache(layers=layers)

    def _to_paths(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self._acts_here():
            return None
        hidden_states = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        paths = self._paths
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        chains = flat[paths.nodes].view(-1, paths.length, hidden_states.shape[-1])
        return (), {**kwargs, "hidden_states": chains, "cache": self._path_cache, "attention_mask": None}

    def _to_nodes(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
        if not self._acts_here():
            return None
        batch = output.shape[0] // self._paths.paths
        nodes = output.reshape(-1, output.shape[-1])[self._paths.outputs]
        return nodes.view(batch, -1, output.shape[-1])

    def _recorder(self, index: int):
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._acts_here():
                return
            self._inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return record

    @torch.no_grad()
    def keep(self, kept: list[int], order: torch.LongTensor | None = None) -> None:
        """Make every layer's states those after each row's first `kept[row]` verified tokens: of the chain, or of a
        tree's accepted path, whose node indices `order` lists (`(batch, >= max(kept))`, on the device)."""
        device = next(iter(self._inputs.values())).device
        starts = upload(kept, device)  # the same for every layer: uploaded once per cycle
        rows = None
        if order is not None:  # each row's path through its last accepted node
            last = order.gather(1, starts[:, None] - 1)
            path = self._paths.node_path.gather(1, last).squeeze(1)
            rows = torch.arange(len(kept), device=device) * self._paths.paths + path
        groups = {count: [r for r, n in enumerate(kept) if n == count] for count in sorted(set(kept))}
        group_rows = {count: upload(members, device) for count, members in groups.items() if len(members) < len(kept)}
        for i, module in self.modules.items():
            layer = self._layer(i)
            window = layer.conv_kernel_size[0]
            if rows is None:
                recorded, inputs, start = layer.conv_states[0], self._inputs[i], self._kept_states[i]
            else:
                recorded, inputs = self._path_cache.layers[i].conv_states[0][rows], self._inputs[i][rows]
                start = layer.recurrent_states[0]  # as before the verify; each group reads its own rows first
            verified = recorded.shape[-1] - window  # (batch, channels, window + verified)
            index = (starts[:, None] + torch.arange(window, device=device)[None, :])[:, None, :]
            layer.conv_states[0] = recorded.gather(2, index.expand(-1, recorded.shape[1], -1)).contiguous()
            layer.record_past = False
            for count in groups:
                if rows is None and count == verified:  # the chain verify's own state: the one after its last token
                    continue
                group = group_rows.get(count)
                if group is None:  # one group: no copies of its rows
                    layer.recurrent_states[0].copy_(self._advanced(module, recorded, inputs, start, count, window))
                    continue
                state = self._advanced(module, recorded[group], inputs[group], start[group], count, window)
                layer.recurrent_states[0].index_copy_(0, group, state.to(layer.recurrent_states[0].dtype))
        self._kept_states.clear()
        self._inputs.clear()
        self._paths = self._path_cache = None

    @staticmethod
    def _advanced(
        module: nn.Module,
        recorded: torch.Tensor,
        inputs: torch.Tensor,
        start: torch.Tensor,
        count: int,
        window: int,
    ) -> torch.Tensor:
        """`start`, the recurrent states of some rows, advanced over their first `count` verified tokens: their
        recorded convolution inputs `recorded` (`(rows, channels, window + verified)`) and the layer's input rows
        `inputs`."""
        functions = sys.modules[type(module).__module__]
        mixed = functions.causal_conv1d_fn(
            recorded[:, :, : window + count],
            module.conv1d.weight.squeeze(1),
            module.conv1d.bias,
            activation=module.activation,
        )[:, :, -count:].transpose(1, 2)
        query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        batch = recorded.shape[0]
        query = query.reshape(batch, count, -1, module.head_k_dim)
        key = key.reshape(batch, count, -1, module.head_k_dim)
        value = value.reshape(batch, count, -1, module.head_v_dim)
        b, a = _gate_inputs(module, inputs[:, :count])
        beta = b.sigmoid()
        g = -module.A_log.float().exp() * nn.functional.softplus(a.float() + module.dt_bias)
        if not _RECURRENCE_KERNELS:
            return _state_after(functions.l2norm(key.float(), dim=-1, eps=1e-6), value, g, beta, start)
        _, state = functions.torch_recurrent_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=start,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return state


# Whether Transformers runs Gated DeltaNet layers with `flash-linear-attention`'s kernels (their fused recurrence is
# then the rollback's); without them its PyTorch recurrence also computes every token's output, which a rollback
# does not need: [`_state_after`] advances the state alone, on the same arithmetic.
_RECURRENCE_KERNELS = importlib.util.find_spec("fla") is not None


def _state_after(
    key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The gated delta rule's state after the tokens of `key` (l2-normed), `value` (`(rows, tokens, heads, dim)`,
    keys grouped over fewer heads repeated to the value heads), log-decays `g` and rates `beta` (`(rows, tokens,
    heads)`), from `state` (`(rows, heads, key dim, value dim)`): per token, decay the state, then move its reading
    at the key towards the value by `beta`, in float32 as Transformers' recurrence."""
    rows, tokens, heads, value_dim = value.shape
    if key.shape[2] != heads:
        key = key.repeat_interleave(heads // key.shape[2], dim=2)
    # one (row, head) pair per matrix: (tokens, rows * heads, dim)
    key = key.float().transpose(0, 1).reshape(tokens, rows * heads, -1, 1).contiguous()
    value = value.float().transpose(0, 1).reshape(tokens, rows * heads, 1, value_dim).contiguous()
    decay = g.float().exp().transpose(0, 1).reshape(tokens, rows * heads, 1, 1).contiguous()
    beta = beta.float().transpose(0, 1).reshape(tokens, rows * heads, 1, 1).contiguous()
    state = state.to(torch.float32, copy=True).reshape(rows * heads, -1, value_dim)
    for token in range(tokens):
        state.mul_(decay[token])
        reading = torch.bmm(key[token].transpose(1, 2), state)
        state.baddbmm_(key[token], (value[token] - reading) * beta[token])
    return state.view(rows, heads, -1, value_dim)
