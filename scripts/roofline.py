"""The roofline of this machine and of the engine's steps: how far each step kind is from its floor.

1. Measures the machine: GEMM throughput through torch on the model's own linear shapes (qkv, o, gate_up,
   down, LM head; FLOP-weighted) at 64, 256 and 2048 rows, and the DRAM read bandwidth (summing a
   tensor far larger than the caches). For a GGUF model whose weights stay quantized, the compute roof
   is the rate of the kernel that runs them (the model's own quantized layers, timed the same way;
   int16 activations on AVX512-VNNI), printed beside torch's bfloat16 GEMM.
2. Counts, for the loaded model, the bytes and FLOPs of a step: the weights of every linear as they are
   held (quantized bytes for a GGUF model; the embedding lookup is negligible), the K/V read for the
   batch's context lengths, the FLOPs of the linears (2 per weight per row) and of attention
   (4 * context * head_dim per query head per row).
   The floor of a step is max(bytes / bandwidth, FLOPs / compute roof), the compute roof being the
   GEMM rate measured at the step's row count (64 for fewer rows: there the memory term dominates).
3. Times real engine steps of each kind (`LLMEngine.step`, scheduling and sampling included): a prefill
   step of --prefill-tokens prompt tokens, and decode steps at batch 1, 8, 64 and 256 with every
   sequence at --context-len tokens; prints measured vs floor; draws the classic roofline plot
   (arithmetic intensity vs attained FLOP/s, one point per step kind) with --plot.

    python scripts/roofline.py --plot docs/roofline.png
    python scripts/roofline.py --quantization none --plot docs/roofline-bf16.png   # the GGUF dequantized
    python scripts/roofline.py --device h100     # floors only, from the H100's published peaks

With --device h100 / h200 the floors use the published peaks (bf16 dense tensor-core FLOP/s, HBM
bandwidth) and nothing is measured unless CUDA is there, so the GPU roofline is one command once a
device is lent.
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common

from bench_common import read_rate  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from models.loader import load_config, resolve_model  # noqa: E402

# Published peaks: bf16 dense tensor-core FLOP/s and HBM bytes/s (NVIDIA H100 SXM5 / H200 SXM datasheets).
GPU_PEAKS = {"h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12)}
DECODE_BATCHES = (1, 8, 64, 256)


GEMM_ROWS = (64, 256, 2048)


@dataclass
class Machine:
    """Peaks in FLOP/s and bytes/s: `gemm` maps rows (M) to the measured GEMM rate at that M."""

    name: str
    gemm: dict[int, float]
    bandwidth: float

    def compute_roof(self, rows: int) -> float:
        ms = sorted(self.gemm)
        return self.gemm[max([m for m in ms if m <= rows] or ms[:1])]


def measure_gemm(m: int, shapes: list[tuple[int, int]], dtype: torch.dtype, repeats: int = 10) -> float:
    """FLOP/s of torch's linear on [m, k] x [n, k]^T over `shapes` (k, n), FLOP-weighted: the total
    FLOPs over the total of each shape's best time."""
    flops = seconds = 0.0
    for k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        best = float("inf")
        for _ in range(repeats + 3):
            t = time.perf_counter()
            torch.nn.functional.linear(a, b)
            best = min(best, time.perf_counter() - t)
        flops, seconds = flops + 2 * m * k * n, seconds + best
    return flops / seconds


