"""The quantized linears' kernels under float32 activations, one shape at a time, in one run: the AVX2 int8 kernel
on the file's blocks (`gguf_q8_linear`: activations to int8 per 32, or per 256 for the K-quants, llama.cpp's
arithmetic) against the AVX512-VNNI kernels on R16-repacked weights (`gguf_r16_linear_i8`: int8 activations per 32,
`vpdpbusd`, the default; `gguf_r16_linear`: int16 per 32, `vpdpwssd`, MINIVLLM_GGUF_ACTIVATIONS=int16), which
float32 activations take where the CPU has AVX512-VNNI (models/quantization/gguf.py). With AVX2 alone, the R16
kernels of gguf_r16_avx2.c on int8 activations (every R16 type but Q8_0; no int16 form there).

For each weight shape of scripts/bench_amx.py (the default model's Q4_1 linears and Q8_0 LM head, the 1B shape's
Q4_K and Q6_K), random blocks with sane scales (speed does not depend on values) and float32 activations of M rows:
milliseconds per call of each kernel, best of --repeats after a warm-up, GMAC/s and the R16 kernels' speed-ups
over the blocks. One JSON line per shape and M.

    OMP_NUM_THREADS=2 taskset -c 0,1 python scripts/bench_gguf_kernels.py --rows 1 8 64 512
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_amx import SHAPES, best_ms  # noqa: E402

from models.kernels import cpu_kernels, ops  # noqa: E402
from tests.gguf_blocks import random_blocks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="*", help="names (substrings) of the shapes to run; default all")
    args = parser.parse_args()
    lib = cpu_kernels.load()
    if lib is None or not lib.gguf_q8_isa():
        sys.exit("this CPU lacks AVX2 (or there is no C compiler): nothing to compare")
    vnni = bool(lib.gguf_r16_isa())
    lib.gguf_amx_enable(0)  # the VNNI kernel itself, also on an AMX CPU
    print(json.dumps({"threads": torch.get_num_threads()}), flush=True)
    for name, qtype, N, K in SHAPES:
        if args.shapes and not any(s in name for s in args.shapes):
            continue
        raw = random_blocks(qtype, N, K, seed=N + K)
        r16 = ops.gguf_repack_r16(raw, qtype, K, int8=True)
        if r16 is None:  # Q8_0 with AVX2 alone
            continue
        keys = ("int8", "r16", "r16_i8") if vnni else ("int8", "r16_i8")
        for M in args.rows:
            x, y = torch.randn(M, K), torch.empty(M, N)
            row = {"shape": name, "type": qtype.name, "N": N, "K": K, "M": M}
            row["int8_ms"] = best_ms(lambda: ops.gguf_linear(x, raw, qtype, N, K, False, y, True), args.repeats)
            if vnni:
                row["r16_ms"] = best_ms(lambda: ops.gguf_linear(x, r16, qtype, N, K, True, y), args.repeats)
            row["r16_i8_ms"] = best_ms(lambda: ops.gguf_linear(x, r16, qtype, N, K, True, y, True), args.repeats)
            for key in keys:
                row[f"{key}_gmacs"] = round(M * N * K / row[f"{key}_ms"] / 1e6, 1)
                row[f"{key}_ms"] = round(row[f"{key}_ms"], 4)
            for key in keys[1:]:
                row[f"{key}_vs_int8"] = round(row["int8_ms"] / row[f"{key}_ms"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
