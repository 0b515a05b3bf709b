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
PREFAULT_CHUNK = 16 << 20  # bytes, a multiple of the page size
_PREFAULTS: list[threading.Thread] = []  # this process's prefault threads, until wait_for_prefault joins them


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` and `dtype`, all zeros, backed by an anonymous mapping that
    lives as long as the tensor. Returns at once; the prefault runs on a daemon thread."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=dtype).view(shape)
    thread = threading.Thread(target=_prefault, args=(tensor.data_ptr(), nbytes), name="kv-prefault", daemon=True)
    _PREFAULTS.append(thread)
    thread.start()
    return tensor


def wait_for_prefault() -> None:
    """Blocks until every cache's prefault has finished: a benchmark calls it before timing, since until then
    the prefault takes a core and the memory-map lock (the first requests of a fresh server run slower)."""
    while _PREFAULTS:
        _PREFAULTS.pop().join()


def _prefault(address: int, nbytes: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)  # ctypes calls release the GIL
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    # In chunks: madvise holds the process's memory-map lock while it populates, and every mmap of the
    # other threads (Python's and malloc's arenas) waits for it; 2 GiB in one call stalled the server's
    # start-up by up to 4 s where the hypervisor hands out pages slowly.
    for start in range(0, nbytes, PREFAULT_CHUNK):
        if libc.madvise(address + start, min(PREFAULT_CHUNK, nbytes - start), MADV_POPULATE_WRITE) != 0:
            logger.debug("KV cache prefault skipped (errno %d); pages are mapped on first use", ctypes.get_errno())
            return