def measure_quantized(model, m: int, dtype: torch.dtype, repeats: int = 10) -> float | None:
    """FLOP/s of the model's own quantized linears (layer 0's qkv, o, gate_up and down, and the LM head) at
    `m` rows, FLOP-weighted as measure_gemm; None when the model's weights are not quantized."""
    layer = model.layers[0]
    methods = [
        mod.quant_method
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    head = (model.lm_head or model.embed_tokens).quant_method
    if any(method is None for method in methods) or head is None:
        return None
    flops = seconds = 0.0
    for method in methods + [head.linear]:
        x = torch.randn(m, method.input_size, dtype=dtype)
        best = float("inf")
        for _ in range(repeats + 3):
            t = time.perf_counter()
            method.apply(x)
            best = min(best, time.perf_counter() - t)
        flops, seconds = flops + 2 * m * method.input_size * sum(method.output_sizes), seconds + best
    return flops / seconds


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of each distinct linear of the model: qkv, o, gate_up, down, LM head."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, kvh, hid, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size, cfg.intermediate_size
    return [(hid, (h + 2 * kvh) * d), (h * d, hid), (hid, 2 * inter), (inter, hid), (hid, cfg.vocab_size)]


@dataclass
class ModelShape:
    """What a step costs per row: linear weights (elements), KV bytes per token, attention FLOPs."""

    linear_params: int  # every linear of every layer (the LM head counted apart)
    lm_head_params: int
    kv_bytes_per_token: int
    attn_flops_per_key: int  # per query row and context token: QK^T and PV over all query heads
    weight_bytes: int  # of the linears and the LM head as held: dtype bytes per parameter, or quantized bytes

    @classmethod
    def of(cls, cfg, dtype_bytes: int, weight_bytes: int | None = None) -> "ModelShape":
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        h, kvh, hid, inter, layers = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
        )
        per_layer = hid * (h + 2 * kvh) * d + h * d * hid + 3 * hid * inter
        linear, head = layers * per_layer, cfg.vocab_size * hid
        return cls(
            linear_params=linear,
            lm_head_params=head,
            kv_bytes_per_token=2 * layers * kvh * d * dtype_bytes,
            attn_flops_per_key=4 * h * d * layers,
            weight_bytes=weight_bytes or (linear + head) * dtype_bytes,
        )

    def step(self, rows: int, sampled: int, keys_read: int, attn_pairs: int) -> tuple[float, float]:
        """(bytes, FLOPs) of a step computing `rows` tokens, sampling `sampled` of them, reading the
        K/V of `keys_read` cached tokens, with `attn_pairs` (query row, key) pairs in attention."""
        nbytes = self.weight_bytes + keys_read * self.kv_bytes_per_token
        flops = 2 * self.linear_params * rows + 2 * self.lm_head_params * sampled + self.attn_flops_per_key * attn_pairs
        return nbytes, flops


def time_decode(llm: LLM, batch: int, context_len: int, steps: int) -> float:
    """Seconds per engine step with `batch` sequences decoding at ~context_len tokens each."""
    eng = llm.engine
    llm.reset_prefix_cache()
    vocab = llm.tokenizer.vocab_size
    # Sequences decode while the later ones still prefill: room for those tokens too, so that all
    # `batch` sequences are still running in the timed steps.
    prefill_steps = -(-batch * context_len // eng.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=prefill_steps + steps + 4, ignore_eos=True)
    for i in range(batch):  # distinct random prompts: no prefix sharing
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(100, vocab - 100, (context_len,), generator=g).tolist()
        eng.add_request(None, ids, params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.engine_core.scheduler.running)
        or eng.engine_core.scheduler.waiting
    ):
        eng.step()
    eng.step()  # warm: every sequence now decodes
    assert len(eng.engine_core.scheduler.running) == batch, "a sequence finished before the timed steps"
    start = time.perf_counter()
    for _ in range(steps):
        eng.step()
    elapsed = (time.perf_counter() - start) / steps
    for request_id in eng.request_ids():
        eng.abort_request(request_id)
    return elapsed


