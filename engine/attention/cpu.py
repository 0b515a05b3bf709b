"""The CPU backend: torch_native, with decode rows computed by a small C kernel over the paged cache.

Decode attention is memory-bound; in torch it needs a gathered (copied), padded K/V batch per layer,
which costs more than the model's matmuls at batch 64. `csrc/paged_decode.c` reads each K/V row in
place through the block table instead (as vLLM's CPU paged-attention kernel does). It is compiled
once with the system C compiler (-O3 -march=native, OpenMP) into ~/.cache/minivllm/kernels and
called through ctypes, which releases the GIL. Without a compiler the backend is plain torch_native.
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

from engine.attention.base import AttentionMetadata
from engine.attention.torch_native import TorchNativeBackend
from engine.loader import CACHE_DIR

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def load_kernels() -> ctypes.CDLL | None:
    """Builds (once per source and flags) and loads the C kernels; None if no compiler works."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        logger.warning("no C compiler (%s); CPU decode attention falls back to torch ops", cc)
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib_path = CACHE_DIR / "kernels" / f"paged_decode-{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(dir=lib_path.parent, suffix=".so", delete=False).name
        try:
            subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            logger.warning("building the CPU decode kernel failed; falling back to torch ops:\n%s", e.stderr)
            os.unlink(tmp)
            return None
        os.replace(tmp, lib_path)  # atomic, so concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(lib_path))
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return lib


class CPUBackend(TorchNativeBackend):
    """torch_native whose decode rows (float32 or bfloat16 caches on the CPU) run the C kernel."""

    def plan(self, meta: AttentionMetadata) -> None:
        """Nothing to prepare: the kernel reads block tables and lengths itself."""

    def _decode(self, q, k_cache, v_cache, meta, out):
        # q, out: the decode rows, contiguous slices of contiguous [T, h, d] tensors; block tables
        # [B, max_blocks] and seq_lens [B] are contiguous, and the kernel reads their first nd rows.
        kernels = load_kernels()
        fn = kernels.paged_decode_bf16 if q.dtype == torch.bfloat16 else kernels.paged_decode_f32
        q = q.contiguous()  # bound to a name: a temporary would be freed before the call reads it
        rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), meta.block_tables.data_ptr(),
                meta.seq_lens.data_ptr(), out.data_ptr(), q.shape[0], self.num_heads, self.num_kv_heads,
                self.head_dim, self.block_size, meta.block_tables.shape[1], self.scale, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"CPU decode kernel does not support head_dim {self.head_dim} with "
                             f"{self.num_heads // self.num_kv_heads} query heads per kv head")
