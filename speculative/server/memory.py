"""Giving the C heap's free memory back to the operating system when the server goes idle.

Under continuous batching every admission allocates a prefill's KV caches (several MB a layer, sizes
that vary with the prompts) before its rows are copied into the running batch's buffers, and glibc's
malloc keeps what is freed in its heap for reuse, so a server's resident set grows to the high-water
mark of that churn and stays there. `release_free_memory`, called when the batch empties, hands the
free pages back (glibc's malloc_trim): the idle server's RSS then reflects what is live, and a soak can
tell a leak from the allocator's caching. `heap_in_use` (the /metrics gauge
speculative:heap_in_use_bytes) is the live part alone, which the RSS shows only up to the heap's
fragmentation (about +-13 MiB between idle readings of a server of the demo pair).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


class _Mallinfo2(ctypes.Structure):  # glibc's struct mallinfo2 (glibc >= 2.33)
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


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


@functools.cache
def _mallinfo2():
    """glibc's mallinfo2, or None where the C library has none."""
    function = getattr(_libc(), "mallinfo2", None)
    if function is not None:
        function.argtypes, function.restype = [], _Mallinfo2
    return function


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out and not had back (malloc's arenas and its mmapped blocks, all
    threads): what is live, without the free memory the allocator keeps. None where unknown."""
    info = _mallinfo2()
    if info is None:
        return None
    result = info()
    return result.uordblks + result.hblkhd


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    function = getattr(_libc(), "malloc_trim", None)
    if function is not None:
        function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; False where that is not available."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))
