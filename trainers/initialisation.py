"""Initialise a new drafter from its target (`DFlashTrainingConfig.init_from_target`).

Draft layer `i` of `n` starts as a copy of target layer `L - n + i` (the target's top layers), the final norm as the
target's, `fc` as the projection that selects the last tapped layer's output and `hidden_norm` as the first copied
layer's input norm: the first draft layer then computes the context keys/values exactly as that target layer would
from the last tap. Llama-style norms only (`weight * x`); targets whose norms are offset (Gemma's `1 + weight`) or whose
layers have other shapes are refused.
"""

from __future__ import annotations

import torch
from torch import nn

# Targets whose decoder layers match the drafter's (names, shapes and RMSNorm convention).
COPYABLE_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@torch.no_grad()
def initialise_from_target(drafter: nn.Module, target: nn.Module) -> list[int]:
    """Copy the target's top layers into `drafter` in place; returns the copied target layer ids."""
    model_type = getattr(target.config, "model_type", None)
    if model_type not in COPYABLE_TARGET_TYPES:
        raise ValueError(
            f"init_from_target supports targets with Llama/Qwen-style layers ({', '.join(COPYABLE_TARGET_TYPES)}), "
            f"not `{model_type}`: train this drafter from a random initialisation (drop --init_from_target)."
        )
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    target_layers = base.layers
    num_draft = len(drafter.layers)
    if num_draft > len(target_layers):
        raise ValueError(
            f"init_from_target needs at most {len(target_layers)} draft layers (the target's depth), got {num_draft}."
        )
    copied = list(range(len(target_layers) - num_draft, len(target_layers)))
    for draft_layer, layer_id in zip(drafter.layers, copied):
        source = target_layers[layer_id].state_dict()
        for name, param in draft_layer.state_dict().items():
            if name in source:
                if source[name].shape != param.shape:
                    raise ValueError(
                        f"init_from_target: draft `{name}` has shape {tuple(param.shape)} but target layer {layer_id} "
                        f"has {tuple(source[name].shape)}: build the drafter with the target's layer sizes."
                    )
                param.copy_(source[name])
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(1.0)  # the target has no query/key norm: start as a plain unit-RMS normalisation
            else:
                raise ValueError(f"init_from_target: target layer {layer_id} has no `{name}` to copy.")
    drafter.norm.weight.copy_(base.norm.weight)
    hidden = drafter.fc.out_features
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -hidden:].copy_(torch.eye(hidden, dtype=drafter.fc.weight.dtype))
    drafter.hidden_norm.weight.copy_(target_layers[copied[0]].input_layernorm.weight)
    return copied
