"""The engine runs exactly what plain `generate` runs, or refuses it with a `ValueError` naming the argument and the fix.

Logits processors (an allow-list, each checked against plain decoding), `prefix_allowed_tokens_fn` in a batch,
stop strings, the streamer contract, non-finite drafts, `inputs_embeds`, meta-device ids, a drafter or prompt on another
device than the target, block-size policy objects.
"""

from __future__ import annotations

import re

import pytest
import torch
from testing_utils import corrupt_slots, make_drafter, make_oracle, make_target, make_tokenizer, strip
from tokenizers import decoders
from transformers import StoppingCriteria, StoppingCriteriaList, WatermarkingConfig
from transformers.generation import logits_process as processors

import dflash_hf
from dflash_hf.engine.block_size import AdaptiveBlockSize, FixedBlockSize
from dflash_hf.engine.processing import EXACT_PROCESSORS, BlockLogitsProcessor

MAX_NEW = 16
EOS = torch.tensor([2])


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of uneven length (5 and 9 tokens)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 64, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    return ids, mask


def _oracle_for(target, plain: torch.Tensor):
    """An oracle proposing `plain`'s rows, wrong now and then (acceptance lengths vary across rows and cycles)."""
    corrupt = corrupt_slots(5, slot_step=2, positions=64)
    return make_oracle(target, [strip(row) for row in plain], corrupt=corrupt)


# ---------------------------------------------------------------------------------------------------------------
# logits processors: every allowed one is exact per row and slot, everything else is refused


def _row_wise_instances() -> list[processors.LogitsProcessor]:
    """One instance of every allowed processor, built the way `generate` builds it for a padded batch of 2."""
    return [
        processors.TemperatureLogitsWarper(0.7),
        processors.TopKLogitsWarper(5),
        processors.TopPLogitsWarper(0.8),
        processors.TopHLogitsWarper(0.4),
        processors.MinPLogitsWarper(0.1),
        processors.TypicalLogitsWarper(0.9),
        processors.EpsilonLogitsWarper(0.02),
        processors.EtaLogitsWarper(0.02),
        processors.SuppressTokensLogitsProcessor([5, 6, 7]),
        processors.InfNanRemoveLogitsProcessor(),
        processors.LogitNormalization(),
        processors.MinLengthLogitsProcessor(6, EOS),
        processors.MinNewTokensLengthLogitsProcessor(3, 3, EOS),
        processors.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor([2, 0])),
        processors.NoRepeatNGramLogitsProcessor(2),
        processors.SequenceBiasLogitsProcessor([[[9], 4.0], [[4, 5], -3.0]]),
        processors.NoBadWordsLogitsProcessor([[9], [4, 5]], EOS),
        processors.PrefixConstrainedLogitsProcessor(lambda batch_id, sent: [3 + batch_id, 10 + int(sent[-1]) % 7], 1),
        processors.ForcedBOSTokenLogitsProcessor(1),
        processors.ForcedEOSTokenLogitsProcessor(7, EOS),
        processors.ExponentialDecayLengthPenalty((1, 1.5), EOS, 3),
        processors.SuppressTokensAtBeginLogitsProcessor([4, 8], 3),
        processors.WatermarkLogitsProcessor(vocab_size=64, device="cpu", bias=3.0),
    ]


def test_every_allowed_processor_scores_each_row_and_slot_as_plain_decoding_does():
    """`BlockLogitsProcessor` on `(rows, slots)` logits equals each processor called on the whole batch at each step
    (what plain decoding passes it): exact per row and slot, with each row's own index and batch-wide entries."""
    instances = _row_wise_instances()
    assert {type(processor) for processor in instances} == set(EXACT_PROCESSORS)
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(3, 12, (2, 7), generator=generator)
    logits = torch.randn(2, 7, 64, generator=generator)
    for processor in instances:
        ours = BlockLogitsProcessor(processors.LogitsProcessorList([processor]))(
            logits.clone(), [0, 1], lambda: list(sequences)
        )
        for slot in range(7):
            plain = processors.LogitsProcessorList([processor])(sequences[:, : slot + 1], logits[:, slot].clone())
            assert torch.equal(ours[:, slot], plain), f"{type(processor).__name__}, slot {slot}"


