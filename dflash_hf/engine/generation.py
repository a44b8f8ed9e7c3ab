"""Lossless DFlash speculative generation.

Each cycle the drafter fills a block `[anchor, MASK * (B-1)]` in one forward pass, the target verifies the block in
one forward pass and every row keeps its own longest acceptable prefix plus one target token. Works for batches of
left-padded prompts: rows that commit different numbers of tokens are re-aligned to the right so that both KV caches
stay contiguous (which also keeps sliding-window attention exact).

Entry points:

* `generate(target, drafter, input_ids, ...)`: like `model.generate`, returns a tensor or, with
  `return_dict_in_generate=True`, a [`DFlashGenerateOutput`] with statistics.
* `custom_generate`: the same loop as a Transformers `custom_generate` callable:
  `target.generate(**inputs, custom_generate=dflash_hf.custom_generate, drafter=drafter)`.
"""

from __future__ import annotations

import numbers

import torch
from transformers import CompileConfig, GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..modeling import DFlashDraftModel
from ..transformers_compat import stop_strings_as_criteria, streamer_of_calling_generate
from .acceptance import DEFAULT_SAMPLING_PROPOSAL
from .block_size import BlockSizePolicy
from .candidates import DEFAULT_CANDIDATES
from .checks import (
    check_context_length,
    check_devices,
    check_drafter,
    check_inputs,
    check_logits_processors,
    check_prompt_is_token_ids,
    check_request,
    check_target,
)
from .generation_call import GenerationCall
from .oracle import OracleDrafts
from .output import DFlashGenerateOutput

__all__ = ["DFlashGenerateOutput", "custom_generate", "generate"]


def custom_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    drafter: DFlashDraftModel | None = None,
    block_size: int | str | BlockSizePolicy | None = None,
    sampling_proposal: str = DEFAULT_SAMPLING_PROPOSAL,
    candidates: str = DEFAULT_CANDIDATES,
    lookup_tokens: int | None = None,
    oracle: OracleDrafts | None = None,
    compile: bool | CompileConfig = False,
    **model_kwargs,
) -> DFlashGenerateOutput | torch.LongTensor:
    """DFlash decoding as a Transformers `custom_generate` callable.

    Use `target.generate(**inputs, custom_generate=dflash_hf.custom_generate, drafter=drafter)`; generation-config
    handling, logits processors, stopping criteria and streamers keep their usual meaning. `block_size` may lower
    the drafter's block size for this call, or be `"adaptive"` (see [`AdaptiveBlockSize`]) or a policy object.
    `sampling_proposal` (with `do_sample=True`): `"argmax"` drafts each slot's most likely token, `"sample"` samples
    each slot from the drafter's distribution; both keep the output distributed exactly as the target's.
    `candidates`: `"dflash"`, `"dflash+lookup"` or `"tree"`, `lookup_tokens`, `oracle`, `compile`: see [`generate`].

    Stop strings: Transformers 5.23/5.24 drop the `tokenizer` argument before calling a `custom_generate` callable,
    so `target.generate(..., stop_strings=..., tokenizer=tok, custom_generate=...)` fails in Transformers itself;
    pass `stopping_criteria=[StopStringCriteria(tok, stop_strings)]` there, or call [`generate`], which takes
    `stop_strings` and `tokenizer` as `model.generate` does.
    """
    if drafter is None:
        raise ValueError(
            "DFlash `custom_generate` needs the drafter: `target.generate(**inputs, "
            "custom_generate=dflash_hf.custom_generate, drafter=drafter)`."
        )
    if synced_gpus:
        raise ValueError("DFlash generation does not support `synced_gpus` (DeepSpeed ZeRO-3 / FSDP generation).")
    check_request(generation_config)
    check_prompt_is_token_ids(model_kwargs)
    check_logits_processors(logits_processor)
    input_ids, attention_mask = check_inputs(model, input_ids, model_kwargs.get("attention_mask"))
    check_devices(model, drafter, input_ids, attention_mask)
    longest = input_ids.shape[1] if attention_mask is None else int(attention_mask.sum(-1).max())
    check_context_length(model, longest, int(generation_config.max_length) - input_ids.shape[1])
    if streamer is None:
        streamer = streamer_of_calling_generate()
    decoder = GenerationCall(
        target=model,
        drafter=drafter,
        input_ids=input_ids,
        attention_mask=attention_mask,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        generation_config=generation_config,
        streamer=streamer,
        block_size=block_size,
        sampling_proposal=sampling_proposal,
        candidates=candidates,
        lookup_tokens=lookup_tokens,
        oracle=oracle,
        compile=compile,
    )
    output = decoder.run()
    return output if generation_config.return_dict_in_generate else output.sequences


