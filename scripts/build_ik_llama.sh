#!/usr/bin/env bash
# Builds ik_llama.cpp's `llama-bench` (github.com/ikawrakow/ik_llama.cpp, the CPU-speed fork of llama.cpp: a peer
# of bench_peers.py --ik-llama-bench) from a source tree you bring: a checkout, or a bare git directory
# (its HEAD is checked out beside the build). llama-bench is one of its examples; no server
# (-DLLAMA_BUILD_SERVER=OFF: its web-UI files are not needed). Needs cmake and a C++ compiler; ~15 min on 2 cores.
# Usage: scripts/build_ik_llama.sh SRC [OUT_DIR]   (default ~/.cache/minivllm/ik_llama.cpp; prints the bin directory)
set -euo pipefail
SRC=${1:?usage: $0 SRC [OUT_DIR]  (an ik_llama.cpp checkout or bare git directory)}
OUT=${2:-$HOME/.cache/minivllm/ik_llama.cpp}
BIN=$OUT/build/bin
if [ ! -x "$BIN/llama-bench" ]; then
  mkdir -p "$OUT"
  if [ ! -f "$SRC/CMakeLists.txt" ]; then  # a bare repository: export its HEAD once, less blobs it lacks
    rm -rf "$OUT/src" && mkdir -p "$OUT/src"    # (a shallow mirror may omit web-UI pages and vocab files)
    tree=$(git --git-dir "$SRC" ls-tree -r HEAD)
    missing=$(awk '{print $3}' <<<"$tree" | git --git-dir "$SRC" cat-file --batch-check | awk '$2 == "missing" {print $1}')
    excludes=()
    for path in $(awk -v m="$missing" 'BEGIN {n = split(m, h, "\n"); for (i = 1; i <= n; i++) skip[h[i]] = 1}
                                       $3 in skip {print $4}' <<<"$tree"); do
      excludes+=(":(exclude)$path")
    done
    GIT_INDEX_FILE=$OUT/index git --git-dir "$SRC" --work-tree "$OUT/src" checkout -q HEAD -- . "${excludes[@]}"
    SRC=$OUT/src
  fi
  cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF >/dev/null
  cmake --build "$OUT/build" --target llama-bench -j "$(nproc)" >/dev/null
fi
echo "$BIN"