def _tokens_of_row(batch_id: int, sent: torch.Tensor) -> list[int]:
    """Row 0 may use ids 3..32, row 1 ids 33..62."""
    return list(range(3 + 30 * batch_id, 33 + 30 * batch_id))


GREEDY_CASES = {
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=_tokens_of_row),
    "min_length": dict(min_length=20, eos_token_id=[int(t) for t in range(2, 12)]),
    "min_new_tokens": dict(min_new_tokens=10, eos_token_id=[int(t) for t in range(2, 12)]),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "sequence_bias": dict(sequence_bias=[[[9], 6.0], [[9, 10], 8.0]]),
    "bad_words_ids": dict(bad_words_ids=[[9], [40, 41]]),
    "forced_bos_token_id": dict(forced_bos_token_id=5),
    "forced_eos_token_id": dict(forced_eos_token_id=5),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 3.0)),
    "suppress_tokens": dict(suppress_tokens=list(range(3, 40))),
    "begin_suppress_tokens": dict(begin_suppress_tokens=list(range(3, 40))),
    "remove_invalid_values": dict(remove_invalid_values=True),
    "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.3),
    "watermarking_config": dict(watermarking_config=WatermarkingConfig(bias=6.0)),
    "warpers as logits_processor": dict(
        logits_processor=processors.LogitsProcessorList(
            [
                processors.TemperatureLogitsWarper(0.7),
                processors.TopHLogitsWarper(0.4),
                processors.TopKLogitsWarper(20),
                processors.TopPLogitsWarper(0.9),
                processors.MinPLogitsWarper(0.05),
                processors.TypicalLogitsWarper(0.95),
                processors.EpsilonLogitsWarper(0.001),
                processors.EtaLogitsWarper(0.001),
            ]
        )
    ),
}


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_allowed_processors_give_plain_greedy_output_on_a_padded_batch(target, case):
    ids, mask = _batch()
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, **GREEDY_CASES[case])
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    oracle = _oracle_for(target, plain)
    ours = dflash_hf.generate(target, oracle, ids, attention_mask=mask, **kwargs)
    assert torch.equal(ours, plain)
    hooked = target.generate(
        ids, attention_mask=mask, custom_generate=dflash_hf.custom_generate, drafter=oracle, **kwargs
    )
    assert torch.equal(hooked, plain)


