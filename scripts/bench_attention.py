"""The CPU attention kernel over a decode step's caches, against the machine's read floor, one cache kind at a time.

A W64 decode step reads the K/V of every running sequence in every layer: with --layers caches of --seqs sequences
at --depth keys each (the default model's shape: 9 query heads over 3 KV heads of 64; blocks of 16 in a random
order, as a long-running server's block table holds them), one `paged_attention_*` call per layer as the engine
makes it, each layer's cache its own tensor, so that the step's K/V outgrow the L3 as they do in the engine. Per
kind (activations:cache, e.g. bf16:bf16, float:float, float:int8, float:fp8_e4m3): milliseconds per step, best of
--repeats, the K/V bytes read and their rate, and the floor those bytes set at --bandwidth (or at this machine's
read rate, measured by summing a 1 GiB tensor). One JSON line per kind.

With --prompt N, a prompt step instead: one sequence of N new tokens (causal, an empty cache before it) through
--layers layers, and the multiply-adds it does (QK and PV, N^2 / 2 keys per head) per second.

    OMP_NUM_THREADS=2 taskset -c 0,1 python scripts/bench_attention.py --kinds bf16:bf16 float:float float:int8
    OMP_NUM_THREADS=2 taskset -c 0,1 python scripts/bench_attention.py --prompt 512 --kinds bf16:bf16 float:float
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common

from bench_common import read_rate  # noqa: E402

from engine.worker import host_memory  # noqa: E402
from models.attention.kv_cache_dtype import STORAGE, kv_cache_code, quantize_rows, row_elements  # noqa: E402
from models.kernels import cpu_kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the default model's; --heads changes the first two
DTYPES = {"bf16": torch.bfloat16, "float": torch.float32}


def step_ms(kind: str, seqs: int, depth: int, layers: int, repeats: int, prompt: int = 0) -> tuple[float, int]:
    """Best milliseconds of one step's `layers` kernel calls for `kind`, and the K/V bytes a step reads: `seqs`
    decodes at `depth` keys, or with `prompt` one sequence's prompt of that many tokens."""
    if prompt:
        seqs, depth = 1, prompt
    new = prompt or 1  # new tokens per sequence
    tokens = seqs * new
    act, cache = kind.split(":")
    dtype = DTYPES[act]
    code = 0 if cache in DTYPES else kv_cache_code(cache, HEAD_DIM)
    lib = cpu_kernels.load()
    fn = getattr(lib, f"paged_attention_{act}_q" if code else f"paged_attention_{act}")
    nblk = (depth + BLOCK - 1) // BLOCK
    tables = torch.randperm(seqs * nblk).to(torch.int32).view(seqs, nblk).contiguous()
    seq_lens = torch.full((seqs,), depth, dtype=torch.int32)
    starts = torch.arange(seqs + 1, dtype=torch.int32) * new
    positions = torch.arange(depth - new, depth)  # each sequence's new tokens
    slots = (tables[:, positions // BLOCK].long() * BLOCK + positions % BLOCK).flatten().contiguous()
    shape = (seqs * nblk, KV_HEADS, BLOCK, row_elements(HEAD_DIM, code))
    caches = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            c = host_memory.zeros(shape, STORAGE[code] if code else DTYPES[cache])
            host_memory.wait_for_prefault()
            values = torch.randn(shape[:-1] + (HEAD_DIM,))
            c.copy_(quantize_rows(values, code) if code else values.to(c.dtype))
            pair.append(c)
        caches.append(pair)
    q = torch.randn(tokens, HEADS * HEAD_DIM, dtype=dtype)
    k, v = (torch.randn(tokens, KV_HEADS * HEAD_DIM, dtype=dtype) for _ in range(2))
    out = torch.empty_like(q)

    def step():
        for kc, vc in caches:
            rc = fn(*(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0)),
                    *(kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), tokens, tables.data_ptr(), seq_lens.data_ptr()),
                    *(starts.data_ptr(), out.data_ptr(), seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, nblk),
                    *(HEAD_DIM**-0.5, 0, 0.0, torch.get_num_threads(), 1, code, None))  # fmt: skip
            if rc != 0:
                raise ValueError(f"{kind}: the kernel refused the shape")

    step()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    per_row = caches[0][0][0, 0, 0].nbytes
    return 1e3 * best, layers * seqs * depth * KV_HEADS * 2 * per_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["bf16:bf16", "float:float", "float:int8", "float:fp8_e4m3"])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--depth", type=int, default=352, help="keys per sequence (W64's mean mid-decode)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=0, metavar="N", help="a prompt step of N tokens instead")
    parser.add_argument("--bandwidth", type=float, help="GB/s for the floor (default: measured)")
    parser.add_argument("--heads", type=int, nargs=2, metavar=("Q", "KV"), help="query and KV heads (default 9 3)")
    args = parser.parse_args()
    if args.heads:
        global HEADS, KV_HEADS
        HEADS, KV_HEADS = args.heads
    if cpu_kernels.load() is None:
        sys.exit("no C compiler: the CPU kernels are not built")
    rate = args.bandwidth * 1e9 if args.bandwidth else read_rate()
    print(json.dumps({"threads": torch.get_num_threads(), "read_gb_s": round(rate / 1e9, 1)}), flush=True)
    for kind in args.kinds:
        ms, nbytes = step_ms(kind, args.seqs, args.depth, args.layers, args.repeats, args.prompt)
        if args.prompt:
            macs = args.layers * args.prompt**2 / 2 * HEADS * HEAD_DIM * 2
            row = {"kind": kind, "prompt": args.prompt, "layers": args.layers, "step_ms": round(ms, 2)}
            print(json.dumps(row | {"gmac_s": round(macs / ms / 1e6, 1)}), flush=True)
            continue
        row = {"kind": kind, "seqs": args.seqs, "depth": args.depth, "layers": args.layers, "step_ms": round(ms, 2)}
        row |= {"kv_mb": round(nbytes / 1e6, 1), "gb_s": round(nbytes / ms / 1e6, 1)}
        row["floor_ms"] = round(1e3 * nbytes / rate, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
