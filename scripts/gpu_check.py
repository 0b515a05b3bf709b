"""The CUDA path checked and measured in one call on a GPU machine.

On a randomly initialised Llama-3.1-8B-shaped LlamaForCausalLM in bfloat16 (no weights travel):
(a) build the model; (b) logits of one mixed step (two decodes, the second chunk of a chunked
prefill, a prompt after a 256-token prefix-cache hit, a fresh prompt) with the flashinfer and the
torch_native backends over the same cached KV: relative error ||a - b|| / ||b|| < 2e-2;
(c) greedy decode through CUDA graphs against eager decode, 1 and 27 sequences (27 pads to 32),
teacher-forced (both paths are fed the eager token) so that one near-tie cannot derail the rest.
Graph and eager steps run different kernel configurations (padded GEMMs, FlashInfer's graph-mode
split-KV), so their logits differ in the last bits: a token mismatch passes only where the eager
top-2 logits are closer than twice the largest logit difference, and every mismatch is reported;
(d) decode step time at batch 1, 8, 32, 128, 256 with 1024 tokens of context against the floor
(weight bytes + KV bytes read) / HBM bandwidth, the bandwidth measured with a 4 GiB device-to-device
copy; (e) graphs on vs eager in the same table. A step is timed as the engine runs it: plan,
forward, logits, greedy argmax, token ids to the host. Exits with status 1 when a check fails.

Steps use the engine's own pieces, as its model runner does: AttentionMetadata from block tables,
`backend.plan(meta)` then `model(...)` for eager steps, CUDAGraphRunner for graphed decodes.

(g) with (b)'s step: the Triton kernels of models/kernels/triton_ops.py (residual-add + RMSNorm, rotary, K/V
write, SiLU-and-mul) against torch's ops, relative error < 2e-2; (h) --compare-torch-ops B: the graphed decode
step at batch B with each, what the fusion saves.
(f) with --profile B: batch B's step split into host inputs + plan, graph replay, logits; torch.profiler's
kernels per step and the heaviest ones. --compile-only HEADS KV_HEADS HEAD_DIM only JIT-compiles FlashInfer's
kernels for a shape (run beside another job; FlashInfer locks a module while it builds).

The GPU machine has no network: flashinfer-python 0.6.4 and apache-tvm-ffi travel as wheels, with the server's
(../shared/gpu/README.md lists them and gives the whole device call, with scripts/gpu_e2e.py beside this
script). On an H200 (2026-11-26) FlashInfer's JIT took ~100 s for the 8B shape's kernels and the rest of
`--batch-sizes 1 32 128 256` under a minute; the results are in docs/benchmarks.md ("CUDA").
"""

import argparse
import contextlib
import itertools
import logging
import os
import sys
import time

import torch
from transformers import LlamaConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from engine.worker.cuda_graph import CUDAGraphRunner  # noqa: E402
from models.attention.base import AttentionMetadata  # noqa: E402
from models.attention.flashinfer import FlashInferBackend, flashinfer_available  # noqa: E402
from models.attention.torch_native import TorchNativeBackend  # noqa: E402
from models.config import ModelShape  # noqa: E402
from models.kernels import ops  # noqa: E402
from models.llama import LlamaForCausalLM  # noqa: E402

BLOCK, MAX_LEN, DTYPE, DEVICE = 16, 2048, torch.bfloat16, "cuda"
LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)


def hbm_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy, counting the bytes read and written."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def new_cache(cfg, num_blocks: int):
    """The model runner's layout: one tensor, per layer a (k, v) pair of [blocks, BLOCK, kv heads, head dim]."""
    kv = torch.zeros(
        cfg.num_hidden_layers, 2, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=DTYPE, device=DEVICE
    )
    return [(layer[0], layer[1]) for layer in kv]


def step_inputs(rows, tokens):
    """(input_ids, positions, meta) of one step, built as the model runner's prepare() does.

    rows: (block table, tokens already in the cache, new tokens) per sequence, decodes first;
    tokens[i]: sequence i's token ids, at least as many as it has after the step.
    """
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for (table, start, n), toks in zip(rows, tokens):
        ids += toks[start : start + n]
        pos += range(start, start + n)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
    width = max(len(table) for table, _, _ in rows)
    tables = [table + [0] * (width - len(table)) for table, _, _ in rows]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(lens, **i32),
        block_tables=torch.tensor(tables, **i32),
        slot_mapping=torch.tensor(slots, device=DEVICE),
        num_decodes=sum(n == 1 for _, _, n in rows),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE), meta