class _UserProcessor(processors.LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


class _PenaltySubclass(processors.RepetitionPenaltyLogitsProcessor):
    """A subclass of an allowed processor: it may override `__call__`, so it is not on the list."""


REFUSED = {
    "guidance_scale": (
        dict(guidance_scale=1.5),
        r"`guidance_scale` \(UnbatchedClassifierFreeGuidanceLogitsProcessor\)",
    ),
    "encoder_repetition_penalty": (
        dict(encoder_repetition_penalty=1.3),
        r"`encoder_repetition_penalty` \(EncoderRepetitionPenaltyLogitsProcessor\)",
    ),
    "encoder_no_repeat_ngram_size": (
        dict(encoder_no_repeat_ngram_size=2),
        r"`encoder_no_repeat_ngram_size` \(EncoderNoRepeatNGramLogitsProcessor\)",
    ),
    "custom processor": (dict(logits_processor=[_UserProcessor()]), r"`logits_processor` \(_UserProcessor\)"),
    "subclass of an allowed processor": (
        dict(logits_processor=[_PenaltySubclass(1.2)]),
        r"`logits_processor` \(_PenaltySubclass\)",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize("entry", ["generate", "custom_generate"])
def test_processors_not_known_to_be_exact_are_refused(target, drafter, case, entry):
    kwargs, message = REFUSED[case]
    ids, mask = _batch()
    with pytest.raises(ValueError) as info:
        if entry == "generate":
            dflash_hf.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=4, **kwargs)
        else:
            target.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=4,
                custom_generate=dflash_hf.custom_generate,
                drafter=drafter,
                **kwargs,
            )
    assert re.match(message + " is not supported by DFlash generation", str(info.value)), str(info.value)
    assert "decode with plain `target.generate`" in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# stop strings, streamer


def test_stop_strings_with_the_tokenizer_stop_as_plain_generate_does(target):
    tokenizer = make_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # characters join without spaces, as stop strings need
    ids, mask = _batch()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    stop = tokenizer.decode(free[0, 9 + 4 : 9 + 6])  # two characters row 0 generates
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    ours = dflash_hf.generate(target, _oracle_for(target, free), ids, attention_mask=mask, **kwargs)
    assert torch.equal(ours, plain)


class _PerRowBudget(StoppingCriteria):
    """Row i may generate `budget[i]` new tokens; records the batch shape of every call."""

    def __init__(self, start: int, budget: list[int]) -> None:
        self.start, self.budget, self.shapes = start, torch.tensor(budget), []

    def __call__(self, input_ids, scores, **kwargs):
        self.shapes.append(tuple(input_ids.shape))
        return (input_ids.shape[1] - self.start) >= self.budget


class _StopWhenRowZeroSees(StoppingCriteria):
    """Every row stops once row 0 holds `token` (a criterion that reads across rows)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[0] == self.token).any().expand(input_ids.shape[0])


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup", "tree"])
@pytest.mark.parametrize("budget", [[12, 3], [3, 12], [1, 16], [7, 7]])
def test_batch_stopping_criteria_are_called_on_the_whole_batch(target, budget, candidates):
    ids, mask = _batch()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    plain_criterion, ours_criterion = _PerRowBudget(9, budget), _PerRowBudget(9, budget)
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False)
    plain = target.generate(
        ids, attention_mask=mask, stopping_criteria=StoppingCriteriaList([plain_criterion]), **kwargs
    )
    ours = dflash_hf.generate(
        target,
        _oracle_for(target, free),
        ids,
        attention_mask=mask,
        stopping_criteria=StoppingCriteriaList([ours_criterion]),
        candidates=candidates,
        return_dict_in_generate=True,
        **kwargs,
    )
    assert torch.equal(ours.sequences, plain)
    assert {shape[0] for shape in ours_criterion.shapes} == {2}  # the whole batch, never a row alone
    for row, accepted in enumerate(ours.accepted_lengths):  # tokens drafted past a stop leave the statistics
        assert 1 + sum(accepted) == len(strip(plain[row])) - int(mask[row].sum())  # the prefill gives the first


@pytest.mark.parametrize("budget", [[14, 15], [15, 15], [13, 16], [16, 14]])
def test_a_stop_inside_the_last_length_capped_block_is_judged(target, budget):
    """An exact oracle commits whole blocks: the block that reaches max_new_tokens also holds the stop."""
    ids, mask = _batch()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False)
    plain = target.generate(ids, attention_mask=mask, stopping_criteria=[_PerRowBudget(9, budget)], **kwargs)
    oracle = make_oracle(target, [strip(row) for row in free])
    for rows in (slice(0, 2), slice(1, 2)):
        ours = dflash_hf.generate(
            target,
            oracle,
            ids[rows],
            attention_mask=mask[rows],
            stopping_criteria=[_PerRowBudget(9, budget[rows])],
            **kwargs,
        )
        expected = (
            plain[rows]
            if rows.start == 0
            else target.generate(
                ids[rows], attention_mask=mask[rows], stopping_criteria=[_PerRowBudget(9, budget[rows])], **kwargs
            )
        )
        assert torch.equal(ours, expected)


def test_a_criterion_reading_other_rows_stops_as_in_plain_generate(target):
    ids, mask = _batch()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    token = int(free[0, 9 + 5])
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False)
    plain = target.generate(ids, attention_mask=mask, stopping_criteria=[_StopWhenRowZeroSees(token)], **kwargs)
    ours = dflash_hf.generate(
        target,
        _oracle_for(target, free),
        ids,
        attention_mask=mask,
        stopping_criteria=[_StopWhenRowZeroSees(token)],
        **kwargs,
    )
    assert torch.equal(ours, plain)


class _Recorder:
    """A streamer that records every `put`."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize("rows", [1, 2])
def test_streamer_gets_what_plain_generate_sends_it(target, rows):
    """The prompt, then one `(batch,)` tensor per step (pad in rows that have stopped), then one `end()`."""
    ids, mask = _batch()
    ids, mask = ids[-rows:], mask[-rows:]
    free = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=int(free[0, 9 + 3]))  # row 0 stops early
    plain_streamer, ours_streamer = _Recorder(), _Recorder()
    plain = target.generate(ids, attention_mask=mask, streamer=plain_streamer, **kwargs)
    oracle = _oracle_for(target, plain)
    ours = dflash_hf.generate(target, oracle, ids, attention_mask=mask, streamer=ours_streamer, **kwargs)
    assert torch.equal(ours, plain)
    assert [p.shape for p in ours_streamer.puts] == [p.shape for p in plain_streamer.puts]
    assert all(torch.equal(a, b) for a, b in zip(ours_streamer.puts, plain_streamer.puts))
    assert ours_streamer.ended == plain_streamer.ended == 1


