"""Check `dflash-hf make-data --server` against a running llama-server (started by make_data_server.sh).

1. `make-data --server` regenerates ROWS rows through the server; a few rows are asked again one request at a time
   (how many come back identical shows how much llama-server's batched kernels depend on what else is in flight).
2. In-process `make-data` makes the first rows of the same prompt order with the target in float32.
3. The rows must share their prompt tokens; the report gives both rates (rows/s, response tokens/s) and how many
   responses are identical (the server computes with the GGUF's quantized weights, the in-process target with their
   float32 dequantization, so long answers may part after a near tie).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from dflash_hf.data.parts import read_parts
from dflash_hf.data.server import ServerResponder
from dflash_hf.special_tokens import token_ids
from dflash_hf.targets import load_target_shell


def make_data(args: argparse.Namespace, out: Path, rows: int, served: bool) -> float:
    """Run the make-data command; returns its wall time in seconds."""
    command = [
        "dflash-hf", "make-data", "--target", args.target, "--out", str(out), "--max-samples", str(rows),
        "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-tokens", "256", "--prompt-order", "coding-first",
        "--batch-size", str(2 * args.concurrency), "--dtype", "float32", "--quiet",
    ]  # fmt: skip
    if served:
        command += ["--server", args.server, "--concurrency", str(args.concurrency)]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--local-rows", type=int, default=32, help="rows made in-process for the comparison")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()

    served_seconds = make_data(args, args.work / "served", args.rows, served=True)
    local_seconds = make_data(args, args.work / "local", min(args.local_rows, args.rows), served=False)
    served = {r["id"]: r for r in read_parts(args.work / "served" / "parts")}
    local = {r["id"]: r for r in read_parts(args.work / "local" / "parts")}
    shared = [i for i in local if i in served]
    prompt_equal = all(
        served[i]["input_ids"][: served[i]["prompt_length"]] == local[i]["input_ids"][: local[i]["prompt_length"]]
        for i in shared
    )
    responses = {i: (r["input_ids"][r["prompt_length"] :], local[i]["input_ids"][local[i]["prompt_length"] :])
                 for i, r in served.items() if i in local}  # fmt: skip

    shell, tokenizer = load_target_shell(args.target)
    end_ids = token_ids(shell.generation_config.eos_token_id, tokenizer.eos_token_id)
    alone = ServerResponder(
        args.server, tokenizer, shell.config.get_text_config().vocab_size, args.max_new_tokens, end_ids, 1
    )
    alone.check()
    replayed = list(served.values())[:8]
    answers = alone([r["input_ids"][: r["prompt_length"]] for r in replayed])
    replay_equal = sum(a == r["input_ids"][r["prompt_length"] :] for a, r in zip(answers, replayed))

    def tokens(rows) -> int:
        return sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)

    report = {
        "target": args.target,
        "concurrency": args.concurrency,
        "served": {"rows": len(served), "seconds": round(served_seconds, 1),
                   "rows_per_s": round(len(served) / served_seconds, 3),
                   "tokens_per_s": round(tokens(served.values()) / served_seconds, 1)},
        "in_process": {"rows": len(local), "seconds": round(local_seconds, 1),
                       "rows_per_s": round(len(local) / local_seconds, 3),
                       "tokens_per_s": round(tokens(local.values()) / local_seconds, 1)},
        "prompt_tokens_equal": prompt_equal and len(shared) == len(local),
        "identical_responses": sum(a == b for a, b in responses.values()),
        "compared_responses": len(responses),
        "mean_common_prefix": round(sum(common_prefix(a, b) for a, b in responses.values()) / max(1, len(responses)), 1),
        "replayed_alone_identical": f"{replay_equal}/{len(replayed)}",
    }  # fmt: skip
    (args.work / "make_data_server_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0 if report["prompt_tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
