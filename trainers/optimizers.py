"""`MuonWithAdamW`: `torch.optim.Muon` for 2-D weight matrices and `torch.optim.AdamW` for the rest, as one optimizer.

Muon orthogonalises the momentum of matrix parameters and is only defined for 2-D tensors; norms (1-D) stay on AdamW.
Muon's learning rate is adjusted to match AdamW's update RMS (`adjust_lr_fn="match_rms_adamw"`), so one learning
rate and one schedule drive both; `adamw_groups` puts further parameters (embedding tables such as a Markov head's)
on AdamW with their own settings. The Trainer's scheduler and checkpointing see an ordinary optimizer: its
`param_groups` are the inner optimizers' groups, and its state dict holds both.

`torch.optim.Muon` orthogonalises in bfloat16. On a CPU without native bf16 (no AMX / AVX512-BF16) a bf16 matmul is
emulated, several times slower than fp32 (the trainer's warning about bf16 autocast there gives the figure); there the
Newton-Schulz iteration runs in float32 instead (same iteration, same coefficients).

[`build_optimizer`] is the drafter's optimizer as `DFlashTrainer.create_optimizer` builds it: `MuonWithAdamW` under
`muon`, else the Trainer's own, with a Markov head at its own learning rate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import _muon

from dflash_hf import runtime

if TYPE_CHECKING:
    from dflash_hf.modeling import DFlashDraftModel

    from .config import DFlashTrainingConfig


def orthogonalise_in_float32(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """`torch.optim.Muon`'s Newton-Schulz orthogonalisation of a 2-D update, computed in float32."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def _newton_schulz_in_float32() -> Iterator[None]:
    """Swap torch's bf16 orthogonalisation for the float32 one while a Muon step runs."""
    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = orthogonalise_in_float32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


def newton_schulz_float32_pays(device: torch.device) -> bool:
    """Whether Muon should orthogonalise in float32 here: on a CPU whose bf16 matmuls are emulated."""
    return device.type == "cpu" and runtime.native_bf16_feature() is None


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for 2-D parameters, AdamW for the others, behind one `torch.optim.Optimizer` interface."""

    def __init__(
        self,
        params,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        newton_schulz_float32: bool = False,
        adamw_groups: Sequence[dict[str, Any]] = (),
    ) -> None:
        """`newton_schulz_float32`: orthogonalise Muon's updates in float32 instead of torch's bfloat16 (see
        `newton_schulz_float32_pays`). `adamw_groups`: further parameter groups (torch's `{"params": ..., "lr": ...}`
        dicts) that AdamW optimises whatever their shape, such as embedding tables, which Muon is not meant for."""
        extra = [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in adamw_groups]
        extra = [group for group in extra if group["params"]]
        in_groups = {id(p) for group in extra for p in group["params"]}
        params = [p for p in params if p.requires_grad and id(p) not in in_groups]  # each parameter is updated once
        self.newton_schulz_float32 = newton_schulz_float32
        matrices = [p for p in params if p.ndim == 2]
        others = [p for p in params if p.ndim != 2]
        if not matrices:
            raise ValueError("MuonWithAdamW needs at least one 2-D parameter (Muon optimises weight matrices).")
        self._inner: list[torch.optim.Optimizer] = [
            torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        ]
        adamw = ([{"params": others}] if others else []) + extra
        if adamw:
            self._inner.append(torch.optim.AdamW(adamw, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        super().__init__(params + [p for group in extra for p in group["params"]], {"lr": lr})
        self.param_groups = [group for inner in self._inner for group in inner.param_groups]

    @property
    def state(self):  # the inner optimizers own the per-parameter state
        merged: dict = {}
        for inner in getattr(self, "_inner", []):
            merged.update(inner.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # set by `Optimizer.__init__`; the inner optimizers keep their own
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        precision = _newton_schulz_in_float32() if self.newton_schulz_float32 else contextlib.nullcontext()
        with precision:
            for inner in self._inner:
                inner.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for inner in self._inner:
            inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [inner.state_dict() for inner in self._inner]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner_states = state_dict.get("inner")
        if inner_states is None or len(inner_states) != len(self._inner):
            raise ValueError("This optimizer state was not written by MuonWithAdamW with the same parameters.")
        for inner, inner_state in zip(self._inner, inner_states):
            inner.load_state_dict(inner_state)
        self.param_groups = [group for inner in self._inner for group in inner.param_groups]


def build_optimizer(
    model: DFlashDraftModel,
    args: DFlashTrainingConfig,
    decay_parameter_names: Sequence[str],
    default: Callable[[], torch.optim.Optimizer],
) -> torch.optim.Optimizer:
    """The drafter's optimizer. With `args.muon` (and a trainable 2-D backbone weight): [`MuonWithAdamW`] for the
    backbone, the parts at rates of their own ([`own_rate_parts`]: a Markov head, a DFlash 2 selector) on AdamW with
    the Trainer's weight-decay split (`decay_parameter_names`). Otherwise `default()` (the Trainer's optimizer, AdamW
    by default), those parts moved to groups of their own where their rate differs from `learning_rate`."""
    parts = own_rate_parts(model, args)
    own = {id(p) for named, _ in parts for p in named.values()}
    backbone = [p for p in model.parameters() if p.requires_grad and id(p) not in own]
    if args.muon and any(p.ndim == 2 for p in backbone):
        groups = []
        for named, lr in parts:
            groups.append({"params": [p for n, p in named.items() if n in decay_parameter_names], "lr": lr})
            undecayed = [p for n, p in named.items() if n not in decay_parameter_names]
            groups.append({"params": undecayed, "lr": lr, "weight_decay": 0.0})
        return MuonWithAdamW(
            backbone,
            lr=args.learning_rate,
            weight_decay=args.weight_decay,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            newton_schulz_float32=newton_schulz_float32_pays(args.device),
            adamw_groups=groups,
        )
    optimizer = default()
    for named, lr in parts:
        if lr != args.learning_rate:
            move_to_own_group(optimizer, {id(p) for p in named.values()}, lr)
    return optimizer


def own_rate_parts(model: DFlashDraftModel, args: DFlashTrainingConfig) -> list[tuple[dict, float]]:
    """The drafter's parts that train at a rate of their own, each with its rate: the Markov head at
    `markov_learning_rate`, a DFlash 2 candidate selector at `selector_learning_rate` (each `learning_rate` where not
    given); both hold embedding tables, which Muon is not meant for."""
    parts = []
    if model.markov_head is not None:
        parts.append((dict(model.markov_head.named_parameters("markov_head")), args.markov_learning_rate))
    if model.candidate_selector is not None:
        selector = dict(model.candidate_selector.named_parameters("candidate_selector"))
        parts.append((selector, args.selector_learning_rate))
    return [(named, lr or args.learning_rate) for named, lr in parts]


def move_to_own_group(optimizer: torch.optim.Optimizer, parameter_ids: set[int], lr: float) -> None:
    """Before the first step: move the parameters `parameter_ids` names out of `optimizer`'s groups into groups of
    their own (same settings otherwise) at learning rate `lr`; groups left empty are dropped."""
    for group in list(optimizer.param_groups):
        moved = [p for p in group["params"] if id(p) in parameter_ids]
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in parameter_ids]
            optimizer.add_param_group({**group, "params": moved, "lr": lr})
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
