"""Keep free heap memory faulted in ahead of new values, on a thread of its own.

A value's buffer that lands in memory the process has never touched pays a page fault per
4 KiB on the request path. On the 2-core VM that cost 6.5 us a page inside the server
(3.3 ms of a 2 MiB Put that otherwise takes 0.35 ms: a fresh server's first 2 MiB Puts ran
at 300 MB/s against 4,800 MB/s once its memory had been used; docs/benchmarks.md). Freed
memory is kept for the next values (``cache_server.allocator``), so only memory above the
heap's high-water mark costs this, but a fresh server pays it for every byte up to its cap.

So :class:`HeapReserve` keeps the top of the heap ``reserve_bytes`` ahead of its use and
faulted in, off the request path, like memcached's ``-L`` but lazily: every
:data:`POLL_S` it checks that glibc's top chunk (the free memory at the end of the heap,
where the next value goes when no freed block fits) holds at least half the reserve
(:meth:`HeapReserve._grow_when_low`); when it does not, it grows the heap by the reserve
(a ``malloc`` and ``free``: the freed block joins the top chunk, which ``allocator`` never
trims), then faults in every page up to the heap's end with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+: the pages become
present and writable, their contents untouched, so it is safe on memory other threads
use). Faulting in ahead cost 0.45 ms/MiB of this thread's time against 3.2 ms/MiB of the
request path's (one call per 2 MiB instead of a fault per page). The thread runs at the lowest
priority (nice 19), so it takes a core only when the request path leaves one idle.

It never grows the heap past ``max_heap_bytes`` (the memory tier's cap: stored values and
uploads in flight stay within it, so a heap that large holds them), so the process holds
no more memory than a full cache would; up to then, its RSS runs half to one and a half
times ``reserve_bytes`` ahead of what it stores. Transparent huge pages (``MADV_HUGEPAGE``, glibc's
``glibc.malloc.hugetlb=1``) were measured and dropped: on the VM a huge page cost 0.5 to
2.8 ms per MiB to fault in, more than small pages.

Started by :func:`cache_server.server.run` after ``allocator.retain_freed_memory`` (with
glibc's defaults large values are ``mmap``-ed, not taken from the heap, and a reserve would
be useless), stopped by it at exit. Linux with glibc only; elsewhere :meth:`start` returns
False and nothing runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading

logger = logging.getLogger(__name__)

#: seconds between two looks at the heap's top (a malloc and free of a probe block)
POLL_S = 0.02
#: most bytes faulted in by one madvise call: the kernel holds the address space's lock
#: (read) meanwhile, and a thread that maps memory (a new staging area) waits for it, so keep
#: each call short (about 1 ms on the 2-core VM)
POPULATE_STEP_BYTES = 2 << 20
#: the thread's nice value: it works when a core is idle, not in the request path's stead
THREAD_NICENESS = 19
#: madvise advice numbers (Linux uapi)
MADV_POPULATE_WRITE = 23
#: the thread's name as the kernel shows it (``top -H``, ``/proc/PID/task/TID/comm``; 15
#: bytes at most): its page faults are its own work, not the request path's
THREAD_OS_NAME = b"kvstash-reserve"
#: prctl option that names the calling thread (Linux uapi)
PR_SET_NAME = 15
PAGE_BYTES = 4096


class HeapReserve:
    """A thread that keeps ``reserve_bytes`` of free heap at the heap's end faulted in, never
    growing the heap past ``max_heap_bytes`` above where it started. ``start()`` once,
    ``stop()`` once; the counters are read by tests and logs."""

    def __init__(self, reserve_bytes: int, max_heap_bytes: int) -> None:
        if reserve_bytes <= 0 or max_heap_bytes <= 0:
            raise ValueError(
                f"the heap reserve and heap limit must be positive, got {reserve_bytes} and {max_heap_bytes}"
            )
        self.reserve_bytes = reserve_bytes
        self.max_heap_bytes = max_heap_bytes
        #: bytes this thread faulted in so far, and the heap growths it made
        self.num_populated_bytes = 0
        self.num_growths = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._libc: ctypes.CDLL | None = None

    @property
    def kept_bytes(self) -> int:
        """The free memory actually kept faulted in: the reserve, capped by the heap limit (the
        heap never grows past ``max_heap_bytes`` for it)."""
        return min(self.reserve_bytes, self.max_heap_bytes)

    def describe(self) -> str:
        """The start-up log line: what is kept, and the cap when it cut the reserve asked for."""
        kept = f"heap reserve: {self.kept_bytes >> 20} MiB of free memory kept faulted in ahead of new values"
        if self.kept_bytes < self.reserve_bytes:
            kept += f" ({self.reserve_bytes >> 20} MiB asked for, capped by the memory tier's size)"
        return kept

    def start(self) -> bool:
        """Fault in the first reserve (blocking: called before the server serves), then start
        the thread; False (nothing started) where the C library or kernel lacks what it needs."""
        libc = ctypes.CDLL(None, use_errno=True)
        if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "sbrk", "madvise")):
            logger.info("heap reserve off: needs glibc")
            return False
        libc.sbrk.restype = ctypes.c_void_p
        libc.sbrk.argtypes = [ctypes.c_ssize_t]
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._libc = libc
        heap_start = libc.sbrk(0)
        # Probe the advice on one page of the heap the interpreter already uses.
        if libc.madvise((heap_start - PAGE_BYTES) & ~(PAGE_BYTES - 1), PAGE_BYTES, MADV_POPULATE_WRITE) != 0:
            logger.info(
                "heap reserve off: madvise(MADV_POPULATE_WRITE) failed (%s)",
                errno.errorcode.get(ctypes.get_errno()),
            )
            return False
        self._heap_start = heap_start
        #: every heap page below this is faulted in
        self._populated_end = heap_start
        # The first reserve is faulted in before the server serves: no early request competes
        # with it for a core (0.45 s for 1 GiB on the 2-core VM); later ones in the background.
        if not self._top_up():
            return False
        self._thread = threading.Thread(target=self._run, name="kvstash-heap-reserve", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop the thread (the memory it faulted in stays with the heap)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread has its own nice value
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), THREAD_NICENESS)
        with contextlib.suppress(AttributeError):
            self._libc.prctl(PR_SET_NAME, ctypes.c_char_p(THREAD_OS_NAME), 0, 0, 0)
        try:
            while not self._stopped.wait(POLL_S):
                if not self._top_up():
                    return
        except Exception:  # noqa: BLE001 - the reserve is an optimization: log, never take the server down
            logger.exception("heap reserve stopped")

    def _top_up(self) -> bool:
        """Grow the heap when its free end is low, then fault in every page up to its end;
        False (stop) when the kernel refuses."""
        libc = self._libc
        heap_end = libc.sbrk(0)
        room_bytes = self.max_heap_bytes - (heap_end - self._heap_start)
        if room_bytes > 0:
            heap_end = self._grow_when_low(min(self.reserve_bytes, room_bytes))
        # glibc trims a top chunk above its trim threshold (2 GiB): pages past a lower end are
        # gone, and those a new end brings back are new
        self._populated_end = min(self._populated_end, heap_end)
        while self._populated_end < heap_end and not self._stopped.is_set():
            step = min(POPULATE_STEP_BYTES, heap_end - self._populated_end)
            if libc.madvise(self._populated_end, step, MADV_POPULATE_WRITE) != 0:
                # ENOMEM: the system has no memory left for it; the request path will fault
                # (and fail) as it would have without a reserve
                logger.warning(
                    "heap reserve: madvise failed (%s); stopping", errno.errorcode.get(ctypes.get_errno())
                )
                return False
            self._populated_end += step
            self.num_populated_bytes += step
        return True

    def _grow_when_low(self, grow_bytes: int) -> int:
        """Grow the heap by ``grow_bytes`` when less than half of that is free at its end; the
        heap's end afterwards. A probe block of half the size tells: glibc takes it from a free
        block that holds it (already faulted in: nothing to do) or from the top chunk, growing
        the heap only when the top chunk is smaller. Freed, each block joins the top chunk
        again (never trimmed: ``allocator``). Asking glibc for its top chunk's size instead
        (``mallinfo2``) walks every free block under malloc's lock: 3 ms with 100,000 of them."""
        libc = self._libc
        heap_end = libc.sbrk(0)
        probe = libc.malloc(grow_bytes // 2)
        grew = libc.sbrk(0) > heap_end
        libc.free(probe)
        if grew:
            libc.free(libc.malloc(grow_bytes))
            self.num_growths += 1
        return libc.sbrk(0)
