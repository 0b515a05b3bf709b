#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the peer of bench_peers.py --latency --llama-server) from the llama.cpp
# sources vendored in llama-cpp-python's sdist on PyPI: Debian 12 packages no llama.cpp, and llama-cpp-python's
# own build makes the library, not the server. Needs cmake and a C++ compiler; ~10 min on 2 cores.
# Usage: scripts/build_llama_server.sh [OUT_DIR]   (default ~/.cache/minivllm/llama.cpp; prints the binary's path)
set -euo pipefail
OUT=${1:-$HOME/.cache/minivllm/llama.cpp}
BIN=$OUT/build/bin/llama-server
if [ ! -x "$BIN" ]; then
  mkdir -p "$OUT"
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  rm -rf "$OUT/src" && mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$OUT/src" && rm -rf "$tmp"
  cmake -S "$OUT/src" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$OUT/build" --target llama-server -j "$(nproc)" >/dev/null
fi
echo "$BIN"
