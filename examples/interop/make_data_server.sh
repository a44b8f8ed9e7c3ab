#!/usr/bin/env bash
# Regenerate training rows through llama.cpp's llama-server and check them against in-process make-data
# (examples/interop/check_make_data_server.py): the same prompt tokens, responses that are the served model's own
# greedy tokens, and rows/s side by side. Not part of the test run: the first call builds llama.cpp into WORK_DIR.
#
#   bash examples/interop/make_data_server.sh [WORK_DIR] [TARGET] [ROWS]   # from the repository root
#   TARGET: a named target with a GGUF (default qwen2.5-coder-0.5b); ROWS: rows to regenerate (default 256)
# Environment: THREADS (default 2), SLOTS (llama-server's parallel slots = requests in flight, default 16),
# MAX_NEW_TOKENS (default 128).
set -euo pipefail
work="$(mkdir -p "${1:-runs/make-data-server}" && cd "${1:-runs/make-data-server}" && pwd)"
target="${2:-qwen2.5-coder-0.5b}"
rows="${3:-256}"
slots="${SLOTS:-16}"
max_new="${MAX_NEW_TOKENS:-128}"
here="$(cd "$(dirname "$0")" && pwd)"
bin="$("$here/build_llama_cpp.sh" "$work")"
gguf="$(python -c "from dflash_hf.targets import TARGETS; import pathlib; print(TARGETS['$target'].gguf_file(pathlib.Path('$work')))")"
# each slot holds one prompt (at most 256 tokens) and its answer
"$bin/llama-server" -m "$gguf" -t "${THREADS:-2}" -np "$slots" -c "$((slots * (256 + max_new + 16)))" \
    --host 127.0.0.1 --port 18090 > "$work/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf http://127.0.0.1:18090/health > /dev/null && break; sleep 1; done
HF_HUB_OFFLINE=1 python "$here/check_make_data_server.py" --server http://127.0.0.1:18090 --target "$target" \
    --rows "$rows" --max-new-tokens "$max_new" --concurrency "$slots" --work "$work"
