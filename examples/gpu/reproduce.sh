#!/usr/bin/env bash
# The GPU tables of docs/results.md and docs/training.md, on one CUDA GPU, from the repository's root:
#
#   bash examples/gpu/reproduce.sh [OUT]          # OUT defaults to gpu-results
#
# 1. oracle: the engine's ceiling at a real size: a random-weight Qwen3-8B-shaped target built on the GPU (nothing to
#    download), plain greedy against oracle rows (drafts replaying plain greedy's own output, each slot kept with
#    probability P) at B=16, with the cost model's prediction beside each measured speedup;
# 1b. compiled: the same rows with --compile (static caches, compiled forwards, CUDA graphs) against greedy_static,
#    plain greedy on a static cache that Transformers compiles, with its exactness per row;
# 2. pair: the bundled SmolLM2-135M pair in bf16 and float32: every engine row against plain greedy, each row's tokens
#    identical to plain greedy and its first difference;
# 3. train: the trainer's throughput (anchor-blocks and samples per second once warm, peak memory, GPU-hours per 100k
#    samples) against batch size, online features, bf16: the bundled SmolLM2 drafter on its committed rows;
# 3b. train-paper: the same for the DFlash paper's shape (a 5-layer, B=16 drafter, examples/recipes/qwen3-8b.yaml) on
#    the random-weight Qwen3-8B-shaped target, over ShareGPT's own replies (no generation; random weights: speed only);
# 4. today (only with PARTS=today): the oracle rows of part 1 on today's targets' shapes, random weights in bf16
#    (TODAY_TARGETS: hybrid Qwen3.5-9B and Qwen3.6-27B, whose rows include the recurrent-state rollback; gpt-oss-20b,
#    Qwen3-Coder-30B-A3B, Gemma-4-31B); the 27B+ shapes need an 80 GB GPU, Gemma-4-31B an H200;
# then docs/results.md's tables of the bench runs (OUT/results.md) and the trainer's (OUT/train-throughput.md).
#
# Every setting below can be changed from the environment (e.g. BATCH_SIZES="32 64", SECONDS_PER_RUN=120, PARTS=train
# to run part 3 alone); a smoke run on a CPU: DEVICE=cpu BIG_TARGET=random:tiny-qwen3 PROMPTS=2 TOKENS=8
# BATCH_SIZES=2 BIG_BATCH_SIZES=1 SECONDS_PER_RUN=60 STEPS=3 TRAIN_ROWS=16. A training run that fails (out of memory at
# a large batch) is a row that says so; the other runs and tables go on.
set -euo pipefail

OUT=${1:-gpu-results}
DEVICE=${DEVICE:-cuda}
BIG_TARGET=${BIG_TARGET:-random:qwen3-8b}
PROMPTS=${PROMPTS:-6}
TOKENS=${TOKENS:-128}
ORACLE=${ORACLE:-1.0,0.8,0.6}
BATCH_SIZES=${BATCH_SIZES:-"16 32 64 128"}
BIG_BATCH_SIZES=${BIG_BATCH_SIZES:-"1 2 4 8"}
ANCHORS=${ANCHORS:-48}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-90}
STEPS=${STEPS:-100000}  # at most this many optimizer steps per training run (SECONDS_PER_RUN ends it first)
TRAIN_ROWS=${TRAIN_ROWS:-4096}
PARTS=${PARTS:-"oracle compiled pair train train-paper"}
TODAY_TARGETS=${TODAY_TARGETS:-"random:qwen3.5-9b random:gpt-oss-20b random:qwen3-coder-30b-a3b random:qwen3.6-27b random:gemma-4-31b"}
mkdir -p "$OUT"

runs() { [[ " $PARTS " == *" $1 "* ]]; }  # whether part $1 runs

bench() {  # the shared flags of every bench run here
    dflash-hf bench --device "$DEVICE" --prompts humaneval --num-prompts "$PROMPTS" --max-new-tokens "$TOKENS" \
        --no-progress "$@"
}

# 1. the ceiling: oracle rows at B=16 on the 8B-shaped target (no drafter rows: a random drafter accepts nothing)
if runs oracle; then
    bench --target "$BIG_TARGET" --dtype bfloat16 --block-sizes 16 --oracle "$ORACLE" --no-adaptive \
        --skip dflash,prompt_lookup,native_dflash --out "$OUT/oracle-$(echo "$BIG_TARGET" | tr ':' '-')"
fi

# 1b. the same ceiling compiled, and the bundled pair compiled in bf16, each against the compiled static-cache baseline
if runs compiled; then
    bench --target "$BIG_TARGET" --dtype bfloat16 --block-sizes 16 --oracle "$ORACLE" --no-adaptive --compile \
        --skip dflash,prompt_lookup,native_dflash --out "$OUT/oracle-$(echo "$BIG_TARGET" | tr ':' '-')-compiled"
    bench --target smollm2-135m --dtype bfloat16 --block-sizes 4,8 --no-adaptive --no-draft-tree --compile \
        --skip prompt_lookup,native_dflash --out "$OUT/smollm2-135m-bfloat16-compiled"
