#!/usr/bin/env bash
# Check, on CPU, that vLLM's speculators library reads the bundled drafter's exports as the drafter dflash-hf runs
# (examples/interop/check_speculators.py). Not part of the test run: it installs speculators into its own virtual
# environment (it pins transformers<=5.19, older than dflash-hf needs) and takes a few minutes.
#
#   bash examples/interop/run.sh [WORK_DIR]        # from the repository root, with dflash-hf installed
set -euo pipefail
work="${1:-runs/interop}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$work"
if [ ! -x "$work/speculators-venv/bin/python" ]; then
    python3 -m venv "$work/speculators-venv"
    "$work/speculators-venv/bin/pip" install -q torch==2.13.0
    "$work/speculators-venv/bin/pip" install -q speculators==0.9.0
fi
drafter="$(python -c 'from dflash_hf.drafters import bundled_drafter_dir; print(bundled_drafter_dir("smollm2-135m"))')"
target="$(python -c 'from dflash_hf.targets import resolve_target_dir; print(resolve_target_dir("smollm2-135m"))')"
for layout in dflash-hf official speculators; do
    dflash-hf export "$drafter" "$work/smollm2-$layout" --target smollm2-135m --format "$layout" --overwrite
    dflash-hf push "$work/smollm2-$layout" your-name/dflash-smollm2-135m --dry-run
done
HF_HUB_OFFLINE=1 "$work/speculators-venv/bin/python" "$here/check_speculators.py" --target "$target" \
    --dflash-hf "$work/smollm2-dflash-hf" --official "$work/smollm2-official" --speculators "$work/smollm2-speculators"
