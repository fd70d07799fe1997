"""The heap reserve (``cache_server.heap_reserve``, #16): a real server process keeps free
memory faulted in ahead of its values, so Puts into a fresh server do not fault per page;
never past its memory cap; off with ``--heap-reserve-mb 0``; a bad value is refused.

Observed from outside, as a user would: the Rss of the server's ``[heap]`` mapping and the
minor page faults of the process (``/proc/PID/smaps`` and ``/proc/PID/stat``)."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from cache_server.heap_reserve import THREAD_OS_NAME
from storage_backends.grpc_backend import GrpcBackend
from tests.cache_server.server_process import run_cache_server_briefly

MIB = 1 << 20
PAGE_BYTES = 4096
RESERVE_THREAD_NAME = THREAD_OS_NAME.decode()

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def heap_rss_bytes(pid: int) -> int:
    """Resident bytes of the process's ``[heap]`` mapping (0 when it has none)."""
    in_heap = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line: "start-end perms ... path"
                in_heap = line.rstrip().endswith("[heap]")
            elif in_heap and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    return 0


def threads(pid: int) -> list[tuple[str, int]]:
    """Each thread of the process as (the kernel's name for it, its minor page faults), from
    ``/proc/PID/task/TID/{comm,stat}``."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        task = f"/proc/{pid}/task/{tid}"
        with (
            contextlib.suppress(FileNotFoundError),  # a thread that ended meanwhile
            open(f"{task}/comm") as comm,
            open(f"{task}/stat") as stat,
        ):
            found.append((comm.read().strip(), int(stat.read().rsplit(")", 1)[1].split()[7])))
    return found


def request_path_minor_faults(pid: int) -> int:
    """Minor page faults of every thread of the process but the reserve's own (it faults the
    reserve in on purpose, off the request path, and may be doing so while Puts run)."""
    return sum(num_faults for name, num_faults in threads(pid) if name != RESERVE_THREAD_NAME)


def settled_heap_rss(pid: int, timeout_s: float = 20.0) -> int:
    """The heap's Rss once it stopped changing for half a second (the reserve thread is done)."""
    deadline = time.monotonic() + timeout_s
    last = heap_rss_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = heap_rss_bytes(pid)
        if now == last:
            return now
        last = now
    return last


def test_a_fresh_server_keeps_free_memory_faulted_in_ahead_of_its_puts() -> None:
    """Three batches of 24 MiB (72 MiB: more than the 64 MiB reserve) each fault a few pages
    on the request path (every thread but the reserve's, which may be faulting the next
    reserve in meanwhile: it did so for 36 MiB during a batch on a slow CI machine), where
    without a reserve each batch faults its 6,144 pages (checked on the old code)."""
    process = CacheServerProcess("--memory-gb", "0.25", "--heap-reserve-mb", "64").start()
    try:
        pid = process.process.pid
        assert "heap reserve: 64 MiB" in process.log()
        assert [name for name, _ in threads(pid)].count(RESERVE_THREAD_NAME) == 1
        backend = GrpcBackend(process.address)
        try:
            backend.put_encoded("ns/first", make_value(0, 2 * MIB, key="ns/first"))  # its staging area
            for batch in range(3):
                settled_heap_rss(pid)  # the reserve thread has caught up (idle time between batches)
                values = [
                    (f"ns/{batch}/{index}", make_value(index, 2 * MIB, key=f"ns/{batch}/{index}"))
                    for index in range(12)
                ]
                faults_before = request_path_minor_faults(pid)
                for key, value in values:
                    backend.put_encoded(key, value)
                num_faults = request_path_minor_faults(pid) - faults_before
                assert num_faults < 24 * MIB // PAGE_BYTES // 4, f"batch {batch}: {num_faults} page faults"
                assert bytes(backend.get_encoded(values[-1][0])) == values[-1][1]
        finally:
            backend.close()
    finally:
        process.close()


def test_the_reserve_never_grows_the_heap_past_the_memory_cap() -> None:
    baseline = CacheServerProcess("--memory-gb", "0.03125", "--heap-reserve-mb", "0").start()
    try:
        assert "heap reserve" not in baseline.log()
        heap_without = settled_heap_rss(baseline.process.pid)
    finally:
        baseline.close()
    # a 512 MiB reserve under a 32 MiB cap: at most the cap's worth beyond the baseline
    capped = CacheServerProcess("--memory-gb", "0.03125", "--heap-reserve-mb", "512").start()
    try:
        # the log states what is kept (the cap), not the 512 MiB asked for
        assert (
            "heap reserve: 32 MiB of free memory kept faulted in ahead of new values "
            "(512 MiB asked for, capped by the memory tier's size)" in capped.log()
        )
        heap_with = settled_heap_rss(capped.process.pid)
        assert 24 * MIB <= heap_with - heap_without <= 32 * MIB + 8 * MIB
    finally:
        capped.close()


def test_a_negative_reserve_is_refused_at_start() -> None:
    result = run_cache_server_briefly("--heap-reserve-mb", "-1")
    assert result.returncode == 2
    assert "heap reserve must be >= 0" in result.stderr