def use_backend(model, backend):
    # The layers keep the backend they were built with; swapping it compares backends on one set of weights.
    for layer in model.layers:
        layer.self_attn.backend = backend


def eager(model, backend, ids, pos, kv, meta):
    backend.plan(meta)
    return model(ids, pos, kv, [meta] * len(kv))


def check_mixed(model, cfg, fi, native) -> bool:
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(cfg.vocab_size, (n,), generator=gen).tolist()

    blocks = itertools.count()

    def take(n_tokens):
        return [next(blocks) for _ in range(-(-n_tokens // BLOCK))]

    donor = rand(256)
    # name: (token ids, tokens in the cache before the checked step, tokens in it); decodes first
    seqs = {
        "decode a": (rand(301), 300, 1),
        "decode b": (rand(1001), 1000, 1),
        "chunk 2 of a prefill": (rand(450), 200, 250),
        "after prefix hit": (donor + rand(100), 256, 100),
        "fresh prompt": (rand(120), 0, 120),
    }
    donor_table = take(256)
    tables = {name: take(len(toks)) for name, (toks, _, _) in seqs.items()}
    # A prefix-cache hit: the first 16 blocks are the donor's, which hold the same 256 tokens.
    tables["after prefix hit"] = donor_table + tables["after prefix hit"][16:]
    kv = new_cache(cfg, next(blocks))
    # Fill the cache as earlier steps would have: the donor's prompt and the other cached prefixes.
    cached = [name for name, (_, c, _) in seqs.items() if c and name != "after prefix hit"]
    setup = step_inputs(
        [(donor_table, 0, 256)] + [(tables[name], 0, seqs[name][1]) for name in cached],
        [donor] + [seqs[name][0] for name in cached],
    )
    use_backend(model, native)
    eager(model, native, *setup[:2], kv, setup[2])
    ids, pos, meta = step_inputs(
        [(tables[name], c, n) for name, (_, c, n) in seqs.items()], [toks for toks, _, _ in seqs.values()]
    )
    logits = {}
    for name, backend in (("torch_native", native), ("flashinfer", fi), ("flashinfer, torch ops", fi)):
        t = time.perf_counter()
        use_backend(model, backend)
        copy = [(k.clone(), v.clone()) for k, v in kv]
        with ops.torch_ops() if "torch ops" in name else contextlib.nullcontext():
            logits[name] = model.compute_logits(eager(model, backend, ids, pos, copy, meta))
        torch.cuda.synchronize()
        note = " (FlashInfer's kernels compile on first use)" if name == "flashinfer" else ""
        print(f"  {name} step: {time.perf_counter() - t:.1f} s{note}")
    a, b, c = logits["flashinfer"], logits["torch_native"], logits["flashinfer, torch ops"]
    fused_rel = ((a - c).norm() / c.norm()).item()
    same = (a.argmax(-1) == c.argmax(-1)).float().mean().item()
    fused_ok = fused_rel < 2e-2
    print(
        f"(g) Triton kernels vs torch ops (norms, rotary, K/V write, SiLU-and-mul), same step: rel err "
        f"{fused_rel:.2e}, greedy token equal on {same:.1%} of rows {'PASS' if fused_ok else 'FAIL'} (< 2e-2)"
    )
    rel = ((a - b).norm() / b.norm()).item()
    for i, name in enumerate(seqs):
        lo, hi = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        row = ((a[lo:hi] - b[lo:hi]).norm() / b[lo:hi].norm()).item()
        same = (a[hi - 1].argmax() == b[hi - 1].argmax()).item()
        print(f"  {name:22s} {hi - lo:4d} tokens  rel err {row:.2e}  same last greedy token: {same}")
    ok = rel < 2e-2 and fused_ok
    print(
        f"(b) flashinfer vs torch_native logits, mixed step of {len(ids)} tokens: rel err {rel:.2e} "
        f"{'PASS' if ok else 'FAIL'} (< 2e-2)"
    )
    return ok


def check_graphs(model, cfg, fi, graphs, kv, steps: int = 16) -> bool:
    gen = torch.Generator().manual_seed(1)
    blocks = itertools.count()
    ok = True
    for n in (1, 27):
        lens = torch.randint(64, 300, (n,), generator=gen).tolist()
        toks = [torch.randint(cfg.vocab_size, (s,), generator=gen).tolist() for s in lens]
        tables = [[next(blocks) for _ in range(-(-(s + steps) // BLOCK))] for s in lens]
        ids, pos, meta = step_inputs([(t, 0, s) for t, s in zip(tables, lens)], toks)
        hidden = eager(model, fi, ids, pos, kv, meta)
        nxt = model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1]).argmax(-1).tolist()
        total = mismatches = unexplained = 0
        for _ in range(steps):
            rows = [(t, len(s), 1) for t, s in zip(tables, toks)]
            toks = [s + [x] for s, x in zip(toks, nxt)]
            ids, pos, meta = step_inputs(rows, toks)
            g = model.compute_logits(graphs.run(ids, pos, meta))  # writes this token's K/V, then
            e = model.compute_logits(eager(model, fi, ids, pos, kv, meta))  # eager rewrites it: both see eager's past
            top2 = e.topk(2, dim=-1).values
            tie = (top2[:, 0] - top2[:, 1]) <= 2 * (g - e).abs().amax(-1)
            diff = g.argmax(-1) != e.argmax(-1)
            total, mismatches = total + n, mismatches + int(diff.sum())
            unexplained += int((diff & ~tie).sum())
            nxt = e.argmax(-1).tolist()
        ok &= unexplained == 0
        print(
            f"(c) graphs vs eager, {n} sequences x {steps} steps: {total - mismatches}/{total} greedy tokens "
            f"equal, {mismatches - unexplained} near-tie mismatches, {unexplained} others "
            f"{'PASS' if unexplained == 0 else 'FAIL'}"
        )
    return ok


def step_ms(model, forward, iters: int) -> float:
    """Milliseconds of one decode step as the engine runs it: `forward()` (inputs, plan, the forward pass),
    then the logits and the greedy token ids on the host; after 3 warm-up steps."""
    for i in range(3 + iters):
        if i == 3:
            t = time.perf_counter()
        model.compute_logits(forward()).argmax(-1).cpu()
    return (time.perf_counter() - t) / iters * 1e3


def decode_rows(batch_size: int, context: int):
    """(input_ids, positions, meta) of a decode step of batch_size sequences with `context` tokens each."""
    per_seq = context // BLOCK
    rows = [(list(range(i * per_seq, (i + 1) * per_seq)), context - 1, 1) for i in range(batch_size)]
    return step_inputs(rows, [[0] * context] * batch_size)


def compare_torch_ops(model, cfg, fi, kv, graphs, batch_sizes, context, iters, num_blocks) -> None:
    """(h) The graphed decode step with the Triton kernels against the same step with torch's ops
    (ops.torch_ops(), graphs captured for it): what the fusion saves. The second set of graphs gets a
    FlashInfer backend of its own: a backend's graph-mode wrappers (and the index buffers its graphs read) are
    made per CUDAGraphRunner, so sharing `fi` would leave the first set reading stale plans."""
    dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, BLOCK, cfg.head_dim**-0.5)
    own = FlashInferBackend(*dims, dtype=DTYPE, device=DEVICE)
    use_backend(model, own)
    with ops.torch_ops():
        plain = CUDAGraphRunner(model, own, kv, max(batch_sizes), MAX_LEN // BLOCK, BLOCK, dummy_block=num_blocks - 1)
        plain.capture()
    use_backend(model, fi)
    print("(h) graphed decode step, Triton kernels vs torch ops")
    print("| batch | Triton kernels ms | torch ops ms | saved ms |")
    print("|---:|---:|---:|---:|")
    for b in batch_sizes:
        ids, pos, meta = decode_rows(b, context)
        fused = step_ms(model, lambda: graphs.run(ids, pos, meta), iters)
        torch_ms = step_ms(model, lambda: plain.run(ids, pos, meta), iters)
        print(f"| {b} | {fused:.2f} | {torch_ms:.2f} | {torch_ms - fused:.2f} |")


def bench(model, cfg, fi, graphs, kv, bandwidth, batch_sizes, context, iters):
    weight_bytes = sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if not name.startswith("embed_tokens")
    )  # a lookup reads only B rows of it
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * DTYPE.itemsize
    print(
        f"(d, e) decode step, context {context}: weights read {weight_bytes / 1e9:.2f} GB, "
        f"KV {token_bytes * context / 2**20:.0f} MiB per sequence, HBM {bandwidth / 1e12:.2f} TB/s"
    )
    print("| batch | floor ms | graphs ms | graphs / floor | eager ms | eager / floor | eager / graphs |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in batch_sizes:
        ids, pos, meta = decode_rows(b, context)
        times = {
            "graphs": step_ms(model, lambda: graphs.run(ids, pos, meta), iters),
            "eager": step_ms(model, lambda: eager(model, fi, ids, pos, kv, meta), iters),
        }
        floor = (weight_bytes + b * context * token_bytes) / bandwidth * 1e3
        g, e = times["graphs"], times["eager"]
        print(f"| {b} | {floor:.2f} | {g:.2f} | {g / floor:.2f} | {e:.2f} | {e / floor:.2f} | {e / g:.2f} |")


def compile_kernels(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Runs FlashInfer's eager decode, prefill and graph-mode decode once on a tiny cache, so that their
    JIT compilation (nvcc, tens of seconds a module) is done, and cached in ~/.cache/flashinfer, before a
    timed run needs them. Several of these can run at once: FlashInfer locks each module while it builds."""
    t = time.perf_counter()
    dims = (num_heads, num_kv_heads, head_dim, BLOCK, head_dim**-0.5)
    fi = FlashInferBackend(*dims, dtype=DTYPE, device=DEVICE)
    kv = torch.zeros(2, 8, BLOCK, num_kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
    cache = (kv[0], kv[1])

    def step(rows):  # rows: (tokens cached, new tokens) per sequence, decodes first; sequence i owns block i
        qsl, lens, slots = [0], [], []
        for i, (start, n) in enumerate(rows):
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
            slots += [i * BLOCK + p for p in range(start, start + n)]
        i32 = dict(dtype=torch.int32, device=DEVICE)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, **i32),
            seq_lens=torch.tensor(lens, **i32),
            block_tables=torch.arange(len(rows), **i32)[:, None],
            slot_mapping=torch.tensor(slots, device=DEVICE),
            num_decodes=sum(n == 1 for _, n in rows),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
        )
        q = torch.randn(qsl[-1], num_heads, head_dim, dtype=DTYPE, device=DEVICE)
        k = torch.randn(qsl[-1], num_kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
        fi.plan(meta)
        fi.forward(q, k, k.clone(), cache, meta)

    with torch.inference_mode():
        step([(5, 1), (0, 9)])  # an eager decode and a prefill
        fi.init_cuda_graph_decode([1], 1)
        with fi.cuda_graph_decode(1):
            step([(5, 1)])
        torch.cuda.synchronize()
    print(f"FlashInfer kernels for {num_heads}/{num_kv_heads} heads of {head_dim}: {time.perf_counter() - t:.1f} s")


def profile(model, cfg, graphs, kv, batch_size: int, context: int, n: int = 30) -> None:
    """Where a graphed decode step's time goes at one batch size: the host's input copies and FlashInfer
    plan, the graph replay alone (the forward's GPU time), the logits with the greedy token to the host, and
    the whole step; then torch.profiler's heaviest kernels of a few whole steps and the kernels per step."""
    ids, pos, meta = decode_rows(batch_size, context)
    hidden = graphs.run(ids, pos, meta)
    bs = graphs.load_inputs(ids, pos, meta)[0]

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3

    def plan():
        padded = graphs.load_inputs(ids, pos, meta)[1]
        with graphs._decode_state(bs):
            graphs._plan(padded)

    parts = {
        "inputs (host)": timed(lambda: graphs.load_inputs(ids, pos, meta)),
        "inputs + plan (host)": timed(plan),
        "graph replay": timed(graphs._graphs[bs].replay),
        "logits + argmax to host": timed(lambda: model.compute_logits(hidden).argmax(-1).cpu()),
        "whole step": timed(lambda: model.compute_logits(graphs.run(ids, pos, meta)).argmax(-1).cpu()),
    }
    print(f"(f) batch {batch_size}, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    steps = 5
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model.compute_logits(graphs.run(ids, pos, meta)).argmax(-1).cpu()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    kernels = sum(e.count for e in events) / steps
    print(f"    kernels per step {kernels:.0f}, GPU time per step {total / steps / 1e3:.2f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        share = e.self_device_time_total / total
        name = e.key[:90]
        print(f"    {e.self_device_time_total / steps / 1e3:6.3f} ms {share:6.1%} x{e.count // steps:4d}  {name}")


def blas_libraries(model, batch_size: int = 1, n: int = 50) -> None:
    """(i) Each of a layer's GEMMs and the LM head's at `batch_size` rows, timed alone with cuBLASLt (torch's
    default) and with cuBLAS (torch.backends.cuda.preferred_blas_library): which reads the weights faster."""
    layer = model.layers[0]
    weights = {
        "qkv_proj": layer.self_attn.qkv_proj.weight,
        "o_proj": layer.self_attn.o_proj.weight,
        "gate_up_proj": layer.mlp.gate_up_proj.weight,
        "down_proj": layer.mlp.down_proj.weight,
        "lm_head": model.lm_head.weight,
    }
    before = torch.backends.cuda.preferred_blas_library()
    print(f"(i) GEMMs at {batch_size} rows, us (TB/s of weights read): cuBLASLt | cuBLAS")
    for name, w in weights.items():
        x = torch.randn(batch_size, w.shape[1], dtype=w.dtype, device=w.device)
        cells = []
        for lib in ("cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(lib)
            torch.nn.functional.linear(x, w)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                torch.nn.functional.linear(x, w)
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) / n * 1e3
            cells.append(f"{us:7.1f} ({w.numel() * w.element_size() / us / 1e6:.2f})")
        print(f"    {name:13s} {list(w.shape)}: {' | '.join(cells)}")
    torch.backends.cuda.preferred_blas_library(before)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--context", type=int, default=1024, help="KV tokens per sequence (multiple of 16)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip-checks", action="store_true", help="only the benchmark (and --profile)")
    parser.add_argument(
        "--profile", type=int, nargs="*", default=[], metavar="BATCH", help="break these batch sizes' steps down"
    )
    parser.add_argument(
        "--compare-torch-ops",
        type=int,
        nargs="*",
        default=[1, 32],
        metavar="BATCH",
        help="time these batch sizes' graphed steps with torch's ops instead of the Triton kernels",
    )
    parser.add_argument(
        "--compile-only",
        type=int,
        nargs=3,
        metavar=("HEADS", "KV_HEADS", "HEAD_DIM"),
        help="only JIT-compile FlashInfer's kernels for this shape (to run beside another job) and exit",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device")
    if not flashinfer_available():
        sys.exit("flashinfer is not importable: carry and install its wheels as this script's docstring says")
    import flashinfer

    if args.compile_only:
        return compile_kernels(*args.compile_only)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flashinfer {flashinfer.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    bandwidth = hbm_bandwidth()
    cfg = LlamaConfig(**LLAMA_31_8B)
    dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, BLOCK, cfg.head_dim**-0.5)
    native, fi = TorchNativeBackend(*dims), FlashInferBackend(*dims, dtype=DTYPE, device=DEVICE)
    t = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(DTYPE)  # initialise in bfloat16 directly; 8B float32 weights would need 32 GB
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg, ModelShape.from_hf(cfg), fi, MAX_LEN).to(DTYPE).eval()
    torch.set_default_dtype(torch.float32)
    print(
        f"(a) Llama-3.1-8B-shaped model, random weights: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B "
        f"parameters in {time.perf_counter() - t:.1f} s"
    )
    with torch.inference_mode():
        ok = args.skip_checks or check_mixed(model, cfg, fi, native)
        torch.cuda.empty_cache()
        # enough blocks and graph sizes for the benchmark and for check_graphs' 27 sequences of < 320 tokens
        num_blocks = max(max([*args.batch_sizes, *args.compare_torch_ops]) * args.context // BLOCK, 27 * 20 + 20) + 1
        kv = new_cache(cfg, num_blocks)
        max_seqs = max([*args.batch_sizes, *args.profile, *args.compare_torch_ops, 27])
        graphs = CUDAGraphRunner(model, fi, kv, max_seqs, MAX_LEN // BLOCK, BLOCK, dummy_block=num_blocks - 1)
        use_backend(model, fi)
        graphs.capture()
        ok &= args.skip_checks or check_graphs(model, cfg, fi, graphs, kv)
        bench(model, cfg, fi, graphs, kv, bandwidth, args.batch_sizes, args.context, args.iters)
        if args.compare_torch_ops:
            compare_torch_ops(model, cfg, fi, kv, graphs, args.compare_torch_ops, args.context, args.iters, num_blocks)
        try:
            blas_libraries(model)
        except Exception as e:  # a report, not a check
            logging.exception("the BLAS comparison failed: %r", e)
        for b in args.profile:
            try:
                profile(model, cfg, graphs, kv, b, args.context)
            except Exception as e:  # a profile is a report, not a check
                logging.exception("profile of batch %d failed: %r", b, e)
    print("ALL CHECKS PASS" if ok else "SOME CHECK FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
