"""The CPU backend: paged attention for a whole step in a small C kernel.

In torch, attention over a paged cache needs a gathered (copied), padded K/V batch per layer for the
decodes, which costs more than the model's matmuls at batch 64, and SDPA's CPU flash kernel runs
prefill chunks at a fraction of the matmuls' speed for small heads. `csrc/paged_attention.c` reads
each K/V row in place through the block table, as vLLM's CPU kernels do, and computes all query heads
of a GQA group for a tile of positions per K/V load. It is compiled once with the system C compiler
(-O3 -march=native, OpenMP: the libgomp torch already loaded) into ~/.cache/minivllm/kernels and
called through ctypes, which releases the GIL. Without a compiler the CPU runs torch_native.
"""
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.loader import CACHE_DIR

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def load_kernels() -> ctypes.CDLL | None:
    """Builds (once per source and flags) and loads the C kernels; None if no compiler works."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        logger.warning("no C compiler (%s); the CPU runs the torch_native attention backend", cc)
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib_path = CACHE_DIR / "kernels" / f"paged_attention-{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(dir=lib_path.parent, suffix=".so", delete=False).name
        try:
            subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            logger.warning("building the CPU attention kernel failed; using torch_native:\n%s", e.stderr)
            os.unlink(tmp)
            return None
        os.replace(tmp, lib_path)  # atomic, so concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(lib_path))
    for name in ("paged_attention_f32", "paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return lib


class CPUBackend(AttentionBackend):
    """Paged attention for float32 or bfloat16 caches on the CPU, every row of a step in one kernel call.

    Needs contiguous int32 metadata (the model runner builds it so); q may be strided.
    """

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        k_cache, v_cache = kv_cache
        # All new K/V go in first: the kernel reads every key from the cache, the new ones included.
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        q = q.contiguous()  # bound to a name: a temporary would be freed before the kernel reads it
        out = torch.empty_like(q)
        kernels = load_kernels()
        fn = kernels.paged_attention_bf16 if q.dtype == torch.bfloat16 else kernels.paged_attention_f32
        rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), meta.block_tables.data_ptr(),
                meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(), out.data_ptr(), meta.num_seqs,
                self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, meta.block_tables.shape[1],
                self.scale, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"CPU attention kernel does not support head_dim {self.head_dim} with "
                             f"{self.num_heads // self.num_kv_heads} query heads per kv head")
        return out
