"""Thread pools whose threads all start with them.

``ThreadPoolExecutor`` starts a thread per task submitted while none is idle, up to its
``max_workers``, and keeps them: a pool's size then depends on the busiest moment it has
seen so far (a burst of chunk reads, calls waiting for a dead server), and a process's
thread count drifts up for hours before it settles. kvstash's pools are small and their
caps are chosen; starting every thread at once keeps the thread count of an engine or a
server constant from its first request on, so any growth a soak sees is a leak, not a pool
finding its size (docs/benchmarks.md, "Soak").
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

#: how long the pool's threads may take to start before it is handed out anyway
_START_TIMEOUT_S = 10.0


def started_thread_pool(max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor(max_workers, thread_name_prefix=...)`` with all its threads
    running (idle) before it is returned. Called where a pool is made (once per owner)."""
    pool = ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix)
    # Each task waits until all of them run: no thread is idle while the next one is
    # submitted, so the executor starts a new thread for each.
    all_started = threading.Barrier(max_workers + 1)
    for _ in range(max_workers):
        pool.submit(_wait_at, all_started)
    with contextlib.suppress(threading.BrokenBarrierError):
        all_started.wait(_START_TIMEOUT_S)
    return pool


def _wait_at(barrier: threading.Barrier) -> None:
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait(_START_TIMEOUT_S)
