"""started_thread_pool: every thread of the pool runs before it is handed out, so a burst
of tasks never adds threads later."""

from __future__ import annotations

import threading
import time

from storage_backends.thread_pools import started_thread_pool


def pool_threads(prefix: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(prefix)]


def test_all_threads_start_with_the_pool_and_a_burst_adds_none():
    pool = started_thread_pool(5, "test-started-pool")
    try:
        assert len(pool_threads("test-started-pool")) == 5
        # a burst of blocking tasks, more than the pool has threads
        futures = [pool.submit(time.sleep, 0.05) for _ in range(20)]
        for future in futures:
            future.result(timeout=10)
        assert len(pool_threads("test-started-pool")) == 5
        assert pool.submit(lambda: 7).result(timeout=10) == 7
    finally:
        pool.shutdown(wait=True)
    assert pool_threads("test-started-pool") == []


def test_a_plain_pool_would_grow_with_the_burst():
    """What the started pool avoids: ThreadPoolExecutor starts threads as tasks queue up."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(5, thread_name_prefix="test-plain-pool")
    try:
        pool.submit(lambda: None).result(timeout=10)
        before = len(pool_threads("test-plain-pool"))
        futures = [pool.submit(time.sleep, 0.05) for _ in range(20)]
        for future in futures:
            future.result(timeout=10)
        assert before == 1 and len(pool_threads("test-plain-pool")) == 5
    finally:
        pool.shutdown(wait=True)
