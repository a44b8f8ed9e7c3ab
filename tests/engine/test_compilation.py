"""`compile=True`: static target caches and compiled verify forwards at fixed widths, exact against plain greedy.

The compiled forwards run on a counting backend (dynamo traces the graph as inductor would get it, whole: `fullgraph`),
so the tests see how many graphs a call compiles without paying for inductor on CPU.
"""

from __future__ import annotations

import pytest
import torch
from testing_utils import (
    CountingBackend,
    assert_rows_are_greedy,
    corrupt_slots,
    greedy_reference,
    left_padded,
    make_drafter,
    make_oracle,
    make_target,
)
from transformers import CompileConfig
from transformers.cache_utils import DynamicCache

import dflash_hf
from dflash_hf.engine import cache_ops, compilation

MAX_NEW = 24


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Graphs counted per test: dynamo's caches start empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_config(fullgraph: bool = True) -> tuple[CompileConfig, CountingBackend]:
    """A config on a counting backend; `fullgraph=False` for the test oracle, whose lookups run outside the graph."""
    counter = CountingBackend()
    return CompileConfig(backend=counter, mode=None, fullgraph=fullgraph), counter


def _prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup", "tree"])
def test_compiled_greedy_is_exact_with_one_graph_per_shape(family, candidates):
    """Exact with a random drafter (twice: the second call compiles nothing new) and an oracle; the target compiles
    the block's width and (when a lookup branch or tree was verified) the widest tree's, the drafter its block's."""
    target = make_target(family)
    input_ids = _prompt(0, 11)
    reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
    config, counter = _compile_config()
    drafter = make_drafter(target)
    widths, frames = set(), []
    for _ in range(2):
        out = _generate(target, drafter, input_ids, candidates=candidates, compile=config)
        assert torch.equal(out.sequences, reference)
        widths.update(width for row in out.verify_widths for width in row)
        frames.append(counter.frame_count)
    assert frames[0] == frames[1] and 2 <= frames[0] <= (2 if candidates == "dflash" else 3)
    assert max(widths) <= 4 + (0 if candidates == "dflash" else 16)
    oracle_config, _ = _compile_config(fullgraph=False)
    oracle = make_oracle(target, [reference[0].tolist()])
    out = _generate(target, oracle, input_ids, candidates=candidates, compile=oracle_config)
    assert torch.equal(out.sequences, reference) and out.tau > 3


def _generate(target, drafter, input_ids, **kwargs):
    return dflash_hf.generate(
        target, drafter, input_ids, max_new_tokens=MAX_NEW, return_dict_in_generate=True, **kwargs
    )


