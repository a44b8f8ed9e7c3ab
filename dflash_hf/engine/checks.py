"""Validation of a generation request before any forward: prompt ids and masks, context length, options."""

from __future__ import annotations

import numbers

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import (
    ClassifierFreeGuidanceLogitsProcessor,
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    LogitsProcessorList,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from ..modeling import DFlashDraftModel
from .acceptance import SAMPLING_PROPOSALS
from .candidates import CANDIDATE_SOURCES
from .processing import EXACT_PROCESSORS

# The generation argument that adds each processor the engine refuses (anything else came in `logits_processor`).
_ARGUMENT_OF = {
    UnbatchedClassifierFreeGuidanceLogitsProcessor: "guidance_scale",
    ClassifierFreeGuidanceLogitsProcessor: "guidance_scale",
    EncoderRepetitionPenaltyLogitsProcessor: "encoder_repetition_penalty",
    EncoderNoRepeatNGramLogitsProcessor: "encoder_no_repeat_ngram_size",
    SynthIDTextWatermarkLogitsProcessor: "watermarking_config",
}


def check_inputs(
    target: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.LongTensor, torch.Tensor | None]:
    """Validate a prompt batch for DFlash generation and return it as `(batch, length)` tensors.

    A 1-D `input_ids` (and a 1-D mask with it) is a batch of one. Raises a `ValueError` naming the input and the fix
    for non-integer or out-of-vocabulary ids, an empty prompt, a mask of another shape or with values other than
    0/1, and a row that ends with padding (right padding would silently change the output).
    """
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(
            f"`input_ids` must be a tensor of token ids of shape (batch, length), got {type(input_ids).__name__}: "
            'pass the tokenizer\'s `input_ids` (`return_tensors="pt"`).'
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(
            f"`input_ids` must hold integer token ids, got dtype {input_ids.dtype}: pass `input_ids.long()` "
            "(float ids would be silently truncated)."
        )
    for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            raise ValueError(
                f"`{name}` is on the meta device (a shape without values): pass real token ids on the target's "
                f"device ({target.device})."
            )
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
            attention_mask = attention_mask[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"DFlash generation needs a non-empty prompt of shape (batch, length), got {tuple(input_ids.shape)}: "
            "pass at least one token (e.g. the BOS token or a chat-templated prompt)."
        )
    vocab_size = target.get_input_embeddings().num_embeddings
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"`input_ids` hold token ids outside the target's vocabulary (ids {low}..{high}, valid "
            f"0..{vocab_size - 1}): encode the prompt with this target's tokenizer."
        )
    if attention_mask is None:
        return input_ids, None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"`attention_mask` has shape {shape} but `input_ids` has shape {tuple(input_ids.shape)}: pass the mask "
            "the tokenizer returned with these ids (1 for tokens, 0 for left padding)."
        )
    mask = attention_mask.to(torch.long)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (token): pass the tokenizer's mask.")
    empty = (mask.sum(-1) == 0).nonzero()
    if empty.numel():
        raise ValueError(f"Row {int(empty[0])} of `attention_mask` masks every token: each prompt needs a token.")
    right = (mask[:, -1] == 0).nonzero()
    if right.numel():
        raise ValueError(
            f"Row {int(right[0])} of the batch ends with padding (right padding): DFlash generation needs left-padded "
            'prompts; set `tokenizer.padding_side = "left"` before tokenizing the batch.'
        )
    return input_ids, attention_mask


