"""Check a DFlash drafter in llama.cpp against plain llama.cpp and against dflash-hf's engine (CPU, greedy).

Run by `examples/interop/llama_cpp.sh`, which builds llama.cpp, exports the drafter and starts two `llama-server`s on
this machine: one plain, one with the drafter (`-md drafter.gguf --spec-type draft-dflash`). For every bench prompt
this script sends the same chat-templated text to both at temperature 0 and checks

(a) every completion of the speculative server equals the plain server's, through `/completion` and
(c) the same holds through the OpenAI-style `/v1/completions` endpoint of both servers;
(b) llama.cpp's acceptance (accepted drafts per drafted token, from the server's `timings`) next to dflash-hf's own
    engine with the same drafter and block size on the float32 target. The two targets differ (llama.cpp runs the
    quantized GGUF), so their greedy continuations part after a while and acceptance is compared as a rate, not token
    by token: the report gives both and their difference.

Prints one Markdown table per prompt set and writes `llama_cpp_check.json`; exits 1 when a completion differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_hf.bench.llama_cpp import complete, complete_openai, wait_until_ready


def engine_acceptance(target_name: str, drafter_dir: Path, prompts: list, max_tokens: int, block_size: int) -> float:
    """Accepted drafts per drafted token of dflash-hf's engine (the DFlash block alone, float32 target)."""
    import torch

    import dflash_hf
    from dflash_hf.targets import load_target

    target, _ = load_target(target_name)
    drafter = dflash_hf.DFlashDraftModel.from_pretrained(drafter_dir).eval()
    accepted = drafted = 0
    for prompt in prompts:
        out = dflash_hf.generate(
            target, drafter, torch.tensor([prompt.input_ids]), max_new_tokens=max_tokens, do_sample=False,
            block_size=block_size, candidates="dflash", return_dict_in_generate=True,
        )  # fmt: skip
        lengths = out.accepted_lengths[0]
        accepted += sum(n - 1 for n in lengths)
        drafted += (block_size - 1) * len(lengths)
    return accepted / drafted if drafted else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", required=True, help="URL of the plain llama-server")
    parser.add_argument("--speculative", required=True, help="URL of the llama-server with the drafter")
    parser.add_argument("--target", default="smollm2-135m", help="named target (tokenizer, engine comparison)")
    parser.add_argument("--drafter", type=Path, required=True, help="the drafter folder the GGUF was exported from")
    parser.add_argument("--prompts", default="humaneval,sharegpt", help="prompt sets, as `dflash-hf bench --prompts`")
    parser.add_argument("--prompts-dir", default=None, help="local <benchmark>.jsonl files, as `dflash-hf bench`")
    parser.add_argument("--num-prompts", type=int, default=6, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=8, help="the server's --spec-draft-n-max + 1")
    parser.add_argument("--out", type=Path, default=Path("llama_cpp_check.json"))
    args = parser.parse_args(argv)

    from dflash_hf.bench import load_bench_prompts
    from dflash_hf.targets import load_target

    _, tokenizer = load_target(args.target)
    wait_until_ready(args.plain)
    wait_until_ready(args.speculative)
    report, differ = {}, 0
    for prompt_set in args.prompts.split(","):
        prompts, _ = load_bench_prompts(prompt_set, tokenizer, args.num_prompts, prompts_dir=args.prompts_dir)
        rows, drafted, accepted, plain_s, spec_s = [], 0, 0, 0.0, 0.0
        for prompt in prompts:
            text = tokenizer.decode(prompt.input_ids)
            plain = complete(args.plain, text, args.max_tokens)
            spec = complete(args.speculative, text, args.max_tokens)
            openai = complete_openai(args.plain, text, args.max_tokens)
            openai_same = complete_openai(args.speculative, text, args.max_tokens) == openai
            same = spec["content"] == plain["content"]
            differ += (not same) + (not openai_same)
            timings = spec.get("timings", {})
            drafted += int(timings.get("draft_n", 0))
            accepted += int(timings.get("draft_n_accepted", 0))
            plain_s += plain["timings"]["predicted_ms"] / 1000
            spec_s += timings.get("predicted_ms", 0.0) / 1000
            rows.append({"id": prompt.id, "identical": same, "openai_identical": openai_same, "timings": timings})
        engine = engine_acceptance(args.target, args.drafter, prompts, args.max_tokens, args.block_size)
        llama = accepted / drafted if drafted else 0.0
        report[prompt_set] = {
            "prompts": rows,
            "llama_cpp_acceptance": llama,
            "engine_acceptance": engine,
            "speedup": plain_s / spec_s if spec_s else None,
        }
        print(f"\n{prompt_set}: {sum(r['identical'] for r in rows)}/{len(rows)} identical (/completion), "
              f"{sum(r['openai_identical'] for r in rows)}/{len(rows)} (/v1/completions)")  # fmt: skip
        print("| acceptance per drafted token | llama.cpp | dflash-hf engine | difference | llama.cpp speedup |")
        print("|---|---:|---:|---:|---:|")
        speedup = report[prompt_set]["speedup"]
        print(f"| B={args.block_size} | {llama:.3f} | {engine:.3f} | {llama - engine:+.3f} | "
              f"{'n/a' if speedup is None else f'{speedup:.2f}x'} |")  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if differ:
        print(f"error: {differ} completion(s) differ from plain llama.cpp", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
