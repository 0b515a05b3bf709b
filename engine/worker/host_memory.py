"""Zero-filled host tensors that are free to allocate, for the KV cache on the CPU.

`torch.zeros` of a multi-GiB cache writes every byte before the server can answer (about a second per
2 GiB). An anonymous memory mapping is zero-filled by the kernel page by page instead, so it is ready at
once; a background thread then prefaults all of it with madvise(MADV_POPULATE_WRITE) (Linux >= 5.14),
which maps the pages without writing to them, so it never races with the engine's K/V writes, and the
process holds the whole cache soon after start as it would after `torch.zeros`. On kernels without
that flag the pages are mapped on first use.
"""
import ctypes
import ctypes.util
import logging
import math
import mmap
import threading

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` and `dtype`, all zeros, backed by an anonymous mapping that
    lives as long as the tensor. Returns at once; the prefault runs on a daemon thread."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=dtype).view(shape)
    threading.Thread(target=_prefault, args=(tensor.data_ptr(), nbytes), name="kv-prefault", daemon=True).start()
    return tensor


def _prefault(address: int, nbytes: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)  # ctypes calls release the GIL
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, nbytes, MADV_POPULATE_WRITE) != 0:
        logger.debug("KV cache prefault skipped (errno %d); pages are mapped on first use", ctypes.get_errno())
