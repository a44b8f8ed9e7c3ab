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

import inspect
import numbers
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .acceptance import greedy_accept, rejection_sample
from .adapters import TargetAdapter
from .block_size import BlockSizePolicy, make_block_size_policy
from .cache_ops import select_rows, shift_cache_right, shift_right, truncate_cache
from .modeling import DFlashDraftModel
from .processing import BlockLogitsProcessor


@dataclass
class DFlashGenerateOutput:
    """Output of DFlash generation with `return_dict_in_generate=True`.

    Attributes:
        sequences: `(batch, prompt + generated)` ids, finished rows right-padded with the pad token.
        accepted_lengths: per row, the number of tokens committed in each verify cycle (accepted drafts + 1).
        cycles: number of target verify forwards per row.
        tau: mean tokens committed per verify forward over all rows and cycles.
        draft_time / verify_time / prefill_time: seconds spent in drafter forwards, target verify forwards and the
            target prefill.
        block_size: the largest block size used (the fixed size, or the adaptive policy's largest candidate).
        block_sizes: per row, the block size of each of its cycles (parallel to `accepted_lengths`).
    """

    sequences: torch.LongTensor | None = None
    accepted_lengths: list[list[int]] = field(default_factory=list)
    cycles: list[int] = field(default_factory=list)
    tau: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    block_size: int = 0
    block_sizes: list[list[int]] = field(default_factory=list)

    @property
    def acceptance_rate_by_slot(self) -> list[float]:
        """For draft slot `i = 1..block_size-1`: the fraction of cycles that drafted slot `i` in which it was accepted."""
        cycles = [
            (n, k) for lengths, sizes in zip(self.accepted_lengths, self.block_sizes) for n, k in zip(lengths, sizes)
        ]
        rates = []
        for slot in range(1, self.block_size):
            drafted = [n for n, k in cycles if k > slot]
            rates.append(sum(n > slot for n in drafted) / len(drafted) if drafted else 0.0)
        return rates


