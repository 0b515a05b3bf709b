"""The CPU backend: a whole step's paged attention in one C kernel call per layer.

In torch, attention over a paged cache needs a gathered (copied), padded K/V batch per layer, which
costs more than the model's matmuls at batch 64. `models/kernels/csrc/paged_attention.c` writes the step's
new K/V into the cache and reads every K/V row in place through the block table, as vLLM's CPU
kernels do, with an online softmax (one pass over K and V), all query heads of a GQA group per K/V
load, AVX512-BF16 dot products (bfloat16 and quantized caches) or AVX2 (float32) where the CPU has them,
and split keys when the step has too few (sequence, kv head) tasks for the threads (batch 1). The cache is
"HND" per layer, [num_blocks, num_kv_heads, block_size, head_dim], so one head's keys of a block are contiguous.
"""

import os

import torch

from models.attention.base import AttentionBackend, AttentionMetadata
from models.kernels import cpu_kernels


def kernel_isa(dtype: torch.dtype = torch.bfloat16) -> str:
    """The path the kernel takes on this CPU for a cache in `dtype` (head_dim 64 or 128): "avx512bf16" (bfloat16,
    and the quantized caches' storage dtypes, int8 and fp8 rows turned into bfloat16 per chunk, queries rounded to
    bfloat16 under float32 activations), "avx512" (float32 on a CPU with AVX512F, and the quantized caches as float32
    rows there without AVX512-BF16), "avx2" (the same without AVX-512), or "portable" (on a CPU without either).
    `MINIVLLM_CPU_ISA=portable` forces the portable C path."""
    lib = cpu_kernels.load()
    if lib is None or os.environ.get("MINIVLLM_CPU_ISA") == "portable":
        return "portable"
    isa = lib.attention_isa()
    quantized = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
    if (dtype == torch.bfloat16 or dtype in quantized) and isa & 1:
        return "avx512bf16"
    if (dtype == torch.float32 or dtype in quantized) and isa & 4:
        return "avx512"
    return "avx2" if (dtype == torch.float32 or dtype in quantized) and isa & 2 else "portable"


class CPUBackend(AttentionBackend):
    """Paged attention for float32 or bfloat16 caches on the CPU, every row of a step in one kernel call.

    q, k, v may be views with a row stride (slices of the fused qkv projection) but each token's heads
    must be contiguous; the metadata tensors must be contiguous (the model runner builds them so).
    Raises ValueError for head sizes or GQA groups the kernel does not support (head_dim > 256, or
    more than 8 query heads per kv head).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lib = cpu_kernels.load()
        self.isa = int(os.environ.get("MINIVLLM_CPU_ISA") != "portable")  # the kernel checks the CPU

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, self.row)

    supports_sinks = True

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, sinks=None):
        k_cache, v_cache = kv_cache
        for x in (q, k, v):
            if x.stride(-1) != 1 or x.stride(-2) != self.head_dim:
                raise ValueError("CPU attention needs each token's heads contiguous")
        out = q.new_empty(q.shape)
        if sinks is not None:
            sinks = sinks.float().contiguous()  # kept referenced through the call
        name = "bf16" if q.dtype == torch.bfloat16 else "float"
        fn = getattr(self.lib, f"paged_attention_{name}_q" if self.kv_quant else f"paged_attention_{name}")
        rc = fn(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            meta.slot_mapping.data_ptr(),
            q.shape[0],
            meta.block_tables.data_ptr(),
            meta.seq_lens.data_ptr(),
            meta.query_start_loc.data_ptr(),
            out.data_ptr(),
            meta.num_seqs,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            meta.block_tables.shape[1],
            self.scale,
            self.sliding_window or 0,
            self.logits_soft_cap or 0.0,
            torch.get_num_threads(),
            self.isa,
            self.kv_quant,
            None if sinks is None else sinks.data_ptr(),
        )
        if rc != 0:
            raise ValueError(
                f"CPU attention kernel does not support head_dim {self.head_dim} with "
                f"{self.num_heads // self.num_kv_heads} query heads per kv head"
            )
        return out
