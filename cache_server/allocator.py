"""Keep the memory of freed values for the next ones instead of returning it to the OS.

A stored value is one buffer of megabytes. glibc's malloc serves buffers above
its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps them when
they are freed, so each new value after an eviction, ``Clear`` or
``Delete`` faults in and zero-fills new pages: about 0.4 ms of kernel time per MB
at 32 MiB (measured in docs/benchmarks.md), more than receiving the bytes.
Redis avoids this because jemalloc keeps freed pages for reuse. These settings
do the same for the server process: every allocation comes from the heap, the
heap is not trimmed, and one arena serves every thread, so memory freed by one
thread (an eviction) is reused by another (the next Put). The process's RSS then
stays near its high-water mark (the memory tier's cap plus values in flight)
instead of shrinking after evictions, as Redis's does.

Called once by :func:`cache_server.server.run` (the ``kvstash cache-server``
process) before serving; never by code that shares its process with an engine.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
#: mallopt takes an int: the largest trim threshold it accepts (2 GiB of free heap top before trimming)
MAX_TRIM_THRESHOLD = 2**31 - 1


def retain_freed_memory() -> bool:
    """Apply the settings above; False (nothing changed) where the C library is not glibc."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        logger.info("not glibc: freed value memory goes back to the OS")
        return False
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, MAX_TRIM_THRESHOLD), (M_ARENA_MAX, 1))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