fi

# 2. the bundled SmolLM2 pair, bf16 then float32
if runs pair; then
    for dtype in bfloat16 float32; do
        bench --target smollm2-135m --dtype "$dtype" --block-sizes 4,8 --out "$OUT/smollm2-135m-$dtype"
    done
fi

# 4. today's targets: the ceiling on each shape, eager
if runs today; then
    for target in $TODAY_TARGETS; do
        bench --target "$target" --dtype bfloat16 --block-sizes 16 --oracle "$ORACLE" --no-adaptive \
            --skip dflash,prompt_lookup,native_dflash --out "$OUT/oracle-$(echo "$target" | tr ':' '-')" \
            || echo "oracle rows on $target did not run (out of memory on this GPU?)"
    done
fi

# the results page of the bench runs, before the trainer's parts
if runs oracle || runs compiled || runs pair || runs today; then
    dflash-hf results-doc "$OUT" --out "$OUT/results.md"
fi

# 3. the trainer against batch size: the bundled drafter continued on the committed SmolLM2 rows, online features
#    (make-data with the folder's own row count rebuilds its `dataset/` from the committed parts, generating nothing)
if runs train; then
    dflash-hf make-data --target smollm2-135m --out data/smollm2-135m/regen --max-new-tokens 192 \
        --max-prompt-tokens 192 --batch-size 48 --max-samples 12981 --device "$DEVICE" --quiet
    for batch in $BATCH_SIZES; do
        dflash-hf train --config examples/recipes/smollm2-135m.yaml --drafter dflash_hf/bundled/dflash-smollm2-135m \
            --eval_data "" --features online --bf16 true --use_cpu "$([ "$DEVICE" = cpu ] && echo true || echo false)" \
            --per_device_train_batch_size "$batch" --num_anchors "$ANCHORS" --skip_train_samples 0 \
            --max_train_samples "$TRAIN_ROWS" --max_steps "$STEPS" --max_train_seconds "$SECONDS_PER_RUN" \
            --eval_strategy no --load_best_model_at_end false --save_strategy no --logging_steps 10 \
            --output_dir "$OUT/train-smollm2-b$batch" --export_dir "$OUT/train-smollm2-b$batch/final" ||
            echo "reproduce: the smollm2 run at batch $batch failed (out of memory?); its row says so" >&2
    done
fi

# 3b. the paper's shape: its recipe with online features, one optimizer step per batch (random weights: nothing to
#    publish; the card's base model names the shape)
big=$(echo "$BIG_TARGET" | tr ':' '-')
if runs train-paper; then
    dflash-hf make-data --target "$BIG_TARGET" --prompts sharegpt --responses source --out "$OUT/data-$big" \
        --max-samples "$TRAIN_ROWS" --max-new-tokens 2048 --max-prompt-tokens 1024 --device "$DEVICE" --quiet
    for batch in $BIG_BATCH_SIZES; do
        dflash-hf train --config examples/recipes/qwen3-8b.yaml --target "$BIG_TARGET" --base_model Qwen/Qwen3-8B \
            --data "$OUT/data-$big" --features online --bf16 true \
            --use_cpu "$([ "$DEVICE" = cpu ] && echo true || echo false)" \
            --per_device_train_batch_size "$batch" --gradient_accumulation_steps 1 --max_steps "$STEPS" \
            --max_train_seconds "$SECONDS_PER_RUN" --save_strategy no --logging_steps 10 \
            --output_dir "$OUT/train-$big-b$batch" --export_dir "$OUT/train-$big-b$batch/final" ||
            echo "reproduce: the $big run at batch $batch failed (out of memory?); its row says so" >&2
    done
fi

# the trainer's table, of the parts that ran
if runs train || runs train-paper; then
    python3 - "$OUT" "$(runs train && echo "smollm2:$BATCH_SIZES")" "$(runs train-paper && echo "$big:$BIG_BATCH_SIZES")" <<'TABLE'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
lines = [
    "| drafter of | batch | steps | anchor-blocks/s (warm) | samples/s (warm) | GPU-hours per 100k samples | peak memory (GB) |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
for runs in filter(None, sys.argv[2:]):
    name, batches = runs.split(":", 1)
    for batch in batches.split():
        path = out / f"train-{name}-b{batch}" / "train_summary.json"
        if not path.exists():
            lines.append(f"| {name} | {batch} | failed (see the log) | - | - | - | - |")
            continue
        summary = json.loads(path.read_text())
        rate = summary["samples_per_second_warm"]
        hours = f"{100_000 / rate / 3600 * summary['world_size']:.1f}" if rate else "-"
        lines.append(
            f"| {name} | {batch} | {summary['global_step']} | {summary['anchor_blocks_per_second_warm']} | {rate} "
            f"| {hours} | {summary['peak_device_memory_gb']} |"
        )
(out / "train-throughput.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
TABLE
fi