# ---------------------------------------------------------------------------------------------------------------
# non-finite draft logits


def _diverged(drafter, from_slot: int, value: float):
    """`drafter` with its hidden states at block slots >= `from_slot` replaced by `value` (NaN, or the inf of an
    overflowing fp16 drafter)."""
    forward = drafter.forward

    def diverged_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.last_hidden_state[:, from_slot:] = value
        return out

    drafter.forward = diverged_forward
    return drafter


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, top_k=1)], ids=["greedy", "sample"])
def test_non_finite_draft_slots_are_rejected_and_the_output_is_the_targets(target, value, sampling):
    """top_k=1 makes sampling deterministic, so the output must equal plain decoding's exactly; the drafts before the
    non-finite slot are still accepted."""
    ids = _batch()[0][1:]
    kwargs = dict(max_new_tokens=MAX_NEW, eos_token_id=[99], **sampling)
    plain = target.generate(ids, **kwargs)
    oracle = _diverged(make_oracle(target, [plain[0].tolist()]), from_slot=2, value=value)
    for proposal in ("sample", "argmax"):
        out = dflash_hf.generate(
            target, oracle, ids, sampling_proposal=proposal, candidates="dflash", return_dict_in_generate=True, **kwargs
        )
        assert torch.equal(out.sequences, plain)
        lengths = set(out.accepted_lengths[0][:-1])  # slot 1 is accepted every cycle
        # sampling rejects the non-finite slot 2; greedy keeps its stand-in draft only where it is the target's token
        assert lengths == {2} if sampling["do_sample"] else min(lengths) >= 2


# ---------------------------------------------------------------------------------------------------------------
# prompts that are not token ids, block-size policies


def test_inputs_embeds_is_refused_with_or_without_input_ids(target, drafter):
    ids = _batch()[0][1:]
    embeds = torch.randn(1, ids.shape[1], 64)
    calls = [
        lambda: dflash_hf.generate(target, drafter, ids, inputs_embeds=embeds, max_new_tokens=4),
        lambda: dflash_hf.generate(target, drafter, None, inputs_embeds=embeds, max_new_tokens=4),
        lambda: target.generate(
            ids, inputs_embeds=embeds, max_new_tokens=4, custom_generate=dflash_hf.custom_generate, drafter=drafter
        ),
        lambda: target.generate(
            inputs_embeds=embeds, max_new_tokens=4, custom_generate=dflash_hf.custom_generate, drafter=drafter
        ),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"^`inputs_embeds` is not supported by DFlash generation"):
            call()


def test_meta_device_ids_are_a_value_error(target, drafter):
    with pytest.raises(ValueError, match=r"^`input_ids` is on the meta device"):
        dflash_hf.generate(target, drafter, torch.ones(1, 4, dtype=torch.long, device="meta"), max_new_tokens=4)


