"""`dflash-hf generate "PROMPT"`: stream a speculative answer from a target with its DFlash drafter.

With no flags it uses the default named target (`smollm2-135m`, see `dflash_hf.targets`) and the drafter bundled
in the package for it. The answer is streamed as it is committed; the last line reports the number of new tokens,
`tau` (tokens committed per target verify forward) and tokens/s, and with `--compare` the speedup over plain
`target.generate` of the same prompt, measured in the same process and precision after one untimed warm-up, and
whether both outputs are identical. The precision used (`--dtype`, default `auto`) and why is printed first, on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TextStreamer

from .. import mkl_choice
from ..bench.runners import static_cache_runner
from ..data.prompts import encode_prompt
from ..drafters import engine_defaults
from ..engine.acceptance import DEFAULT_SAMPLING_PROPOSAL, SAMPLING_PROPOSALS
from ..engine.candidates import CANDIDATE_SOURCES, DEFAULT_CANDIDATES, CandidatePlan
from ..engine.checks import MAX_LOOKUP_TOKENS, check_context_length
from ..engine.generation import generate
from ..runtime import Stopwatch, mkl_mode
from . import (
    add_cpu_arguments,
    add_model_arguments,
    device_of,
    drafter_dir_of,
    load_models,
    setup_cpu,
    trained_block_size,
)

T = TypeVar("T")
WARMUP_PROMPT_TOKENS = 16


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` sub-command."""
    parser = subparsers.add_parser(
        "generate",
        help="Stream a DFlash speculative answer to a prompt (default: bundled SmolLM2 target + drafter).",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument("prompt", help="The prompt (wrapped in the target's chat template when it has one).")
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Most new tokens to generate (default: 128).")
    parser.add_argument(
        "--block-size",
        type=_block_size,
        default=None,
        help="Block size, at most the drafter's, or adaptive (chosen per cycle, plain steps included) (default: the "
        "bundled pair's setting with the bundled drafter, else the drafter's block size).",
    )
    parser.add_argument(
        "--no-chat-template", action="store_true", help="Tokenize the prompt as plain text even if a template exists."
    )
    parser.add_argument(
        "--temperature", type=float, default=None, help="Sample at this temperature (default: greedy; 0 = greedy)."
    )
    parser.add_argument("--top-p", type=float, default=None, help="Nucleus sampling mass (implies sampling).")
    parser.add_argument("--top-k", type=int, default=None, help="Top-k sampling (implies sampling).")
    parser.add_argument(
        "--candidates",
        choices=CANDIDATE_SOURCES,
        default=None,
        help="dflash+lookup (the default, except where the bundled pair's setting says otherwise): also verify a prompt-lookup continuation in the same target forward (greedy "
        "only); dflash: the DFlash block alone; tree: a draft tree over the drafter's likeliest tokens per slot and "
        "the lookup continuation, as wide as it pays on this machine (greedy only).",
    )
    parser.add_argument(
        "--lookup-tokens",
        type=int,
        default=None,
        help="Longest prompt-lookup branch verified with the block (default: 7, or the block size - 1 if more).",
    )
    parser.add_argument(
        "--sampling-proposal",
        choices=SAMPLING_PROPOSALS,
        default=DEFAULT_SAMPLING_PROPOSAL,
        help="When sampling: sample each slot from the drafter (sample, default) or draft its most likely token (argmax).",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Keep the target's keys and values in a static cache and compile its verify forwards at fixed widths "
        "(torch.compile; CUDA graphs on a GPU); the warm-up pays for compiling. With --compare, greedy decoding is "
        "compared with plain greedy on a static cache, as Transformers compiles it.",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="Also run plain `target.generate` on the same prompt and report the speedup and output identity.",
    )
    parser.add_argument(
        "--device", default=None, help="Device for both models (default: cuda when available, else cpu)."
    )
    add_cpu_arguments(parser)
    parser.set_defaults(func=run)


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    for flag, value, low in (("--temperature", args.temperature, 0.0), ("--top-k", args.top_k, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}.")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}.")
    sampling = bool(args.temperature) or args.top_p is not None or args.top_k is not None
    if args.temperature == 0 and (args.top_p is not None or args.top_k is not None):
        raise ValueError("--temperature 0 means greedy decoding: drop --top-p/--top-k or use a positive temperature.")
    if not sampling:
        return {"do_sample": False}
    kwargs: dict = {"do_sample": True, "temperature": args.temperature if args.temperature is not None else 1.0}
    kwargs["top_p"] = args.top_p if args.top_p is not None else 1.0
    kwargs["top_k"] = args.top_k if args.top_k is not None else 0
    return kwargs


def _encode(tokenizer: PreTrainedTokenizerBase, prompt: str, use_template: bool) -> dict[str, torch.Tensor]:
    """`input_ids` and `attention_mask` of one prompt (chat template when asked for and the tokenizer has one); a
    `ValueError` for a prompt of no tokens."""
    use_template = use_template and bool(tokenizer.chat_template)
    ids = torch.tensor([encode_prompt(tokenizer, prompt, use_template)], dtype=torch.long)
    if ids.shape[1] == 0:
        how = "" if use_template else " (or drop --no-chat-template where the target has a chat template)"
        raise ValueError(f"The prompt {prompt!r} encodes to no tokens: pass a non-empty prompt{how}.")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _check_prompt_text(prompt: str) -> None:
    """Raise a `ValueError` unless the prompt argument is text (Python keeps undecodable argv bytes as surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"The prompt holds bytes that are not UTF-8 text (at character {err.start}): pass the prompt as UTF-8 "
            "(check the terminal's or the calling script's encoding)."
        ) from err


def _timed(device: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """Run `fn` and return its result with its wall time in seconds."""
    with Stopwatch(device) as stopwatch:
        result = fn()
    return result, stopwatch.total


def _block_size(value: str) -> int | str:
    """`argparse` type of `--block-size`: an int, or `adaptive`."""
    if value == "adaptive":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'adaptive', got {value!r}") from None


def _engine_settings(args: argparse.Namespace, trained_block_size: int) -> tuple[int | str | None, str, str]:
    """`(block_size, candidates, why)`: the flags, else the bundled pair's defaults (`drafters.engine_defaults`),
    else the engine's own; a `ValueError` for a block size the drafter was not trained for."""
    if isinstance(args.block_size, int) and not 2 <= args.block_size <= trained_block_size:
        raise ValueError(
            f"--block-size must be between 2 and the drafter's block size {trained_block_size} (or adaptive), "
            f"got {args.block_size}."
        )
    pair = engine_defaults(args.target, args.drafter)
    block_size = args.block_size if args.block_size is not None else (pair.block_size if pair else None)
    candidates = args.candidates or (pair.candidates if pair else DEFAULT_CANDIDATES)
    if args.block_size is not None and args.candidates is not None:
        why = "as asked"
    elif pair is not None:
        why = f"the {args.target} pair's defaults where no flag is given"
    else:
        why = "as asked" if args.block_size is not None or args.candidates is not None else "the engine's defaults"
    return block_size, candidates, why


def run(args: argparse.Namespace) -> int:
    """Run the `generate` sub-command; returns the exit code."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    if args.lookup_tokens is not None and not 1 <= args.lookup_tokens <= MAX_LOOKUP_TOKENS:
        raise ValueError(f"--lookup-tokens must be between 1 and {MAX_LOOKUP_TOKENS}, got {args.lookup_tokens}.")
    _check_prompt_text(args.prompt)
    sampling = _sampling_kwargs(args)
    drafter_dir = drafter_dir_of(args.target, args.drafter)
    device = device_of(args.device)
    setup_cpu(args, device)

    trained = trained_block_size(drafter_dir)
    block_size, candidates, why = _engine_settings(args, trained)
    max_block = block_size if isinstance(block_size, int) else trained
    greedy = not sampling.get("do_sample", False)
    plan = CandidatePlan(candidates, max_block, args.lookup_tokens, tree_verify=greedy)
    target, tokenizer, drafter, precision = load_models(
        args.target, drafter_dir, device, args.dtype, max_block, plan.verify_width
    )
    inputs = _encode(tokenizer, args.prompt, use_template=not args.no_chat_template)
    inputs = {key: value.to(device) for key, value in inputs.items()}
    check_context_length(target, inputs["input_ids"].shape[1], args.max_new_tokens)  # before any forward on the prompt
    print(f"precision: {precision}", file=sys.stderr, flush=True)
    if plan.source != candidates:  # what every cycle verifies, where sampling overrides the request
        why = f"{why}; {candidates} asked, sampling verifies the DFlash block alone"
    print(
        f"engine: block size {block_size or max_block}, candidates {plan.source} ({why})", file=sys.stderr, flush=True
    )
    if device.type == "cpu":
        print(f"kernels: {mkl_mode()} ({mkl_choice.reason()})", file=sys.stderr, flush=True)
    common = dict(max_new_tokens=args.max_new_tokens, **sampling)

    # one untimed pass so that neither timed run pays for first-call set-up (kernel selection, oneDNN weight packing):
    # a few prompt tokens; with --compile the timed call itself, so that every graph it runs (each verify width, the
    # drafter's) is compiled before it is timed
    warmup_ids = inputs["input_ids"] if args.compile else inputs["input_ids"][:, :WARMUP_PROMPT_TOKENS]
    generate(
        target, drafter, warmup_ids, attention_mask=inputs.get("attention_mask") if args.compile else None,
        max_new_tokens=args.max_new_tokens if args.compile else 2, do_sample=False, block_size=block_size,
        candidates=candidates, lookup_tokens=args.lookup_tokens, compile=args.compile,
    )  # fmt: skip

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out, seconds = _timed(
        device,
        lambda: generate(
            target,
            drafter,
            inputs["input_ids"],
            attention_mask=inputs.get("attention_mask"),
            block_size=block_size,
            streamer=streamer,
            return_dict_in_generate=True,
            sampling_proposal=args.sampling_proposal,
            candidates=candidates,
            lookup_tokens=args.lookup_tokens,
            compile=args.compile,
            **common,
        ),
    )
    prompt_len = inputs["input_ids"].shape[1]
    new_tokens = out.sequences[0, prompt_len:]
    rate = len(new_tokens) / seconds
    summary = f"tokens: {len(new_tokens)} | tau: {out.tau:.2f} | {rate:.2f} tokens/s"
    if args.compare:
        summary += " | " + _compare(target, inputs, common, new_tokens, rate, device, args.compile)
    print(summary, flush=True)
    return 0


def _compare(
    target: PreTrainedModel,
    inputs: dict[str, torch.Tensor],
    common: dict,
    new_tokens: torch.Tensor,
    rate: float,
    device: torch.device,
    static: bool = False,
) -> str:
    """Time plain `target.generate` with the same settings and describe the speedup and output identity; `static`:
    greedy decoding is compared with plain greedy on a static cache (warmed up first: Transformers compiles it on a
    GPU)."""
    mode = "sampling" if common["do_sample"] else "greedy"
    if static and not common["do_sample"]:
        runner = static_cache_runner(target)
        runner(inputs["input_ids"], 2)  # the prompt's own prefill shape and the decode step, compiled before timing
        run = runner(inputs["input_ids"], common["max_new_tokens"])
        baseline_tokens, seconds = torch.tensor(run.new_tokens), run.seconds
        mode = "greedy, static cache"
    else:
        baseline, seconds = _timed(device, lambda: target.generate(**inputs, **common))
        baseline_tokens = baseline[0, inputs["input_ids"].shape[1] :]
    baseline_rate = len(baseline_tokens) / seconds
    if common["do_sample"]:
        identical = "n/a (sampling)"
    else:
        identical = "yes" if torch.equal(new_tokens.cpu(), baseline_tokens.cpu()) else "no"
    return f"plain {mode} ({str(target.dtype).replace('torch.', '')}): {baseline_rate:.2f} tokens/s | speedup: {rate / baseline_rate:.2f}x | identical: {identical}"