def time_prefill(llm: LLM, tokens: int, prompt_len: int) -> float:
    """Seconds of one engine step prefilling `tokens` tokens (prompts of prompt_len each)."""
    eng = llm.engine
    llm.reset_prefix_cache()
    vocab = llm.tokenizer.vocab_size
    for i in range(tokens // prompt_len):
        g = torch.Generator().manual_seed(10_000 + i)
        ids = torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist()
        eng.add_request(None, ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    eng.step()
    elapsed = time.perf_counter() - start
    while eng.has_unfinished_requests():
        eng.step()
    return elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", *GPU_PEAKS], help="whose roofline (default: this CPU)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--quantization", default=None, choices=["gguf", "none"], help="as the server's flag")
    ap.add_argument(
        "--context-len",
        type=int,
        default=352,
        help="tokens per sequence in decode steps (default: W64's mean prompt + half its output)",
    )
    ap.add_argument(
        "--prefill-tokens",
        type=int,
        default=2048,
        help="tokens of the prefill step (default: one full step at the default max_num_batched_tokens)",
    )
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per batch size")
    ap.add_argument("--plot", help="write the roofline plot (PNG) here")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    measure = args.device == "cpu" or torch.cuda.is_available()

    # 256 sequences of ~400 tokens need ~2.4 GB of bfloat16 K/V for SmolLM2-135M (twice that in float32: a full
    # cache preempts sequences, and the timed steps would run fewer)
    llm = (
        LLM(
            dtype=args.dtype,
            quantization=args.quantization,
            max_num_seqs=max(DECODE_BATCHES),
            kv_cache_memory=(4 if args.dtype == "bfloat16" else 8) << 30,
            max_num_batched_tokens=max(args.prefill_tokens, 2048),
        )
        if measure
        else None
    )
    cfg = llm.engine.engine_core.executor.runner.model.config if llm else load_config(resolve_model(None))
    weights = llm.engine.engine_core.executor.runner.weight_bytes if llm else None
    quantized = bool(weights) and any(not k.startswith(("float", "bfloat")) for k in weights)
    # the linears' and LM head's bytes as held (norms are a rounding error); a weight's R16 copy beside its blocks is
    # read in place of them at steps of its copy_min_rows rows or more, never with them: counted once
    read = sum(v for k, v in weights.items() if not k.endswith("(R16 copy)")) if quantized else None
    shape = ModelShape.of(cfg, dtype.itemsize, read)
    if args.device == "cpu":
        shapes = linear_shapes(cfg)
        gemm = {m: measure_gemm(m, shapes, dtype) for m in GEMM_ROWS}
        kernel = (
            {m: measure_quantized(llm.engine.engine_core.executor.runner.model, m, dtype) for m in GEMM_ROWS}
            if quantized
            else None
        )
        machine = Machine("this CPU", kernel or gemm, read_rate())
        print(
            f"this CPU, {torch.get_num_threads()} threads: {args.dtype} GEMM on the model's linears "
            + ", ".join(f"{gemm[m] / 1e9:.0f} GFLOP/s at {m} rows" for m in GEMM_ROWS)
            + f"; float32 {measure_gemm(2048, shapes[:4], torch.float32) / 1e9:.0f} at 2048; "
            f"DRAM read {machine.bandwidth / 1e9:.1f} GB/s"
        )
        if kernel:
            print(
                f"weights {', '.join(f'{k} {v / 1e6:.1f} MB' for k, v in weights.items())}; their kernel: "
                + ", ".join(f"{kernel[m] / 1e9:.0f} GOP/s at {m} rows" for m in GEMM_ROWS)
            )
    else:
        flops, bw = GPU_PEAKS[args.device]
        machine = Machine(args.device.upper(), {GEMM_ROWS[0]: flops}, bw)

    kinds = [
        ("prefill", args.prefill_tokens, 1 + args.prefill_tokens // 512, args.prefill_tokens // 512 * 512 * 513 // 2, 0)
    ]
    kinds += [(f"decode b{b}", b, b, b * args.context_len, b * args.context_len) for b in DECODE_BATCHES]
    rows_out, points = [], []
    for name, rows, sampled, pairs, keys in kinds:
        nbytes, flops = shape.step(rows, sampled, keys, pairs)
        floor = max(nbytes / machine.bandwidth, flops / machine.compute_roof(rows))
        measured = None
        if llm is not None:
            measured = (
                time_prefill(llm, args.prefill_tokens, 512)
                if name == "prefill"
                else time_decode(llm, rows, args.context_len, args.steps)
            )
            points.append((name, flops / nbytes, flops / measured))
        rows_out.append((name, nbytes, flops, floor, measured))
    print(f"\n{'step':<12}{'MB read':>10}{'GFLOP':>9}{'floor ms':>10}{'bound':>9}{'measured ms':>13}{'x floor':>9}")
    for name, nbytes, flops, floor, measured in rows_out:
        bound = "memory" if nbytes / machine.bandwidth >= floor else "compute"
        m = f"{measured * 1e3:13.1f}{measured / floor:9.2f}" if measured else f"{'-':>13}{'-':>9}"
        print(f"{name:<12}{nbytes / 1e6:10.0f}{flops / 1e9:9.2f}{floor * 1e3:10.2f}{bound:>9}{m}")
    if args.plot and points:
        kind = (
            "GGUF " + "/".join(k for k in weights if not k.startswith(("float", "bfloat"))) if quantized else args.dtype
        )
        plot(machine, points, args.plot, f"{cfg.model_type}, {kind}, context {args.context_len}")


def plot(machine: Machine, points, path: str, title: str) -> None:
    """Arithmetic intensity (FLOP/byte) vs attained FLOP/s, log-log, with the memory and compute roofs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ai = np.logspace(-1, 4, 200)
    for m, peak in sorted(machine.gemm.items()):
        ax.plot(
            ai,
            np.minimum(ai * machine.bandwidth, peak) / 1e9,
            lw=1.5,
            label=f"roof: {machine.bandwidth / 1e9:.0f} GB/s, linears {peak / 1e9:.0f} GFLOP/s at {m} rows",
        )
    for name, x, y in points:
        ax.scatter([x], [y / 1e9], zorder=3)
        ax.annotate(name, (x, y / 1e9), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="arithmetic intensity (FLOP / byte)",
        ylabel="attained GFLOP/s",
        title=f"Roofline of {machine.name}: {title}",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
