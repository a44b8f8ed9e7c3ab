"""One DFlash generation call: its state (sequences, both KV caches, statistics) and the loop of its cycles.

[`GenerationCall`] runs prefill, then propose / re-align / verify / commit cycles until every row has stopped
(docs/design.md, "The inference cycle"); `dflash_hf.engine.generation` holds the public entry points around it. What a
cycle verifies comes from the call's candidate source (`candidates`: the DFlash chain, a lookup branch, draft trees),
how logits become tokens from its token choice (`token_choice`), the target's verdict from its verifier
(`verification`). The pure parts live next to it: option checks (`checks`), acceptance rules (`acceptance`), cache
edits (`cache_ops`), block-size policies (`block_size`), tree masks and acceptance (`tree`).
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation.configuration_utils import CompileConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..modeling import DFlashDraftModel
from ..runtime import Stopwatch
from ..special_tokens import first_token_id
from ..target import row_exact
from ..target.adapter import TargetAdapter
from ..target.grouped_attention import grouped_attention
from ..target.linear_attention import LinearAttentionStates, is_stateful, new_target_cache
from .acceptance import DEFAULT_SAMPLING_PROPOSAL
from .block_size import BlockSizePolicy, make_block_size_policy
from .cache_ops import drop_leading, is_static, keep_path, select_rows, shift_cache_right, shift_right, truncate_cache
from .candidates import DEFAULT_CANDIDATES, CandidatePlan, DFlashChain, Readout, Verdict, candidate_source
from .checks import check_compiled_stateful_options, check_drafter, check_options
from .compilation import STATIC_CACHES, compile_config_of
from .lookup import Lookups
from .oracle import OracleDrafts, oracle_chain
from .output import DFlashGenerateOutput
from .processing import BlockLogitsProcessor
from .rows import ActiveRows, mask_or_none
from .sequences import CallSequences
from .token_choice import TokenChoice
from .verification import Verifier


class GenerationCall:
    """The state of one DFlash generation call (sequences, caches, statistics) and the loop of its cycles."""

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
        sampling_proposal: str = DEFAULT_SAMPLING_PROPOSAL,
        candidates: str = DEFAULT_CANDIDATES,
        lookup_tokens: int | None = None,
        oracle: OracleDrafts | None = None,
        compile: bool | CompileConfig = False,
    ) -> None:
        check_options(candidates, sampling_proposal, lookup_tokens)
        self.compile_config = compile_config_of(compile)
        check_drafter(drafter)
        self.adapter = TargetAdapter.for_drafter(target, drafter)
        self.drafter = drafter
        self.policy = make_block_size_policy(block_size, int(drafter.config.block_size))
        self.max_block = int(getattr(self.policy, "max_block_size", getattr(self.policy, "block_size", 0)))
        self.device = input_ids.device
        pad = first_token_id(
            getattr(generation_config, "_pad_token_tensor", None),
            generation_config.pad_token_id,
            generation_config.eos_token_id,
        )
        self.batch = input_ids.shape[0]
        self.prompt_mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(torch.long)
        self.input_ids = input_ids.long()
        self.sequences = CallSequences(
            input_ids,
            self.prompt_mask,
            max_length=int(generation_config.max_length),
            pad_token_id=0 if pad is None else pad,
            stopping_criteria=stopping_criteria,
            streamer=streamer,
        )
        stateful = is_stateful(target)
        self.target_cache: Cache = new_target_cache(target)
        self.linear_states = (
            LinearAttentionStates(target, self.adapter.base_model, self.target_cache) if stateful else None
        )
        self.draft_cache = DynamicCache()
        self.draft_timer = Stopwatch(self.device)
        self.verify_timer = Stopwatch(self.device)
        self.prefill_timer = Stopwatch(self.device)
        lookup_tokens = None if lookup_tokens is None else int(lookup_tokens)
        self._set_up_cycles(generation_config, logits_processor, sampling_proposal, candidates, lookup_tokens, oracle)

    def _set_up_cycles(
        self,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None,
        sampling_proposal: str,
        candidates: str,
        lookup_tokens: int | None,
        oracle: OracleDrafts | None,
    ) -> None:
        """The call's token choice, candidate plan and source (its drafts replayed from `oracle` when given), and
        verifier."""
        do_sample = bool(generation_config.do_sample)
        process = BlockLogitsProcessor(logits_processor)
        draft_ids = getattr(self.drafter, "draft_token_ids", None)
        self.choice = TokenChoice(
            process,
            do_sample=do_sample,
            sample_slots=do_sample and sampling_proposal == "sample",
            vocab_size=self.adapter.vocab_size,
            draft_token_ids=None if draft_ids is None else draft_ids.to(self.device),
            markov_head=getattr(self.drafter, "markov_head", None),
            sequence=self.sequences.sequence,
            selector=getattr(self.drafter, "candidate_selector", None),
            temperature=float(generation_config.temperature or 1.0),
        )
        # trees (the lookup branch, the draft tree) need greedy verification and a processor that scores every node
        # alone; sampling verifies the DFlash block (the chain) alone
        tree_verify = not do_sample and (process.is_identity or process.prefix_free)
        if self.linear_states is not None and self.compile_config is not None:
            check_compiled_stateful_options(self.adapter.target, candidates)
            tree_verify = False  # a path batch per tree shape would compile a graph each: the chain, at fixed widths
        self.plan = CandidatePlan(candidates, self.max_block, lookup_tokens, tree_verify)
        if self.plan.source == "tree" and self.choice.selector is not None:
            raise ValueError(
                'candidates="tree" grows draft trees from each slot\'s own top tokens, and a DFlash 2 drafter chooses '
                'its slots with its candidate selector: use candidates="dflash+lookup" (the default) or "dflash".'
            )
        if self.compile_config is not None:
            self._take_static_caches()
        chain = DFlashChain(
            self.drafter,
            self.adapter,
            self.draft_cache,
            self.choice,
            self.draft_timer,
            self.compile_config if is_static(self.draft_cache) else None,
            context_width=self.plan.verify_width,  # the longest path a verify commits
        )
        self.chain = chain
        if oracle is not None:
            chain = oracle_chain(
                chain,
                oracle,
                prompt_mask=self.prompt_mask,
                max_new_tokens=int(generation_config.max_length) - self.prompt_mask.shape[1],
                eos_token_id=generation_config.eos_token_id,
                do_sample=do_sample,
                candidates=candidates,
                vocab_size=self.adapter.vocab_size,
            )
        self.source = candidate_source(
            self.plan, chain, Lookups(lookup_tokens, self.sequences.text, self.sequences.remaining)
        )
        self.verifier = Verifier(
            self.adapter,
            self.target_cache,
            self.choice,
            self.plan.verify_width,
            self.verify_timer,
            self.compile_config,
            self.linear_states,
        )

    def _take_static_caches(self) -> None:
        """Static caches for `compile=True`: the target's holds the longest row and the widest verify after it, the
        drafter's also a padded pending context and a block (a drafter on flash attention, which takes no 4-D masks,
        keeps its dynamic cache and runs eagerly)."""
        needed = self.sequences.max_length + self.plan.verify_width
        linear = frozenset(self.linear_states.modules) if self.linear_states is not None else frozenset()
        self.target_cache = STATIC_CACHES.take(self.adapter.target, self.adapter.num_layers, self.batch, needed, linear)
        if self.linear_states is not None:
            self.linear_states.cache = self.target_cache
        if "flash" not in (self.drafter.config._attn_implementation or ""):
            layers = int(self.drafter.config.num_hidden_layers)
            needed += self.plan.verify_width + self.max_block
            self.draft_cache = STATIC_CACHES.take(self.drafter, layers, self.batch, needed)

    def run(self) -> DFlashGenerateOutput:
        """Prefill, then propose / re-align / verify / commit cycles until every row has stopped."""
        try:
            # compiled forwards keep Transformers' own attention: the engine's CPU kernels are chosen per call
            target_kernels = contextlib.nullcontext() if self.compile_config else grouped_attention(self.adapter.target)
            draft_kernels = contextlib.nullcontext() if self.compile_config else grouped_attention(self.drafter)
            exact = row_exact.attention(self.adapter.target) if self.verifier.row_exact else contextlib.nullcontext()
            with exact, target_kernels, draft_kernels:
                state = self._prefill()
                self.sequences.stream()
                while state.rows:
                    self._cycle(state)
                    self.sequences.judge_columns()
                    self._drop_finished(state)
                    self.sequences.stream()
        finally:
            for model, cache in ((self.adapter.target, self.target_cache), (self.drafter, self.draft_cache)):
                if is_static(cache):
                    STATIC_CACHES.give_back(model, self.batch, cache)
        self.sequences.end_stream()
        return self._output()

    def _cycle(self, state: ActiveRows) -> None:
        """2-5: propose (draft), re-align, verify, commit; then the policies learn what the cycle kept and cost."""
        block = self.policy.next_block_size()
        if self.compile_config is None:  # compiled verifies keep their widths to the end (the output is cut)
            block = max(1, min(block, self.sequences.remaining(state.rows) + 1))
        cycle_start = time.perf_counter()
        block_pos = state.block_positions(block)
        proposal = self.source.propose(state, block, block_pos)
        self._realign(state)
        verdict = self.verifier.verify(state, block_pos, proposal)
        readout = verdict.read()  # the cycle's one wait for the device
        self._commit(state, block, verdict, readout)
        self.source.learn(proposal, readout)
        seconds = time.perf_counter() - cycle_start
        # the block-size policy learns the DFlash block's own acceptance, not the other branches' wins
        self.policy.observe(block, readout.block_kept, seconds)
        self.source.observe(proposal, sum(readout.kept) / len(readout.kept), seconds)

    def _prefill(self) -> ActiveRows:
        """1. One target forward over the prompts: fills the target cache, gives every row its first token."""
        mask, padding = self.prompt_mask, list(self.sequences.padding)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        with self.prefill_timer:
            step = self.adapter.forward(self.input_ids, mask_or_none(mask, any(padding)), positions, self.target_cache)
            first = self.choice.first(self.adapter.logits(step.last_hidden_state[:, -1]), list(range(self.batch)))
        first_ids = first.tolist()  # the prefill's one wait for the device
        for row, token in enumerate(first_ids):
            self.sequences.emit(row, [token])
        self.sequences.judge_columns()
        state = ActiveRows(
            rows=list(range(self.batch)),
            anchors=first,
            anchor_ids=first_ids,
            committed=mask.sum(-1),
            mask=mask,
            padding=padding,
            pending_context_hidden_states=step.context_hidden_states,
            pending_pos=positions,
            pending_shift=torch.zeros(self.batch, dtype=torch.long, device=self.device),
            shifts=[0] * self.batch,
        )
        self._drop_finished(state)
        return state

    def _realign(self, state: ActiveRows) -> None:
        """3. Shift right the rows that committed fewer tokens last cycle (both caches now have the same layout);
        on static caches, drop the padding all rows share when it leaves no room ([`_room_is_short`])."""
        length = state.mask.shape[1]
        if any(state.shifts):
            shift = state.pending_shift
            shift_cache_right(self.target_cache, shift, length)
            shift_cache_right(self.draft_cache, shift, length - self.chain.dropped)
            vacated = torch.arange(length, device=self.device)[None, :] < shift[:, None]
            state.mask = shift_right(state.mask, shift, dim=1).masked_fill(vacated, 0)
        if self._room_is_short(length):
            common = min(state.padding)
            drop_leading(self.target_cache, common, length)
            drop_leading(self.draft_cache, common, length)
            state.mask = state.mask[:, common:]
            state.padding = [padding - common for padding in state.padding]

    def _room_is_short(self, length: int) -> bool:
        """On static caches, whether `length` filled positions leave too little room: for this cycle's widest verify in
        the target's cache, or for the next cycle's draft in the drafter's (a commit adds at most a verify's width,
        then the drafter writes its padded pending context and a block). Without the shared padding both fit: each
        cache holds the longest row and that much more."""
        width = self.plan.verify_width
        if self.verifier.keys is not None and length + width > self.verifier.keys:
            return True
        return is_static(self.draft_cache) and (
            length + 2 * width + self.max_block > self.draft_cache.layers[0].max_cache_len
        )

    def _commit(self, state: ActiveRows, block: int, verdict: Verdict, readout: Readout) -> None:
        """5. Anchor + accepted candidates enter the caches (a tree verify keeps the accepted path's positions only),
        the target's token becomes the next anchor, tokens are emitted: the device's tensors from `verdict`, the
        host's decisions from its `readout`."""
        kept = verdict.accepted + 1
        width = max(readout.kept)
        features = verdict.step.context_hidden_states
        if verdict.order is None:
            truncate_cache(self.target_cache, state.mask.shape[1] + width)
            if self.linear_states is not None:
                self.linear_states.keep(readout.kept)
        else:
            keep_path(self.target_cache, state.mask.shape[1], verdict.order[:, :width])
            if self.linear_states is not None:
                self.linear_states.keep(readout.kept, verdict.order)
            features = features.gather(1, verdict.order[:, :width, None].expand(-1, -1, features.shape[-1]))
        slots = torch.arange(width, device=self.device)
        state.mask = torch.cat([state.mask, (slots[None, :] < kept[:, None]).to(state.mask.dtype)], dim=1)
        state.pending_context_hidden_states = features[:, :width]
        state.pending_pos = state.committed[:, None] + slots[None, :]  # a lookup path may be longer than the block
        state.pending_shift = width - kept
        state.shifts = [width - n for n in readout.kept]
        state.padding = [padding + shift for padding, shift in zip(state.padding, state.shifts)]
        state.committed = state.committed + kept
        state.anchors = verdict.next_tokens
        state.anchor_ids = [tokens[-1] for tokens in readout.tokens]
        for i, row in enumerate(state.rows):
            emitted = self.sequences.emit(row, readout.tokens[i])
            self.sequences.record(row, emitted, block, verdict.widths[i], readout.lookup_won[i])

    def _drop_finished(self, state: ActiveRows) -> None:
        """Remove the finished rows from the active rows and from both caches."""
        keep = [i for i, row in enumerate(state.rows) if not self.sequences.finished[row]]
        if len(keep) == len(state.rows):
            return
        if not keep:  # the call is over: the caches keep their rows (a static one serves the next call)
            state.select(keep)
            return
        index = state.select(keep)
        for cache in (self.target_cache, self.draft_cache):
            select_rows(cache, index)

    def _output(self) -> DFlashGenerateOutput:
        """The sequences (finished rows right-padded) and the statistics of the call."""
        rows = self.sequences
        lengths = [n for row in rows.accepted_lengths for n in row]
        return DFlashGenerateOutput(
            sequences=rows.output(),
            accepted_lengths=rows.accepted_lengths,
            cycles=[len(row) for row in rows.accepted_lengths],
            tau=(sum(lengths) / len(lengths)) if lengths else 0.0,
            draft_time=self.draft_timer.total,
            verify_time=self.verify_timer.total,
            prefill_time=self.prefill_timer.total,
            block_size=self.max_block,
            block_sizes=rows.block_sizes,
            lookup_wins=rows.lookup_wins if self.plan.lookup_branch else [],
            verify_widths=rows.verify_widths,
        )