class _Timer:
    """Accumulates wall time of a code region, synchronising CUDA so the numbers mean something."""

    def __init__(self, device: torch.device) -> None:
        self.sync = device.type == "cuda"
        self.total = 0.0

    def __enter__(self):
        if self.sync:
            torch.cuda.synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.sync:
            torch.cuda.synchronize()
        self.total += time.perf_counter() - self._start


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
            "pass the tokenizer's `input_ids` (`return_tensors=\"pt\"`)."
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(
            f"`input_ids` must hold integer token ids, got dtype {input_ids.dtype}: pass `input_ids.long()` "
            "(float ids would be silently truncated)."
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
            "prompts; set `tokenizer.padding_side = \"left\"` before tokenizing the batch."
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


def _check_request(generation_config: GenerationConfig) -> None:
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise ValueError(
                f"`{flag}=True` is not supported by DFlash generation; drop it (statistics come with "
                "`return_dict_in_generate=True`)."
            )
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("DFlash generation does not support beam search: use num_beams=1.")


def _plain_stop_token_ids(stopping_criteria: StoppingCriteriaList) -> set[int] | None:
    """EOS ids when the criteria are only max-length and EOS (then a run is checked in one pass), else `None`."""
    stop_ids: set[int] = set()
    for criterion in stopping_criteria:
        if isinstance(criterion, EosTokenCriteria):
            stop_ids.update(int(t) for t in torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
        elif not isinstance(criterion, MaxLengthCriteria):
            return None
    return stop_ids


def _mask_or_none(mask: torch.Tensor, block: int = 0) -> torch.Tensor | None:
    """`mask` extended by `block` attended positions, or `None` when nothing is padded (unmasked fast path)."""
    if bool(mask.all()):
        return None
    return torch.cat([mask, mask.new_ones(mask.shape[0], block)], dim=1) if block else mask


@dataclass
class _State:
    """Per active row: ids, the next anchor, committed-token count, and the context the drafter has not seen yet.

    `mask` is the padding mask over the target cache (which already holds the pending context); `pending_shift` is
    how far each row must move right to be contiguous again once the drafter has ingested the pending context.
    """

    rows: list[int]
    anchors: torch.LongTensor
    committed: torch.LongTensor
    mask: torch.Tensor
    pending_ctx: torch.Tensor
    pending_pos: torch.LongTensor
    pending_shift: torch.LongTensor

    def select(self, index: torch.LongTensor) -> None:
        """Keep only the rows at `index` (positions in the current batch)."""
        self.rows = [self.rows[i] for i in index.tolist()]
        for name in ("anchors", "committed", "mask", "pending_ctx", "pending_pos", "pending_shift"):
            setattr(self, name, getattr(self, name)[index])


class _Decoder:
    """State and steps of one DFlash generation call (see the module docstring for the layout)."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDraftModel,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        logits_processor: LogitsProcessorList | None,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        streamer,
        block_size: int | str | BlockSizePolicy | None,
    ) -> None:
        if not isinstance(drafter, DFlashDraftModel) and type(drafter).__name__ != "DFlashDraftModel":
            raise ValueError(f"`drafter` must be a DFlashDraftModel, got {type(drafter).__name__}.")
        self.adapter = TargetAdapter.for_drafter(target, drafter)
        self.drafter = drafter
        self.policy = make_block_size_policy(block_size, int(drafter.config.block_size))
        self.max_block = int(getattr(self.policy, "max_block_size", getattr(self.policy, "block_size", 0)))
        self.device = input_ids.device
        self.do_sample = bool(generation_config.do_sample)
        self.process = BlockLogitsProcessor(logits_processor)
        self.stopping_criteria = stopping_criteria
        self.stop_token_ids = _plain_stop_token_ids(stopping_criteria)
        self.streamer = streamer
        self.mask_token_id = int(drafter.config.mask_token_id)
        draft_ids = getattr(drafter, "draft_token_ids", None)
        self.draft_token_ids = None if draft_ids is None else draft_ids.to(self.device)
        pad = getattr(generation_config, "_pad_token_tensor", None)
        if pad is None:
            pad = generation_config.pad_token_id
        if pad is None:
            eos = generation_config.eos_token_id
            pad = eos[0] if isinstance(eos, list) else eos
        self.pad_token_id = int(pad) if pad is not None else 0

        batch, prompt_len = input_ids.shape
        self.batch = batch
        self.prompt_len = prompt_len
        self.max_length = int(generation_config.max_length)
        width = max(self.max_length, prompt_len) + int(drafter.config.block_size) + 1
        self.sequences = torch.full((batch, width), self.pad_token_id, dtype=torch.long, device=self.device)
        self.sequences[:, :prompt_len] = input_ids
        self.lengths = [prompt_len] * batch
        self.finished = [False] * batch
        self.accepted_lengths: list[list[int]] = [[] for _ in range(batch)]
        self.block_sizes: list[list[int]] = [[] for _ in range(batch)]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.prompt_mask = attention_mask.to(torch.long)

        self.draft_timer = _Timer(self.device)
        self.verify_timer = _Timer(self.device)
        self.prefill_timer = _Timer(self.device)

    # ----------------------------------------------------------------------------------------------------------
    # token selection
    def _row_prefixes(self, rows: list[int], block_tokens: torch.LongTensor) -> list[torch.LongTensor]:
        """Per active row: its sequence so far followed by `block_tokens[i, 1:]` (the anchor is already in it)."""
        prefixes = []
        for i, row in enumerate(rows):
            prefixes.append(torch.cat([self.sequences[row, : self.lengths[row]], block_tokens[i, 1:]]))
        return prefixes

    def _first_token(self, logits: torch.Tensor) -> torch.LongTensor:
        def prefixes():
            return [self.sequences[row, : self.lengths[row]] for row in range(self.batch)]

        scores = self.process(logits[:, None, :], prefixes)[:, 0]
        if self.do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return scores.argmax(dim=-1)

    def _propose(self, draft_logits: torch.Tensor, rows: list[int]):
        """Draft tokens (and their proposal distributions when sampling) from per-slot drafter logits.

        With a reduced draft vocabulary, greedy drafting maps the argmax back to target ids; otherwise the logits are
        spread over the full vocabulary (-inf outside the draft vocabulary) so that processors and the rejection
        sampler see ordinary distributions.
        """
        if self.draft_token_ids is not None:
            if self.process.is_identity and not self.do_sample:
                return self.draft_token_ids[draft_logits.argmax(dim=-1)], None
            full = draft_logits.new_full((*draft_logits.shape[:2], self.adapter.vocab_size), float("-inf"))
            draft_logits = full.index_copy_(-1, self.draft_token_ids, draft_logits)
        if self.process.is_identity or self.process.prefix_free:
            scores = self.process(draft_logits, lambda: [])
            if not self.do_sample:
                return scores.argmax(dim=-1), None
            probs = torch.softmax(scores, dim=-1)
            flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), num_samples=1)
            return flat.view(probs.shape[:2]), probs
        # prefix-dependent processors: slot j's scores depend on the tokens drafted before it
        batch, slots, _ = draft_logits.shape
        tokens = torch.empty(batch, slots, dtype=torch.long, device=draft_logits.device)
        probs = torch.empty_like(draft_logits) if self.do_sample else None
        for i, row in enumerate(rows):
            sequence = self.sequences[row, : self.lengths[row]]
            for slot in range(slots):
                prefix = torch.cat([sequence, tokens[i, :slot]])
                scores = self.process.processors(prefix[None], draft_logits[i, slot][None])[0]
                if self.do_sample:
                    probs[i, slot] = torch.softmax(scores, dim=-1)
                    tokens[i, slot] = torch.multinomial(probs[i, slot], num_samples=1)[0]
                else:
                    tokens[i, slot] = scores.argmax()
        return tokens, probs

    def _verify(self, target_logits: torch.Tensor, block_tokens, draft_tokens, draft_probs, rows):
        scores = self.process(target_logits, lambda: self._row_prefixes(rows, block_tokens))
        if self.do_sample:
            return rejection_sample(draft_tokens, draft_probs, torch.softmax(scores, dim=-1))
        return greedy_accept(draft_tokens, scores.argmax(dim=-1))

    # ----------------------------------------------------------------------------------------------------------
    # emission
    def _emit(self, row: int, tokens: list[int]) -> int:
        """Append `tokens` to `row` until a stopping criterion fires; returns how many were appended."""
        start = self.lengths[row]
        tokens = tokens[: self.max_length - start]
        if self.stop_token_ids is not None:  # only max-length / EOS criteria: no per-token calls needed
            stop = next((i for i, token in enumerate(tokens) if token in self.stop_token_ids), None)
            if stop is not None:
                tokens = tokens[: stop + 1]
            self.sequences[row, start : start + len(tokens)] = torch.tensor(tokens, device=self.device)
            self.lengths[row] = start + len(tokens)
            self.finished[row] = stop is not None or self.lengths[row] >= self.max_length
        else:
            for token in tokens:
                self.sequences[row, self.lengths[row]] = token
                self.lengths[row] += 1
                sequence = self.sequences[row : row + 1, : self.lengths[row]]
                if self.lengths[row] >= self.max_length or bool(self.stopping_criteria(sequence, None)[0]):
                    self.finished[row] = True
                    break
        emitted = self.lengths[row] - start
        if self.streamer is not None and emitted:
            self.streamer.put(self.sequences[row : row + 1, start : self.lengths[row]].cpu())
        return emitted

    # ----------------------------------------------------------------------------------------------------------
    def _remaining(self, rows: list[int]) -> int:
        return max(self.max_length - self.lengths[row] for row in rows)

    def run(self) -> DFlashGenerateOutput:
        adapter, drafter = self.adapter, self.drafter
        device = self.device
        target_cache, draft_cache = DynamicCache(), DynamicCache()

        # 1. prefill
        mask = self.prompt_mask
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        with self.prefill_timer:
            step = adapter.forward(self.sequences[:, : self.prompt_len], _mask_or_none(mask), positions, target_cache)
            first = self._first_token(adapter.logits(step.last_hidden_state[:, -1]))
        for row, token in enumerate(first.tolist()):
            self._emit(row, [token])
        state = _State(
            rows=list(range(self.batch)),
            anchors=first,
            committed=mask.sum(-1),
            mask=mask,
            pending_ctx=step.tapped_hidden_states,
            pending_pos=positions,
            pending_shift=torch.zeros(self.batch, dtype=torch.long, device=device),
        )
        self._drop_finished(state, target_cache, draft_cache)
        while state.rows:
            block = max(2, min(self.policy.next_block_size(), self._remaining(state.rows) + 1))
            cycle_start = time.perf_counter()
            slots = torch.arange(block, device=device)
            block_pos = state.committed[:, None] + slots[None, :]

            # 2. draft: the new context enters the draft cache, the block's K/V are dropped right after
            with self.draft_timer:
                noise_ids = torch.full((len(state.rows), block), self.mask_token_id, dtype=torch.long, device=device)
                noise_ids[:, 0] = state.anchors
                out = drafter(
                    noise_embeds=adapter.embed(noise_ids),
                    context_hidden_states=state.pending_ctx,
                    position_ids=torch.cat([state.pending_pos, block_pos], dim=1),
                    attention_mask=_mask_or_none(state.mask, block),
                    past_key_values=draft_cache,
                )
                truncate_cache(draft_cache, state.mask.shape[1])
                draft_logits = adapter.logits(out.last_hidden_state[:, 1:], self.draft_token_ids)
                draft_tokens, draft_probs = self._propose(draft_logits, state.rows)

            # 3. re-align rows that committed fewer tokens last cycle (both caches now have the same layout)
            if bool(state.pending_shift.any()):
                shift = state.pending_shift
                shift_cache_right(target_cache, shift)
                shift_cache_right(draft_cache, shift)
                state.mask = shift_right(state.mask, shift, dim=1)
                state.mask[torch.arange(state.mask.shape[1], device=device)[None, :] < shift[:, None]] = 0

            # 4. verify the whole block in one target forward
            block_ids = torch.cat([state.anchors[:, None], draft_tokens], dim=1)
            with self.verify_timer:
                verify_mask = _mask_or_none(state.mask, block)
                step = adapter.forward(block_ids, verify_mask, block_pos, target_cache)
                target_logits = adapter.logits(step.last_hidden_state)
                accepted, next_tokens = self._verify(target_logits, block_ids, draft_tokens, draft_probs, state.rows)

            # 5. commit: anchor + accepted drafts enter the caches, the target's token becomes the next anchor
            kept = accepted + 1
            width = int(kept.max())
            truncate_cache(target_cache, state.mask.shape[1] + width)
            state.mask = torch.cat([state.mask, (slots[None, :width] < kept[:, None]).to(state.mask.dtype)], dim=1)
            state.pending_ctx = step.tapped_hidden_states[:, :width]
            state.pending_pos = block_pos[:, :width]
            state.pending_shift = width - kept
            state.committed = state.committed + kept
            state.anchors = next_tokens
            kept_list, draft_list, next_list = kept.tolist(), draft_tokens.tolist(), next_tokens.tolist()
            for i, row in enumerate(state.rows):
                emitted = self._emit(row, draft_list[i][: kept_list[i] - 1] + [next_list[i]])
                self.accepted_lengths[row].append(emitted)
                self.block_sizes[row].append(block)
            self.policy.observe(block, kept_list, time.perf_counter() - cycle_start)
            self._drop_finished(state, target_cache, draft_cache)

        if self.streamer is not None:
            self.streamer.end()
        return self._output()

    def _drop_finished(self, state: "_State", *caches: DynamicCache) -> None:
        keep = [i for i, row in enumerate(state.rows) if not self.finished[row]]
        if len(keep) == len(state.rows):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for cache in caches:
            select_rows(cache, index)
        state.select(index)

    def _output(self) -> DFlashGenerateOutput:
        total = max(self.lengths)
        sequences = self.sequences[:, :total].clone()
        for row, length in enumerate(self.lengths):
            sequences[row, length:] = self.pad_token_id
        lengths = [n for row in self.accepted_lengths for n in row]
        return DFlashGenerateOutput(
            sequences=sequences,
            accepted_lengths=self.accepted_lengths,
            cycles=[len(row) for row in self.accepted_lengths],
            tau=(sum(lengths) / len(lengths)) if lengths else 0.0,
            draft_time=self.draft_timer.total,
            verify_time=self.verify_timer.total,
            prefill_time=self.prefill_timer.total,
            block_size=self.max_block,
            block_sizes=self.block_sizes,
        )


def _streamer_of_calling_generate():
    """The `streamer` given to the `model.generate` call that invoked `custom_generate`.

    Transformers 5.23/5.24 hand a callable `custom_generate` only the keyword arguments its own signature adds, so a
    `streamer=` passed to `generate` reaches the prompt (`generate` streams it itself) but not the callable. Reading it
    from the calling `generate` frame keeps `target.generate(..., custom_generate=..., streamer=s)` meaningful.
    """
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if caller is None or caller.f_code.co_name != "generate":
            return None
        candidate = caller.f_locals.get("streamer")
        return candidate if hasattr(candidate, "put") and hasattr(candidate, "end") else None
    finally:
        del frame


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
    **model_kwargs,
) -> DFlashGenerateOutput | torch.LongTensor:
    """DFlash decoding as a Transformers `custom_generate` callable.

    Use `target.generate(**inputs, custom_generate=dflash_hf.custom_generate, drafter=drafter)`; generation-config
    handling, logits processors, stopping criteria and streamers keep their usual meaning. `block_size` may lower
    the drafter's block size for this call, or be `"adaptive"` (see [`AdaptiveBlockSize`]) or a policy object.
    """
    if drafter is None:
        raise ValueError(
            "DFlash `custom_generate` needs the drafter: `target.generate(**inputs, "
            "custom_generate=dflash_hf.custom_generate, drafter=drafter)`."
        )
    if synced_gpus:
        raise ValueError("DFlash generation does not support `synced_gpus` (DeepSpeed ZeRO-3 / FSDP generation).")
    _check_request(generation_config)
    input_ids, attention_mask = check_inputs(model, input_ids, model_kwargs.get("attention_mask"))
    longest = input_ids.shape[1] if attention_mask is None else int(attention_mask.sum(-1).max())
    check_context_length(model, longest, int(generation_config.max_length) - input_ids.shape[1])
    if streamer is None:
        streamer = _streamer_of_calling_generate()
    decoder = _Decoder(
        target=model,
        drafter=drafter,
        input_ids=input_ids,
        attention_mask=attention_mask,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        generation_config=generation_config,
        streamer=streamer,
        block_size=block_size,
    )
    output = decoder.run()
    return output if generation_config.return_dict_in_generate else output.sequences


def generate(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    block_size: int | str | BlockSizePolicy | None = None,
    **kwargs,
) -> DFlashGenerateOutput | torch.LongTensor:
    """Lossless speculative generation with a DFlash drafter.

    Accepts the usual `generate` keyword arguments (`max_new_tokens`, `do_sample`, `temperature`, `top_p`, `top_k`,
    `eos_token_id`, `streamer`, `generation_config`, `return_dict_in_generate`, ...). Batches of left-padded prompts
    are supported; every row accepts its own prefix. `block_size`: an int up to the drafter's trained block size,
    `"adaptive"` (chosen every cycle from the measured acceptance profile and costs), or a `BlockSizePolicy`.

    Returns:
        A `(batch, length)` tensor like `model.generate`, or a [`DFlashGenerateOutput`] (sequences + statistics) with
        `return_dict_in_generate=True`.
    """
    input_ids, attention_mask = check_inputs(target, input_ids, attention_mask)
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
        **kwargs,
    )