def check_context_length(target: PreTrainedModel, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raise a `ValueError` when `prompt_tokens + max_new_tokens` exceeds the target's position limit."""
    limit = getattr(target.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and prompt_tokens + max_new_tokens > int(limit):
        raise ValueError(
            f"The prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) needs "
            f"{prompt_tokens + max_new_tokens} positions but the target has {int(limit)} "
            "(`max_position_embeddings`): shorten the prompt or lower max_new_tokens."
        )


def check_request(generation_config: GenerationConfig) -> None:
    """Refuse generation settings the engine cannot honour (with a `ValueError` naming the fix)."""
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise ValueError(
                f"`{flag}=True` is not supported by DFlash generation; drop it (statistics come with "
                "`return_dict_in_generate=True`)."
            )
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("DFlash generation does not support beam search: use num_beams=1.")


def check_prompt_is_token_ids(model_kwargs: dict) -> None:
    """Refuse `inputs_embeds`: DFlash generation prefills the target from token ids (the drafter drafts from them)."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "`inputs_embeds` is not supported by DFlash generation, which prefills the target from `input_ids`: pass "
            "the prompt's token ids alone, or decode embeddings with plain `target.generate`."
        )


def check_logits_processors(logits_processor: LogitsProcessorList | None) -> None:
    """Refuse logits processors the engine cannot run exactly.

    The engine scores every drafted slot of every row on its own, calling each processor once per row and slot with
    that row's prefix: exact only for the stateless, row-wise processors of `processing.EXACT_PROCESSORS` (matched
    by class). A stateful processor (classifier-free guidance runs its own model and cache), one holding the whole
    batch's prompt, or any other (a custom processor cannot be proven stateless) would give other tokens than plain
    decoding, so it is refused with a `ValueError` naming the argument that added it.
    """
    for processor in logits_processor or []:
        if type(processor) in EXACT_PROCESSORS:
            continue
        name = type(processor).__name__
        argument = _ARGUMENT_OF.get(type(processor), "logits_processor")
        raise ValueError(
            f"`{argument}` ({name}) is not supported by DFlash generation: the engine applies logits processors once "
            "per row and drafted token, which is exact only for the stateless Transformers processors it lists in "
            f"`dflash_hf.engine.processing.EXACT_PROCESSORS`; drop `{argument}`, or decode with plain `target.generate`."
        )


# the longest prompt-lookup continuation verified with a block (it sizes the verify forward and its masks)
MAX_LOOKUP_TOKENS = 256


def check_options(candidates: str, sampling_proposal: str, lookup_tokens: int | None) -> None:
    """Refuse an unknown `candidates` or `sampling_proposal`, and a `lookup_tokens` that is no int in
    1..`MAX_LOOKUP_TOKENS` or `None` (a `ValueError` naming the valid values)."""
    if candidates not in CANDIDATE_SOURCES:
        raise ValueError(
            f"candidates must be one of {CANDIDATE_SOURCES}, got {candidates!r}: 'dflash' verifies the DFlash "
            "block, 'dflash+lookup' also a prompt-lookup continuation in the same target forward, 'tree' a draft "
            "tree over the drafter's top tokens per slot with the lookup continuation as one more branch."
        )
    if sampling_proposal not in SAMPLING_PROPOSALS:
        raise ValueError(
            f"sampling_proposal must be one of {SAMPLING_PROPOSALS}, got {sampling_proposal!r}: 'argmax' drafts "
            "each slot's most likely token, 'sample' samples each slot from the drafter's distribution."
        )
    if lookup_tokens is not None and (
        isinstance(lookup_tokens, bool)
        or not isinstance(lookup_tokens, numbers.Integral)
        or not 1 <= lookup_tokens <= MAX_LOOKUP_TOKENS
    ):
        raise ValueError(
            f"lookup_tokens must be an int between 1 and {MAX_LOOKUP_TOKENS} (the longest prompt-lookup continuation "
            f"verified with the block) or None (the default, see `lookup_branch_length`), got {lookup_tokens!r}."
        )


def check_devices(
    target: PreTrainedModel, drafter: DFlashDraftModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> None:
    """Refuse a target dispatched over several devices (`device_map`), a drafter or a prompt on another device than
    the target (each would end in a device error deep in a forward), naming the devices and the fix."""
    placed = sorted({str(where) for where in (getattr(target, "hf_device_map", None) or {}).values()})
    if len(placed) > 1:
        raise ValueError(
            f"The target is dispatched over several devices ({', '.join(placed)}; `device_map`): DFlash generation "
            "reads its layers' hidden states on one device: load it on one (`device_map={'': 0}` or `.to(device)`)."
        )
    device = target.device
    if drafter.device != device:
        raise ValueError(
            f"The drafter is on {drafter.device} but the target is on {device}: move it there with "
            f"`drafter.to({str(device)!r})`."
        )
    for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if isinstance(tensor, torch.Tensor) and tensor.device != device:
            raise ValueError(
                f"`{name}` is on {tensor.device} but the target is on {device}: pass `{name}.to(target.device)`."
            )


def check_target(target) -> None:
    """Refuse a `target` that is no Transformers model with `generate` (a causal LM)."""
    if not isinstance(target, torch.nn.Module) or not callable(getattr(target, "generate", None)):
        raise ValueError(
            "`target` must be a Transformers causal LM (e.g. `AutoModelForCausalLM.from_pretrained(...)`), got "
            f"{type(target).__name__}."
        )


def check_drafter(drafter) -> None:
    """Refuse a `drafter` that is no `DFlashDraftModel` (also one loaded through its checkpoint's remote code)."""
    if not isinstance(drafter, DFlashDraftModel) and type(drafter).__name__ != "DFlashDraftModel":
        raise ValueError(f"`drafter` must be a DFlashDraftModel, got {type(drafter).__name__}.")


def check_compiled_stateful_options(target: PreTrainedModel, candidates: str) -> None:
    """Refuse draft trees in a compiled call on a hybrid target (linear-attention layers with a recurrent state): each
    tree's root-to-leaf paths run those layers as a batch of their own shape, a compiled graph per tree shape."""
    if candidates == "tree":
        raise ValueError(
            f'candidates="tree" with compile=True on {type(target).__name__}: its linear-attention layers verify a tree '
            "path by path, a compiled graph for every tree shape. Use compile=False for draft trees, or "
            'candidates="dflash" or "dflash+lookup" (compiled, each cycle verifies the DFlash block).'
        )