def test_compiled_batch_with_padding_finished_rows_and_a_full_cache(monkeypatch):
    """Rows of different lengths accept different prefixes, stop at different steps (finished rows leave the batch)
    and, with a cache barely longer than the call, the padding all rows share is dropped to make room."""
    monkeypatch.setattr(compilation, "static_cache_length", lambda needed: needed)
    dropped = []
    drop_leading = cache_ops.drop_leading

    def spy(cache, count, length):
        dropped.append(count)
        drop_leading(cache, count, length)

    monkeypatch.setattr("dflash_hf.engine.generation_call.drop_leading", spy)
    target = make_target("qwen3")
    prompts = [_prompt(10 + i, n)[0] for i, n in enumerate([5, 13, 9])]
    references = [greedy_reference(target, p[None], max_new_tokens=MAX_NEW)[0] for p in prompts]
    stop = int(references[1][13 + 14])  # row 1 stops early at this token
    references = [
        greedy_reference(target, p[None], max_new_tokens=MAX_NEW)[0]
        if stop not in r[len(p) :].tolist()
        else target.generate(p[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[2, stop])[0]
        for p, r in zip(prompts, references)
    ]
    input_ids, attention_mask = left_padded(prompts)
    oracle = make_oracle(target, [r.tolist() for r in references], corrupt=corrupt_slots(3, position_step=2))
    config, counter = _compile_config(fullgraph=False)
    for candidates in ("dflash", "dflash+lookup"):
        out = dflash_hf.generate(
            target,
            oracle,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW,
            eos_token_id=[2, stop],
            candidates=candidates,
            compile=config,
            return_dict_in_generate=True,
        )
        assert_rows_are_greedy(out.sequences, input_ids.shape[1], prompts, references, candidates)
        assert len({len(row) for row in out.accepted_lengths}) > 1  # rows stopped after different cycles
    assert dropped and all(count > 0 for count in dropped)
    assert counter.frame_count >= 1


def test_a_drafter_cache_no_longer_than_the_targets_drops_the_padding_in_time(monkeypatch):
    """Caches rounded to the same length (usual: both to the same power of two): the drafter writes a padded pending
    context and a block before the verify, so the shared padding goes while the next draft still fits, not only when
    the verify would not."""
    target = make_target("llama")
    asked = {}
    take = compilation.STATIC_CACHES.take

    def same_length(model, num_layers, batch, needed, linear_layers=frozenset()):
        asked.setdefault(model is target, needed)  # the target asks first: the drafter gets its length
        return take(model, num_layers, batch, asked[True], linear_layers)

    monkeypatch.setattr(compilation, "static_cache_length", lambda needed: needed)
    monkeypatch.setattr(compilation.STATIC_CACHES, "take", same_length)
    prompts = [_prompt(20 + i, n)[0] for i, n in enumerate([4, 15, 9, 12])]
    references = [greedy_reference(target, p[None], max_new_tokens=40)[0] for p in prompts]
    input_ids, attention_mask = left_padded(prompts)
    oracle = make_oracle(target, [r.tolist() for r in references], corrupt=corrupt_slots(3, position_step=2))
    config, _ = _compile_config(fullgraph=False)
    out = dflash_hf.generate(
        target, oracle, input_ids, attention_mask=attention_mask, max_new_tokens=40, compile=config
    )  # fmt: skip
    assert_rows_are_greedy(out, input_ids.shape[1], prompts, references)
    assert asked[True] < asked[False]  # the drafter's cache is shorter than it asked for


def test_compiled_adaptive_block_sizes_and_sampling_match_the_uncompiled_engine():
    """Sampling draws the same random numbers on either path, so the same seed gives the same tokens; an adaptive
    policy compiles the verify and the drafter once per block size it chooses."""
    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids = _prompt(3, 9)
    config, counter = _compile_config()
    calls = [
        dict(do_sample=True, temperature=0.8, top_k=20),
        dict(do_sample=False, block_size="adaptive", candidates="dflash"),
    ]
    for kwargs in calls:
        outputs = []
        for compile in (False, config):
            torch.manual_seed(7)
            outputs.append(
                dflash_hf.generate(
                    target,
                    drafter,
                    input_ids,
                    max_new_tokens=MAX_NEW,
                    compile=compile,
                    return_dict_in_generate=True,
                    **kwargs,
                )
            )
        assert torch.equal(outputs[0].sequences, outputs[1].sequences), kwargs
    sizes = {size for row in outputs[1].block_sizes for size in row}
    assert counter.frame_count <= 2 * len(sizes)  # the target's verify and the drafter's forward per block size


@pytest.mark.parametrize("value", ["yes", 1, {"mode": "default"}])
def test_compile_argument_is_checked(value):
    target = make_target("llama")
    with pytest.raises(ValueError, match="compile must be True, False or a transformers CompileConfig"):
        dflash_hf.generate(target, make_drafter(target), _prompt(0, 5), max_new_tokens=4, compile=value)


def test_static_cache_edits_match_dynamic_ones():
    """Every edit of `cache_ops` leaves a static cache's filled part as it leaves a dynamic cache."""
    torch.manual_seed(0)
    keys = torch.randn(3, 2, 10, 4)
    dynamic, static = DynamicCache(), cache_ops.static_cache(1, 32)
    for cache in (dynamic, static):
        cache.update(keys, -keys, 0)
    length = 10
    edits = [
        lambda cache: cache_ops.shift_cache_right(cache, torch.tensor([0, 2, 1]), length),
        lambda cache: cache_ops.keep_path(cache, 6, torch.tensor([[0, 2, 3], [0, 1, 2], [0, 3, 3]])),
        lambda cache: cache_ops.drop_leading(cache, 2, 9),
        lambda cache: cache_ops.select_rows(cache, torch.tensor([0, 2])),
        lambda cache: cache_ops.truncate_cache(cache, 5),
    ]
    for edit in edits:
        for cache in (dynamic, static):
            edit(cache)
        filled = int(static.layers[0].cumulative_length)
        assert filled == dynamic.layers[0].keys.shape[2]
        assert torch.equal(static.layers[0].keys[..., :filled, :], dynamic.layers[0].keys)
        assert torch.equal(static.layers[0].values[..., :filled, :], dynamic.layers[0].values)


def test_calls_reuse_their_static_caches_emptied():
    """A call takes the static caches the last call of its batch size left (the compiled shapes and CUDA graph
    buffers stay valid), emptied: different prompts stay exact; a model moved to another dtype gets new ones."""
    target = make_target("llama")
    drafter = make_drafter(target)
    config, _ = _compile_config()
    taken = []
    take = compilation.STATIC_CACHES.take

    def spy(model, *args):
        cache = take(model, *args)
        taken.append((type(model).__name__, id(cache)))
        return cache

    pool = compilation.STATIC_CACHES
    try:
        pool.take = spy
        for seed in range(3):
            input_ids = _prompt(20 + seed, 7 + 3 * seed)
            reference = greedy_reference(target, input_ids, max_new_tokens=MAX_NEW)
            assert torch.equal(_generate(target, drafter, input_ids, compile=config).sequences, reference)
        assert len(set(taken)) == 2 and len(taken) == 6  # one cache for the target, one for the drafter
        target.to(torch.float64)
        drafter.to(torch.float64)
        _generate(target, drafter, _prompt(30, 5), compile=config)
        assert len(set(taken)) == 4
    finally:
        del pool.take


def test_compiled_and_eager_calls_in_threads_stay_exact():
    """Transformers' hidden-state collector is one global for the process while a compiled forward runs: compiled
    calls run one at a time and never beside an eager forward, so calls on one model from several threads, compiled
    and eager, all return plain greedy's tokens (no IndexError, no collector read across threads)."""
    import threading

    target = make_target("qwen3")
    drafter = make_drafter(target)
    prompts = [_prompt(seed, 9) for seed in range(4)]
    references = [greedy_reference(target, prompt, max_new_tokens=MAX_NEW) for prompt in prompts]
    config, _ = _compile_config()
    _generate(target, drafter, prompts[0], compile=config)  # compiled once before the threads start
    results, errors = {}, []

    def run(i: int, compiled: bool) -> None:
        try:
            for _ in range(2):
                out = _generate(target, drafter, prompts[i], **({"compile": config} if compiled else {}))
                results.setdefault((i, compiled), []).append(out.sequences)
        except Exception as err:  # noqa: BLE001 - reported below with its thread
            errors.append((i, compiled, repr(err)))

    threads = [threading.Thread(target=run, args=(i, i % 2 == 0)) for i in range(4)]
    threads += [threading.Thread(target=run, args=(i, i % 2 == 1)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for (i, _), outs in results.items():
        assert all(torch.equal(out, references[i]) for out in outs), i
