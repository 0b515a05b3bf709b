"""Quantized linear layers on AMX tiles against the AVX512-VNNI kernel and torch's bfloat16 GEMM, one shape at a
time, in one run (models/kernels/csrc/gguf_amx.c). Needs a CPU with AMX-BF16 (Sapphire Rapids or later).

For each weight shape of the default model (SmolLM2-135M, Q4_1 linears, Q8_0 LM head) and of the 1B shape
(Llama-3.2-1B's Q4_K_M: Q4_K, Q6_K), random blocks with sane scales (speed does not depend on values), R16
repacked, bfloat16 activations of M rows: milliseconds per call of the VNNI kernel on int16 and on int8
activations (`vnni`, `vnni_int8`), the AMX kernel (the weights dequantized to bfloat16 tiles), and
torch.nn.functional.linear on the weight dequantized to bfloat16 (oneDNN's AMX brgemm, what vLLM-CPU runs), best of
--repeats after a warm-up; GMAC/s and the AMX speed-up over the int16 kernel. One JSON line per shape and M.

    OMP_NUM_THREADS=2 taskset -c 0,1 python scripts/bench_amx.py --rows 1 2 4 8 16 64 512

With --engine MODEL.gguf, the whole engine instead (one kernel family per process: run it once per
MINIVLLM_GGUF_KERNEL, and with --quantization none for torch's bfloat16 linears): W64 output tok/s (the 64 requests
of scripts/data/workload.jsonl, greedy, EOS ignored), pp512 prompt tok/s and batch-1 ms per output token, best of
--repeats, prefix cache reset before each timed run. One JSON line. --dtype float32 runs float32 activations;
--requests N --max-tokens T the first N requests with T output tokens each (the 1B shape's 32 x 128).

    MINIVLLM_GGUF_KERNEL=vnni OMP_NUM_THREADS=2 taskset -c 0,1 python scripts/bench_amx.py --engine model.gguf
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common

from models.kernels import cpu_kernels, ops  # noqa: E402
from tests.gguf_blocks import random_blocks  # noqa: E402

# (name, type, output rows N, input columns K)
SHAPES = [
    ("135M qkv", T.Q4_1, 960, 576),
    ("135M gate|up", T.Q4_1, 3072, 576),
    ("135M down", T.Q4_1, 576, 1536),
    ("135M lm_head", T.Q8_0, 49152, 576),
    ("1B q", T.Q4_K, 2048, 2048),
    ("1B gate|up", T.Q4_K, 16384, 2048),
    ("1B down", T.Q6_K, 2048, 8192),
]


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def engine_bench(
    model: str,
    tokenizer: str | None,
    quantization: str | None,
    repeats: int,
    dtype: str = "bfloat16",
    requests: int = 64,
    max_tokens: int | None = None,
) -> dict:
    """W64 output tok/s (the first `requests` of the workload, `max_tokens` each if given), pp512 prompt tok/s and
    batch-1 ms per token of the engine in `dtype` on `model`."""
    from bench_common import DEFAULT_WORKLOAD, load_jsonl

    from engine import LLM, SamplingParams
    from engine.worker.host_memory import wait_for_prefault

    llm = LLM(model=model, tokenizer=tokenizer, dtype=dtype, quantization=quantization, max_num_seqs=64)
    wait_for_prefault()
    reqs = load_jsonl(DEFAULT_WORKLOAD, requests, max_tokens)

    def timed(prompts: list[list[int]], max_tokens: list[int]) -> float:
        llm.reset_prefix_cache()
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    row = {
        "model": Path(model).name,
        "kernel": os.environ.get("MINIVLLM_GGUF_KERNEL", "auto"),
        "quantization": quantization or "gguf",
        "dtype": dtype,
        "threads": torch.get_num_threads(),
    }
    prompt512 = [(reqs[0].prompt_token_ids * 8)[:512]]
    timed(prompt512, [1])  # warm-up
    row["pp512_tok_s"] = round(512 / min(timed(prompt512, [1]) for _ in range(repeats)), 1)
    one = [reqs[1].prompt_token_ids]
    row["batch1_ms"] = round(1e3 * min((timed(one, [65]) - timed(one, [1])) / 64 for _ in range(repeats)), 2)
    out = sum(r.max_tokens for r in reqs)
    row[f"w{len(reqs)}_tok_s"] = round(
        out / min(timed([r.prompt_token_ids for r in reqs], [r.max_tokens for r in reqs]) for _ in range(repeats)), 1
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="*", help="names (substrings) of the shapes to run; default all")
    parser.add_argument("--engine", metavar="GGUF", help="the whole engine on this model instead (see above)")
    parser.add_argument("--quantization", choices=["gguf", "none"], help="--engine: as the server's flag")
    parser.add_argument("--tokenizer", help="--engine: a tokenizer directory, if not the model's")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--engine: activations")
    parser.add_argument("--requests", type=int, default=64, help="--engine: the first N requests of the workload")
    parser.add_argument("--max-tokens", type=int, help="--engine: output tokens per request (default the workload's)")
    args = parser.parse_args()
    if args.engine:
        print(
            json.dumps(
                engine_bench(
                    args.engine,
                    args.tokenizer,
                    args.quantization,
                    args.repeats,
                    args.dtype,
                    args.requests,
                    args.max_tokens,
                )
            ),
            flush=True,
        )
        return
    lib = cpu_kernels.load()
    status = lib.gguf_amx_probe()
    if status != 1:
        sys.exit(f"no AMX here (probe status {status}: see models/quantization/gguf.py AMX_REFUSALS)")
    print(json.dumps({"threads": torch.get_num_threads(), "amx_probe": status}), flush=True)
    for name, qtype, N, K in SHAPES:
        if args.shapes and not any(s in name for s in args.shapes):
            continue
        raw = random_blocks(qtype, N, K, seed=N + K)
        r16 = ops.gguf_repack_r16(raw, qtype, K)
        wb = ops.gguf_dequantize(raw, qtype, K, torch.bfloat16)
        for M in args.rows:
            x = torch.randn(M, K).to(torch.bfloat16)
            y = torch.empty(M, N, dtype=torch.bfloat16)
            row = {"shape": name, "type": qtype.name, "N": N, "K": K, "M": M}
            for path, tiles, int8 in (("vnni", 0, False), ("vnni_int8", 0, True), ("amx", 1, False)):
                lib.gguf_amx_enable(tiles)
                row[f"{path}_ms"] = best_ms(
                    lambda: ops.gguf_linear(x, r16, qtype, N, K, True, out=y, int8_activations=int8), args.repeats
                )
            lib.gguf_amx_enable(0)
            row["torch_bf16_ms"] = best_ms(lambda: torch.nn.functional.linear(x, wb), args.repeats)
            for key in ("vnni", "vnni_int8", "amx", "torch_bf16"):
                row[f"{key}_gmacs"] = round(M * N * K / row[f"{key}_ms"] / 1e6, 1)
                row[f"{key}_ms"] = round(row[f"{key}_ms"], 4)
            row["amx_vs_vnni"] = round(row["vnni_ms"] / row["amx_ms"], 2)
            row["amx_vs_torch_bf16"] = round(row["torch_bf16_ms"] / row["amx_ms"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
