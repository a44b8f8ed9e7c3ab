"""The engine's device-to-host reads: one per cycle, whatever the batch, decoding or drafter (a draft tree's search
reads the drafter's top tokens on top of it).

The tests count both kinds of read (`testing_utils.host_reads`) on CPU while a generation call sets up and prefills,
then while it runs its cycles (Transformers' `generate` set-up and the call's checks before it are not the engine's).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from testing_utils import host_reads, left_padded, make_drafter, make_target
from transformers import CompileConfig

import dflash_hf
from dflash_hf.engine import generation_call
from dflash_hf.engine.oracle import OracleDrafts

# a cycle reads once: the accepted lengths, the committed tokens and the per-row flags, packed in one tensor
READS_PER_CYCLE = 1
# before its first cycle a call reads the special token ids its padding and stopping criteria hold (2), the prompts
# with their masks (1) and the rows' first tokens (1); Transformers reads a padded prompt's mask twice more in the
# prefill forward (to choose its attention kernel)
SETUP_READS, PADDED_PROMPT_READS = 4, 2
# a draft tree grows on the host: its search reads the drafter's top tokens per slot once, before the verify
TREE_READS_PER_CYCLE = 2
# with a Markov head a node's children follow its own token: the search reads those of every node whose parent is on
# the chain at once, and those of a node further off the chain when it reaches one (at most `DEFAULT_TREE_NODES` per
# row and cycle; a fraction of a read per cycle on average in these runs)
MARKOV_TREE_READS_PER_CYCLE = 3
BLOCK = 4


@contextlib.contextmanager
def counted_reads(monkeypatch, value_dependent_ops: bool = True) -> Iterator[dict[str, Counter]]:
    """Counts the host reads of every `GenerationCall` inside the block: `"prefill"` from the call's set-up to its
    first tokens, `"cycles"` from there to its output, and the cycles run (`"count"`). The value-dependent ops are
    counted by a dispatch mode, under which dynamo compiles nothing: `value_dependent_ops=False` counts the reads
    alone, and compiled forwards run compiled."""
    tally = {"prefill": Counter(), "cycles": Counter(), "count": Counter()}
    call = generation_call.GenerationCall
    real_init, real_run, real_prefill, real_cycle = call.__init__, call.run, call._prefill, call._cycle
    with host_reads(monkeypatch, value_dependent_ops) as reads:

        def counted(bucket, function, *args, **kwargs):
            with reads.counting():
                out = function(*args, **kwargs)
            tally[bucket].update(reads.counts)
            reads.counts.clear()
            return out

        def cycle(self, state):
            tally["count"]["cycles"] += 1
            return real_cycle(self, state)

        monkeypatch.setattr(call, "__init__", lambda self, *a, **k: counted("prefill", real_init, self, *a, **k))
        monkeypatch.setattr(call, "_prefill", lambda self: counted("prefill", real_prefill, self))
        monkeypatch.setattr(call, "run", lambda self: counted("cycles", real_run, self))
        monkeypatch.setattr(call, "_cycle", cycle)
        yield tally


def _drafter(target, markov: bool):
    if not markov:
        return make_drafter(target, block_size=BLOCK)
    drafter = make_drafter(target, block_size=BLOCK, markov_rank=8, markov_gated=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in drafter.markov_head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 3.0)
    return drafter


def _prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths whose text repeats (so lookup continuations are found)."""
    motifs = [[5, 9, 13, 17, 21], [7, 11, 30], [40, 41, 42, 43], [8, 19, 8, 23, 50, 51]]
    return left_padded([(motifs[i] * 4)[: 9 + 3 * i] for i in range(batch)])


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.mark.parametrize("markov", [False, True], ids=["plain-drafter", "markov-head"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup", "tree"])
def test_a_cycle_reads_the_device_once(target, monkeypatch, candidates, batch, do_sample, markov):
    drafter = _drafter(target, markov)
    input_ids, attention_mask = _prompts(batch)
    sampling = dict(do_sample=True, temperature=0.8, top_k=20) if do_sample else dict(do_sample=False)
    torch.manual_seed(0)
    with counted_reads(monkeypatch) as tally:
        dflash_hf.generate(
            target,
            drafter,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=20,
            candidates=candidates,
            eos_token_id=[99],  # no early stop: every row runs the same cycles
            **sampling,
        )
    cycles = tally["count"]["cycles"]
    assert cycles >= 4
    padded = not bool(attention_mask.all())
    assert sum(tally["prefill"].values()) <= SETUP_READS + PADDED_PROMPT_READS * padded, tally["prefill"]
    bound = READS_PER_CYCLE
    if candidates == "tree" and not do_sample:  # sampling verifies the chain
        bound = MARKOV_TREE_READS_PER_CYCLE if markov else TREE_READS_PER_CYCLE
    assert sum(tally["cycles"].values()) <= bound * cycles, (dict(tally["cycles"]), cycles)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup"])
def test_a_dflash2_cycle_reads_the_device_once(target, monkeypatch, candidates, do_sample):
    """The candidate selector's walk stays on the device: a DFlash 2 cycle reads once, as any cycle does."""
    drafter = make_drafter(
        target, block_size=BLOCK, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4
    )
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "candidate_selector" in name:
                parameter.normal_(0.0, 1.0)
    input_ids, attention_mask = _prompts(4)
    sampling = dict(do_sample=True, temperature=0.8) if do_sample else dict(do_sample=False)
    torch.manual_seed(0)
    with counted_reads(monkeypatch) as tally:
        dflash_hf.generate(
            target,
            drafter,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=20,
            candidates=candidates,
            eos_token_id=[99],
            **sampling,
        )
    cycles = tally["count"]["cycles"]
    assert cycles >= 4
    assert sum(tally["cycles"].values()) <= READS_PER_CYCLE * cycles, (dict(tally["cycles"]), cycles)


@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup"])
def test_a_cycle_with_oracle_drafts_reads_the_device_once(target, monkeypatch, candidates):
    input_ids, attention_mask = _prompts(4)
    plain = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, eos_token_id=[99])
    oracle = OracleDrafts(plain[:, input_ids.shape[1] :], keep=0.7)
    with counted_reads(monkeypatch) as tally:
        dflash_hf.generate(
            target,
            _drafter(target, markov=False),
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=20,
            candidates=candidates,
            eos_token_id=[99],
            oracle=oracle,
        )
    cycles = tally["count"]["cycles"]
    assert cycles >= 4 and sum(tally["cycles"].values()) <= READS_PER_CYCLE * cycles, dict(tally["cycles"])


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention-target", "hybrid-target"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup"])
def test_a_compiled_cycle_reads_the_device_once(target, monkeypatch, candidates, batch, hybrid):
    """`compile=True` keeps the bound: the static caches' edits, the padded drafter context and the masks over the
    whole cache are decided on the host, and the compiled forwards read nothing; nor does a hybrid target's rollback
    after each compiled verify."""
    target = make_target("qwen3_5_text") if hybrid else target
    drafter = _drafter(target, markov=False)
    input_ids, attention_mask = _prompts(batch)
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    call = dict(attention_mask=attention_mask, max_new_tokens=20, candidates=candidates, eos_token_id=[99])
    dflash_hf.generate(target, drafter, input_ids, compile=config, **call)  # compiles outside the count
    with counted_reads(monkeypatch, value_dependent_ops=False) as tally:
        dflash_hf.generate(target, drafter, input_ids, compile=config, **call)
    cycles = tally["count"]["cycles"]
    assert cycles >= 4 and sum(tally["cycles"].values()) <= READS_PER_CYCLE * cycles, dict(tally["cycles"])


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("candidates", ["dflash", "dflash+lookup", "tree"])
def test_a_hybrid_targets_cycle_reads_the_device_once(monkeypatch, candidates, batch):
    """A hybrid target's rollback (and a tree's path batch) reads nothing: what it needs of the verdict is the kept
    counts the cycle's one read brought to the host; the paths come from the host's trees."""
    target = make_target("qwen3_5_text")
    input_ids, attention_mask = _prompts(batch)
    with counted_reads(monkeypatch) as tally:
        dflash_hf.generate(
            target,
            make_drafter(target, block_size=BLOCK),
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=20,
            candidates=candidates,
            eos_token_id=[99],
        )
    cycles = tally["count"]["cycles"]
    assert cycles >= 4
    bound = TREE_READS_PER_CYCLE if candidates == "tree" else READS_PER_CYCLE
    assert sum(tally["cycles"].values()) <= bound * cycles, (dict(tally["cycles"]), cycles)
