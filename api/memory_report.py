"""The server's memory as its allocators see it, logged on SIGUSR1 (`kill -USR1 PID`): glibc malloc's
arenas with the bytes they hold from the system, in use and free (mallinfo2, malloc_info), and, when
Python traces allocations (PYTHONTRACEMALLOC=1 in the server's environment), the source lines holding
the most. It tells a leak (bytes in use that grow) from allocator high-water marks (free bytes kept in
the arenas); scripts/soak.py --phases asks for one after each phase.
"""

import ctypes
import ctypes.util
import re
import tracemalloc

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33), every field in bytes or counts, summed over
    all arenas."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc_malloc() -> str:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        return "malloc: not glibc >= 2.33 (no mallinfo2)"
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    # malloc_info writes XML to a FILE*: an open_memstream buffer, freed after reading
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    libc.open_memstream.restype = ctypes.c_void_p
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    xml = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    arenas = len(re.findall(r"<heap nr=", xml))
    return (
        f"malloc: {arenas} arenas, {(info.arena + info.hblkhd) / MIB:.1f} MiB from the system "
        f"({info.arena / MIB:.1f} in arenas + {info.hblkhd / MIB:.1f} mmapped), "
        f"{(info.uordblks + info.hblkhd) / MIB:.1f} MiB in use, {info.fordblks / MIB:.1f} MiB free in arenas"
    )


def _python_top(top: int) -> str:
    if not tracemalloc.is_tracing():
        return "python: not traced (PYTHONTRACEMALLOC=1 to trace)"
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    stats = snapshot.statistics("lineno")
    lines = ", ".join(
        f"{s.traceback[0].filename.rsplit('/', 2)[-1]}:{s.traceback[0].lineno} {s.size / MIB:.1f} MiB"
        for s in stats[:top]
    )
    return f"python: {sum(s.size for s in stats) / MIB:.1f} MiB traced; top {lines}"


def resident_bytes(pid: int | str = "self") -> int:
    """The resident set size in bytes of process `pid` (this one by default), from Linux's /proc."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def memory_report(top: int = 5) -> str:
    """One log line: resident memory (MiB), glibc malloc's arenas and bytes (from the system, in use,
    free in arenas), and tracemalloc's total and `top` source lines when tracing. Linux only."""
    return f"memory: rss {resident_bytes() / MIB:.1f} MiB; {_glibc_malloc()}; {_python_top(top)}"