def test_a_drafter_on_another_device_than_the_target_is_a_value_error(target):
    meta_drafter = make_drafter(target).to("meta")
    ids = torch.tensor([[5, 6, 7]])
    for call in (
        lambda: dflash_hf.generate(target, meta_drafter, ids, max_new_tokens=4),
        lambda: target.generate(ids, max_new_tokens=4, custom_generate=dflash_hf.custom_generate, drafter=meta_drafter),
    ):
        with pytest.raises(ValueError, match=r"^The drafter is on meta but the target is on cpu: move it there"):
            call()


def test_a_target_dispatched_over_several_devices_is_a_value_error(target, drafter, monkeypatch):
    monkeypatch.setattr(target, "hf_device_map", {"model.embed_tokens": 0, "model.layers.0": 0, "lm_head": 1}, False)
    with pytest.raises(ValueError, match=r"^The target is dispatched over several devices \(0, 1; `device_map`\)"):
        dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=4)
    monkeypatch.setattr(target, "hf_device_map", {"": "cpu"}, False)  # one device: runs
    assert dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=4).shape == (1, 7)


def test_a_prompt_on_another_device_than_the_target_is_a_value_error(target, drafter, monkeypatch):
    """The target and drafter on one accelerator, the prompt left on the CPU: refused before any forward."""
    elsewhere = torch.device("cuda", 0)
    monkeypatch.setattr(type(target), "device", property(lambda self: elsewhere))
    monkeypatch.setattr(type(drafter), "device", property(lambda self: elsewhere))
    with pytest.raises(ValueError, match=r"^`input_ids` is on cpu but the target is on cuda:0: pass `input_ids.to"):
        dflash_hf.generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=4)


def test_an_unsatisfiable_prefix_constraint_names_its_batch_id(target, drafter):
    """As plain `generate` says: the empty list came for batch ID 1, whatever the engine's per-row binding."""
    ids, mask = _batch()

    def only_row_0(batch_id: int, sent: torch.Tensor) -> list[int]:
        return [] if batch_id == 1 else [5]

    with pytest.raises(ValueError, match=r"returned an empty list for batch ID 1\."):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, prefix_allowed_tokens_fn=only_row_0)
    with pytest.raises(ValueError, match=r"^`prefix_allowed_tokens_fn` returned an empty list for batch ID 1: "):
        dflash_hf.generate(
            target, drafter, ids, attention_mask=mask, max_new_tokens=4, prefix_allowed_tokens_fn=only_row_0
        )


@pytest.mark.parametrize("max_new_tokens", [4, 0])
def test_a_target_or_drafter_that_is_no_model_is_a_value_error(target, drafter, max_new_tokens):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"^`target` must be a Transformers causal LM .*, got NoneType\.$"):
        dflash_hf.generate(None, drafter, ids, max_new_tokens=max_new_tokens)
    with pytest.raises(ValueError, match=r"^`drafter` must be a DFlashDraftModel, got NoneType\.$"):
        dflash_hf.generate(target, None, ids, max_new_tokens=max_new_tokens)


class _GreedyPolicy:
    """A caller's policy that always asks for `size`."""

    def __init__(self, size: int) -> None:
        self.size, self.observed = size, 0

    def next_block_size(self) -> int:
        return self.size

    def observe(self, block_size, committed, seconds) -> None:
        self.observed += 1


def test_block_size_policy_objects_are_held_to_the_trained_block_size(target, drafter):
    ids = _batch()[0][1:]
    for policy, message in (
        (AdaptiveBlockSize(20), r"^The block-size policy AdaptiveBlockSize drafts blocks of up to 20 tokens but the "),
        (FixedBlockSize(8), r"^The block-size policy FixedBlockSize drafts blocks of up to 8 tokens"),
        (
            _GreedyPolicy(20),
            r"^The block-size policy _GreedyPolicy proposed block size 20: `next_block_size\(\)` must ",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            dflash_hf.generate(target, drafter, ids, block_size=policy, max_new_tokens=8)
    policy = _GreedyPolicy(3)
    out = dflash_hf.generate(target, drafter, ids, block_size=policy, max_new_tokens=8, return_dict_in_generate=True)
    assert set(out.block_sizes[0][:-1]) == {3} and policy.observed == len(out.block_sizes[0])
