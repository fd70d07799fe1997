"""Background measurements of the lower tiers (docs/architecture.md, Connector: the
planner's rates).

The planner plans a fetch from a tier at the rate that tier delivered to this engine
(``connector.tier_rates``). A constant prior would make the first hit from a fast remote
recompute what it could load, and a remote measured slow once would never be read again.
So :class:`TierProber` measures each remote tier (Redis, the cache server) when the
connector opens it, then again every ``interval_s`` while the planner skips it or its
last measurement was slower than recomputing (``LoadPlanner.tiers_to_probe``). A local
disk is measured by its fetches only (``PROBED_TIER_NAMES``).

A measurement writes one chunk-sized value of random bytes under the engine's own probe
key (its namespace, ``key_prefix`` included, so a tenant's prefix rules hold and no
engine reads it as KV), reads it once (one connection), then ``connections`` times at
once (as a fetch reads), into buffers faulted in beforehand as a fetch's CPU-tier slots
are (new memory's page faults are no part of what a tier delivers). The key is written
again when a tier dropped it, and deleted when the prober closes. A tier whose circuit breaker is open is left alone. Runs on one
thread of its own; reads go through the tiers' thread-safe backends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from connector.breaker import CircuitBreaker
from connector.config import REMOTE_TIER_NAMES
from connector.planner import LoadPlanner
from storage_backends.base import StorageBackend
from storage_backends.chunk import KVChunk
from storage_backends.thread_pools import started_thread_pool

log = logging.getLogger(__name__)

#: suffix of a namespace's probe key (after ``key_prefix`` + namespace + ":")
PROBE_KEY_SUFFIX = "kvstash-tier-probe"
#: the tiers measured in the background: the remotes. A local disk reads a value written
#: moments ago from caches (on an H200 host the opening measurement made the planner load
#: 4,351 tokens of a 16k disk hit where its fetches alone said 3,839, and the hit took
#: 415 ms instead of 373): its rate comes from its fetches, from its prior on
PROBED_TIER_NAMES = REMOTE_TIER_NAMES


class TierProber:
    """One per connector with a planner and lower tiers (made by ``create_kv_connector``)."""

    def __init__(
        self,
        planner: LoadPlanner,
        name_to_tier: dict[str, StorageBackend],
        *,
        key: str,
        chunk_shape: tuple[int, ...],
        dtype: torch.dtype,
        layout: str,
        connections: int,
        interval_s: float,
        name_to_breaker: dict[str, CircuitBreaker] | None = None,
        busy: Callable[[str], bool] = lambda tier_name: False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.planner = planner
        self.name_to_tier = name_to_tier
        self.name_to_breaker = name_to_breaker or {}
        self.key = key
        self.chunk_shape = chunk_shape
        self.dtype = dtype
        self.layout = layout
        self.connections = max(1, connections)
        self.interval_s = interval_s
        #: whether fetches are reading a tier now (then it is not measured in the background)
        self.busy = busy
        self._clock = clock
        #: tiers that may hold the probe value (named before the write starts, so a close
        #: during the write deletes it); guarded by ``_lock`` with ``_closed``
        self._written_tier_names: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = None
        #: measurements taken, per tier (tests, logs)
        self.tier_to_num_probes: dict[str, int] = {}
        #: the buffer every measurement reads into (faulted in once; see ``_buffers``)
        self._kept_buffer: torch.Tensor | None = None

    def start(self) -> None:
        """Measure every lower tier now, then keep measuring the skipped ones (returns at once)."""
        self._pool = started_thread_pool(self.connections, "kvstash-tier-probe-read")
        self._thread = threading.Thread(target=self._run, name="kvstash-tier-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for name in list(self.name_to_tier):
            if self._stop.is_set():
                return
            self.probe(name)
        while not self._stop.wait(max(self.interval_s, 0.05)):
            # a tier that fetches are reading is measured by them; a probe would take their bandwidth
            idle = [name for name in self.name_to_tier if not self.busy(name)]
            for name in self.planner.tiers_to_probe(idle):
                self.probe(name, full=False)

    def probe(self, tier_name: str, *, full: bool = True) -> bool:
        """Measure one tier now: one read, then (``full``: the opening measurement)
        ``connections`` at once; feeds the planner. A later measurement reads one chunk
        only (cheap: the planner scales it, no higher than the opening one's rate with
        more connections). Returns whether the measurement was taken."""
        tier = self.name_to_tier[tier_name]
        breaker = self.name_to_breaker.get(tier_name)
        if breaker is not None and not breaker.allow():
            return False
        try:
            buffers = self._buffers(self.connections if full else 1)
            stored = tier_name in self._written_tier_names and self._read(tier, buffers[0])
            if not stored and not self._write(tier_name, tier):
                return False
            num_bytes = buffers[0].numel() * buffers[0].element_size()
            began = self._clock()
            if not self._read(tier, buffers[0]):
                return False
            self.planner.observe_read(tier_name, num_bytes, self._clock() - began, 1, replace=True)
            if not full:
                buffers = []
            began = self._clock()
            reads = [self._pool.submit(self._read, tier, buffer) for buffer in buffers]
            if not all(read.result() for read in reads):
                return False
            if buffers:
                seconds = self._clock() - began
                self.planner.observe_read(
                    tier_name, num_bytes * len(buffers), seconds, len(buffers), replace=True
                )
        except Exception as exc:  # a tier that fails is the breaker's business, not the prober's
            log.info("measuring tier %s failed: %s: %s", tier_name, type(exc).__name__, exc)
            return False
        self.tier_to_num_probes[tier_name] = self.tier_to_num_probes.get(tier_name, 0) + 1
        log.info(
            "tier %s measured: %.3f GB/s with one read, %.3f GB/s planned with %d in flight",
            tier_name,
            self.planner.tier_rate(tier_name, 1) / 1e9,
            self.planner.tier_rate(tier_name, self.connections) / 1e9,
            self.connections,
        )
        return True

    def _buffers(self, count: int) -> list[torch.Tensor]:
        """``count`` chunk-sized buffers whose memory is faulted in already (zero-filled here,
        outside the clock). A fetch reads into CPU-tier slots, memory touched long before;
        reads into new memory paid a page fault per 4 KiB on top of the transfer, and the
        planner believed the cache server delivered about half of what fetches got (8 at
        once: 2.3-2.6 GB/s where fetches got 3.9-4.0 on the 2-core VM; on an H100 host 8.8
        GB/s where the bulk channel moves 16.6: issue 31). The first buffer is kept for the
        later, one-read measurements; the others go with the opening one."""
        if self._kept_buffer is None:
            self._kept_buffer = torch.zeros(self.chunk_shape, dtype=self.dtype)
        return [self._kept_buffer] + [
            torch.zeros(self.chunk_shape, dtype=self.dtype) for _ in range(count - 1)
        ]

    def _write(self, tier_name: str, tier: StorageBackend) -> bool:
        """Write the probe value to ``tier``; False (nothing left behind) when the prober
        closed before or during the write."""
        with self._lock:
            if self._closed:
                return False
            self._written_tier_names.add(tier_name)
        # random bytes: a codec must not shrink the value a real chunk would not shrink
        raw = torch.randint(
            0, 256, (torch.Size(self.chunk_shape).numel() * self.dtype.itemsize,), dtype=torch.uint8
        )
        tier.put(self.key, KVChunk(raw.view(self.dtype).view(self.chunk_shape), self.layout))
        with self._lock:
            closed = self._closed
        if closed:
            # close() gave up waiting for this write (a slow tier) and its delete may have
            # come before the value landed: delete it again, or it stays in a shared tier
            self._delete(tier_name)
            return False
        return True

    def _delete(self, tier_name: str) -> None:
        try:
            self.name_to_tier[tier_name].delete(self.key)
        except Exception as exc:
            log.debug("deleting the probe value from tier %s failed: %s", tier_name, exc)

    def _read(self, tier: StorageBackend, out: torch.Tensor) -> bool:
        chunk = tier.get_into(self.key, out)
        return chunk is not None and tuple(chunk.tensor.shape) == tuple(self.chunk_shape)

    def close(self) -> None:
        """Stop measuring and delete the probe value from the tiers written (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a read stuck on a dead tier must not hang exit
        with self._lock:
            self._closed = True
            written_tier_names, self._written_tier_names = self._written_tier_names, set()
        for name in written_tier_names:
            self._delete(name)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