def generate(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    block_size: int | str | BlockSizePolicy | None = None,
    sampling_proposal: str = DEFAULT_SAMPLING_PROPOSAL,
    candidates: str = DEFAULT_CANDIDATES,
    lookup_tokens: int | None = None,
    oracle: OracleDrafts | None = None,
    compile: bool | CompileConfig = False,
    **kwargs,
) -> DFlashGenerateOutput | torch.LongTensor:
    """Lossless speculative generation with a DFlash drafter.

    Accepts the usual `generate` keyword arguments (`max_new_tokens`, `do_sample`, `temperature`, `top_p`, `top_k`,
    `eos_token_id`, `streamer`, `generation_config`, `return_dict_in_generate`, ...). Batches of left-padded prompts
    are supported; every row accepts its own prefix. `block_size`: an int up to the drafter's trained block size,
    `"adaptive"` (chosen every cycle from the measured acceptance profile and costs, a plain one-token step included
    where speculation costs more than it adds), or a `BlockSizePolicy` (block size 1: a plain step).
    `sampling_proposal` (with `do_sample=True`): `"sample"` (default) samples each slot from the drafter's own
    distribution; `"argmax"` drafts each slot's most likely token and accepts it with the target's probability of it.
    `candidates="dflash+lookup"` (the default; greedy): each cycle also verifies a prompt-lookup continuation of the
    row's own text, at most `lookup_tokens` long (default: 7, or the block size - 1 if more), in the same target
    forward (a two-branch tree, `dflash_hf.engine.lookup`); the longer accepted branch is kept. `candidates="tree"`
    (greedy): each row verifies a draft tree (`dflash_hf.engine.draft_tree`): the DFlash block, then the drafter's next
    most likely tokens per slot (through its Markov head, if it has one, after each node's own token) and the lookup
    continuation as further branches, added best-first while a node's chance of acceptance (the drafter's path
    probability, calibrated by the acceptance observed in the call) is worth what one more verified token costs (timed
    in the call), at most 16 beyond the block; the longest accepted path is kept. `candidates="dflash"` verifies the
    DFlash block alone, as sampling (with any `candidates`) and prefix-dependent logits processors always do.
    `oracle` ([`dflash_hf.engine.oracle.OracleDrafts`], greedy, `candidates` other than `"tree"`): the drafter runs as
    always, but its drafts are replaced by each row's known greedy continuation, each slot kept with a probability
    (the bench's oracle rows: the engine's cost at a chosen acceptance); the output is unchanged.
    `compile=True` (or a `transformers.CompileConfig`): the target's keys and values live in a static cache and every
    verify forward runs compiled at a fixed width (`dflash_hf.engine.compilation`; on a GPU, CUDA graphs); the first
    call of each shape compiles, later calls reuse it. The output is what plain greedy decoding gives on the same
    kernels, as without it.

    Logits processors outside `dflash_hf.engine.processing.EXACT_PROCESSORS` (e.g. `guidance_scale`, custom
    `logits_processor` objects) and `inputs_embeds` are refused with a `ValueError`; `stop_strings` need the
    `tokenizer`; a streamer gets the prompt, then one `(batch,)` tensor per step, as from `model.generate`.

    Returns:
        A `(batch, length)` tensor like `model.generate`, or a [`DFlashGenerateOutput`] (sequences + statistics) with
        `return_dict_in_generate=True`.
    """
    check_target(target)
    check_drafter(drafter)
    check_prompt_is_token_ids(kwargs)
    input_ids, attention_mask = check_inputs(target, input_ids, attention_mask)
    check_devices(target, drafter, input_ids, attention_mask)
    stop_strings_as_criteria(target, kwargs)
    max_new_tokens = kwargs.get("max_new_tokens")
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0
    ):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}.")
    if max_new_tokens == 0:
        if kwargs.get("return_dict_in_generate"):
            return DFlashGenerateOutput(sequences=input_ids.clone(), block_size=int(drafter.config.block_size))
        return input_ids.clone()
    return target.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        custom_generate=custom_generate,
        drafter=drafter,
        block_size=block_size,
        sampling_proposal=sampling_proposal,
        candidates=candidates,
        lookup_tokens=lookup_tokens,
        oracle=oracle,
        compile=compile,
        **kwargs,
    )
