"""Host memory for the CPU engine: zero-filled tensors that are free to allocate, for the KV cache, and the
weights moved into transparent huge pages.

`torch.zeros` of a multi-GiB cache writes every byte before the server can answer (about a second per
2 GiB). An anonymous memory mapping is zero-filled by the kernel page by page instead, so it is ready at
once; a background thread then prefaults all of it with madvise(MADV_POPULATE_WRITE) (Linux >= 5.14),
which maps the pages without writing to them, so it never races with the engine's K/V writes, and the
process holds the whole cache soon after start as it would after `torch.zeros`. On kernels without
that flag the pages are mapped on first use.

A decode step streams every weight from DRAM, in 4 KiB pages unless the memory was advised for transparent huge
pages (MADV_HUGEPAGE; the kernel's default THP mode is often "madvise", where nothing else gets them): 97 MB of the
default model are 24k pages a token, far past the TLB's reach, where 2 MiB pages are 49. `huge_page_weights` copies
the loaded weights into one such mapping (batch-1 decode of the default model 14% faster on an AMD EPYC: the same
model's weights in 4 KiB pages against in huge pages, one process; docs/benchmarks.md). `keep_freed_memory` has
malloc keep what a step frees for the next step's outputs, where glibc would map and unmap them afresh.
"""

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import threading

import torch

from models.quantization.gguf import GGUFTensor, quantized_weights

logger = logging.getLogger(__name__)

MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # linux/mman.h
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h, mallopt's parameters
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and (4 KiB base pages) arm64
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
PREFAULT_CHUNK = 16 << 20  # bytes, a multiple of the page size
_PREFAULTS: list[threading.Thread] = []  # this process's prefault threads, until wait_for_prefault joins them


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` and `dtype`, all zeros, backed by an anonymous mapping that
    lives as long as the tensor, starting at a 2 MiB boundary and advised for transparent huge pages (as the
    weights: huge_page_weights). Returns at once; the prefault runs on a daemon thread."""
    nbytes = math.prod(shape) * dtype.itemsize
    tensor = _huge_page_arena(nbytes)[0].view(dtype).view(shape)
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
    libc = _libc()
    # In chunks: madvise holds the process's memory-map lock while it populates, and every mmap of the
    # other threads (Python's and malloc's arenas) waits for it; 2 GiB in one call stalled the server's
    # start-up by up to 4 s where the hypervisor hands out pages slowly.
    for start in range(0, nbytes, PREFAULT_CHUNK):
        if libc.madvise(address + start, min(PREFAULT_CHUNK, nbytes - start), MADV_POPULATE_WRITE) != 0:
            logger.debug("KV cache prefault skipped (errno %d); pages are mapped on first use", ctypes.get_errno())
            return


@functools.cache
def _libc():
    """The C library, once (find_library runs ldconfig in a subprocess); its calls release the GIL."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _huge_page_arena(nbytes: int) -> tuple[torch.Tensor, bool]:
    """uint8 [nbytes] of a new anonymous mapping (zeros until written) from a 2 MiB boundary, and whether the whole
    of it is advised for transparent huge pages (not where the kernel gives none, or MADV_HUGEPAGE fails)."""
    size = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # whole huge pages
    buffer = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena = torch.frombuffer(buffer, dtype=torch.uint8)
    start = (-arena.data_ptr()) % HUGE_PAGE
    arena = arena[start : start + nbytes]
    if not huge_pages_on():
        return arena, False
    if _libc().madvise(arena.data_ptr(), size, MADV_HUGEPAGE) != 0:
        logger.debug("MADV_HUGEPAGE refused (errno %d): base pages", ctypes.get_errno())
        return arena, False
    return arena, True


def huge_pages_on() -> bool:
    """Whether the kernel gives transparent huge pages to memory advised for them (THP mode "always" or
    "madvise", not "never" or absent)."""
    try:
        with open(THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _weights(model: torch.nn.Module) -> list[tuple[object, str]]:
    """(owner, attribute) of every CPU weight tensor of `model`, once each: its parameters, and the GGUF blocks
    (with their R16 copies) its quantized layers hold outside parameters."""
    found, seen = [], set()

    def add(owner, name):
        t = getattr(owner, name)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.nbytes:
            if t.data_ptr() not in seen:  # a tied weight once
                seen.add(t.data_ptr())
                found.append((owner, name))

    for module in model.modules():
        for name, _ in module.named_parameters(recurse=False):
            add(module._parameters[name], "data")
        for w in quantized_weights(module):
            if isinstance(w, GGUFTensor):
                add(w, "data")
                if w.r16_copy is not None:
                    add(w, "r16_copy")
    return found


def huge_page_weights(model: torch.nn.Module) -> int:
    """Moves `model`'s CPU weights (parameters, GGUF blocks and their R16 copies) into one anonymous mapping
    advised for transparent huge pages, each tensor 64-byte aligned, copying one at a time (the old copy goes as
    its tensor is rebound: the peak is the weights plus the largest one; malloc's freed heap pages go back to the
    system after, so the resident size does not grow: 482 -> 468 MB for the default model in float32). Call it
    before anything keeps a weight's address (the fused layers take theirs at their first step). Returns the bytes
    moved: 0 where the kernel gives no huge pages (THP "never"), madvise fails, or the model has no CPU weights;
    the weights stay as they were then."""
    weights = _weights(model)
    if not weights:
        return 0
    offsets, total = [], 0
    for owner, name in weights:
        offsets.append(total)
        total += (getattr(owner, name).nbytes + 63) // 64 * 64
    arena, advised = _huge_page_arena(total)
    if not advised:
        return 0
    for (owner, name), at in zip(weights, offsets):
        old = getattr(owner, name)
        new = arena[at : at + old.nbytes].view(old.dtype).view(old.shape)
        new.copy_(old)
        setattr(owner, name, new)
    del old
    _trim_heap()  # the old copies' pages back to the system, not kept in malloc's free lists
    return total


def keep_freed_memory() -> bool:
    """Tells glibc's malloc to keep freed memory for the next allocation instead of returning it to the system:
    no allocation is its own mapping (M_MMAP_MAX 0) and the heap's free top is not trimmed (M_TRIM_THRESHOLD).
    A prompt step's outputs are tens of MB each (a 2,048-token chunk's gate|up product of a 1B model: 67 MB in
    bfloat16), above the 32 MB from which malloc maps every allocation apart, so each step took page faults to zero
    them afresh and unmapped them after: a 1B model's prompts ran 10-15% slower (as vLLM-CPU has tcmalloc
    preloaded for). The setting is the whole process's; the resident size then stays at the peak a step needed.
    Returns False where the C library has no mallopt (not glibc)."""
    libc = _libc()
    if not hasattr(libc, "mallopt"):
        return False
    unmapped = libc.mallopt(M_MMAP_MAX, 0) == 1
    untrimmed = libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return unmapped and untrimmed


def _trim_heap() -> None:
    """glibc's malloc_trim(0): the free pages of malloc's heap back to the system (a no-op elsewhere)."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass
