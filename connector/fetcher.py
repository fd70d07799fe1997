"""Background fetcher: brings a request's chunks from the lower tiers (disk, Redis,
the cache server) into CPU-tier slots, several reads in flight per tier, so no
step ever waits on a lower tier (docs/architecture.md, Connector: "Loads never block a step").

A :class:`FetchJob` lists the chunks of one request in prompt order. Each chunk
is read with ``StorageBackend.get_into`` straight into a reserved CPU-tier slot
(a :class:`~connector.cpu_tier.Reservation`), verified in the reading thread,
then published with one pin per job waiting for it: two requests waiting on the
same chunks share one read. A job is done when each of its chunks was read,
missed or failed, or at its deadline (the planner's "never wait for a tier
longer than recomputing"); its usable part is the leading run of chunks that
arrived, and the pins on chunks after the first gap are dropped at once. The
pins of the usable part belong to the job until the load that reads them (or an
abort) calls :meth:`ChunkFetcher.release`. While a job runs, :meth:`ChunkFetcher.poll_progress`
reports its ready prefix as it grows, so its request can load those chunks already
(pipelined loads: the host→device copy of one chunk overlaps the reads of the next).

Threads: one pool per lower tier (``reads_in_flight`` threads). The engine's step
thread calls :meth:`start`, :meth:`poll` and :meth:`release`; everything shared
with the pools is under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from connector.base import FetchSpec
from connector.breaker import CircuitBreaker
from connector.cpu_tier import PinnedChunkPool
from connector.slot_index import PinKind
from storage_backends.base import CapacityError, StorageBackend
from storage_backends.thread_pools import started_thread_pool

log = logging.getLogger(__name__)

#: tier name of a chunk that is already in the CPU tier when its job starts
CPU = "cpu"


@dataclass(eq=False)
class FetchJob:
    """The chunks of one request to bring into the CPU tier: the worker side's running
    state of a :class:`~connector.base.FetchSpec` (no tensors), run by the fetcher."""

    request_id: str
    keys: list[str]
    #: [num_layers, 2, num_tokens, num_kv_heads, head_dim] of each chunk
    shapes: list[tuple[int, ...]]
    #: the tier to read each chunk from ("cpu": already there, only pinned)
    tier_names: list[str]
    #: seconds after its start when the job stops waiting for its missing chunks
    deadline_s: float
    #: chunk index in the prompt of ``keys[0]``
    first_chunk: int = 0
    #: the scheduler side's name for it (``FetchSpec.fetch_id``)
    fetch_id: int = 0
    started: float = 0.0
    deadline: float = 0.0
    #: per chunk: None while being read, then whether it is in the CPU tier with this job's pin
    outcomes: list[bool | None] = field(default_factory=list)
    done: bool = False
    #: the job's pins still held (released by ChunkFetcher.release)
    pinned_keys: list[str] = field(default_factory=list)
    #: tier name -> (bytes read, seconds from the job's start to that tier's last read)
    tier_to_transfer: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: ``num_ready_chunks`` when :meth:`ChunkFetcher.poll_progress` last reported the job
    num_reported_ready: int = 0
    #: its deadline ended it with reads still running: its rates are what the tiers deliver now
    cut: bool = False

    @classmethod
    def from_spec(cls, spec: FetchSpec) -> FetchJob:
        """The job of a fetch the scheduler side planned (the worker side runs it)."""
        return cls(
            spec.request_id,
            list(spec.keys),
            list(spec.shapes),
            list(spec.tier_names),
            spec.deadline_s,
            first_chunk=spec.first_chunk,
            fetch_id=spec.fetch_id,
        )

    @property
    def num_ready_chunks(self) -> int:
        """Leading chunks that are in the CPU tier, pinned for this job."""
        count = 0
        for outcome in self.outcomes:
            if outcome is not True:
                break
            count += 1
        return count


class _Read:
    """One key being read into the CPU tier; every job waiting for it is a waiter."""

    def __init__(self, key: str, tier_name: str) -> None:
        self.key = key
        self.tier_name = tier_name
        self.waiters: list[tuple[FetchJob, int]] = []


class ChunkFetcher:
    """One per connector: its CPU tier, its lower tiers by name, a breaker per lower tier."""

    def __init__(
        self,
        cpu: PinnedChunkPool,
        name_to_tier: dict[str, StorageBackend],
        name_to_breaker: dict[str, CircuitBreaker],
        *,
        reads_in_flight: int,
        dtype,
        layout: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if reads_in_flight <= 0:
            raise ValueError(f"reads_in_flight must be positive, got {reads_in_flight}")
        self.cpu = cpu
        self.name_to_tier = name_to_tier
        self.name_to_breaker = name_to_breaker
        self.dtype = dtype
        self.layout = layout
        self._clock = clock
        #: reads in flight per lower tier (one pool thread each)
        self.reads_in_flight = reads_in_flight
        self._name_to_pool: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._key_to_read: dict[str, _Read] = {}
        self._running_jobs: list[FetchJob] = []
        self._finished_jobs: list[FetchJob] = []
        self._closed = False
        self.num_failed_reads = 0

    # ---- the step thread -------------------------------------------------------
    def start(self, job: FetchJob) -> None:
        """Pin the job's chunks that are in the CPU tier already and queue reads of the
        others (a chunk some other job is reading is shared). Never blocks on I/O."""
        if job.done:
            return  # released (its request ended) before the worker got to start it
        job.started = self._clock()
        job.deadline = job.started + job.deadline_s
        job.outcomes = [None] * len(job.keys)
        to_submit: list[_Read] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("fetcher is closed")
            for index, (key, tier_name) in enumerate(zip(job.keys, job.tier_names, strict=True)):
                read = self._key_to_read.get(key)
                if read is not None:
                    read.waiters.append((job, index))
                    continue
                # In the CPU tier already (listed there, or stored or promoted since the lookup)?
                in_cpu = self.cpu.pin_each([key], PinKind.FETCH)[0]
                if in_cpu or tier_name == CPU:
                    self._resolve(job, index, in_cpu)
                    continue
                breaker = self.name_to_breaker.get(tier_name)
                if tier_name not in self.name_to_tier or (breaker is not None and not breaker.allow()):
                    self._resolve(job, index, False)
                    continue
                read = _Read(key, tier_name)
                read.waiters.append((job, index))
                self._key_to_read[key] = read
                to_submit.append(read)
            self._running_jobs.append(job)
            self._check_done(job)
        for read, shape in ((read, job.shapes[job.keys.index(read.key)]) for read in to_submit):
            self._pool(read.tier_name).submit(self._read, read, shape)

    def poll(self) -> list[FetchJob]:
        """Jobs finished since the last call; jobs past their deadline are finished now
        (their missing chunks stop counting; reads still running fill the CPU tier
        for later requests). Called once per step."""
        now = self._clock()
        with self._lock:
            for job in list(self._running_jobs):
                if not job.done and now >= job.deadline:
                    self._finish(job)
            finished, self._finished_jobs = self._finished_jobs, []
        return finished

    def poll_progress(self) -> list[FetchJob]:
        """Running jobs whose ready prefix grew since they were last
        reported: their request may load those chunks while the rest is read (pipelined
        loads). Called once per step; a job that ended is reported by :meth:`poll` instead."""
        progressed = []
        with self._lock:
            for job in self._running_jobs:
                num_ready = job.num_ready_chunks
                if not job.done and num_ready > job.num_reported_ready:
                    job.num_reported_ready = num_ready
                    progressed.append(job)
        return progressed

    def wait_for_progress(self, timeout_s: float) -> None:
        """Sleep until some read finished or ``timeout_s`` passed (an idle step loop)."""
        with self._progress:
            if not self._finished_jobs:
                self._progress.wait(timeout_s)

    def release(self, job: FetchJob, keys: Sequence[str] | None = None) -> None:
        """Drop the job's pins on ``keys`` (all of them by default) and stop it if it
        still runs (an abort): reads in flight then complete for the tier alone."""
        with self._lock:
            if not job.done:
                self._detach(job)
                job.done = True
                if job in self._running_jobs:
                    self._running_jobs.remove(job)
            drop = list(job.pinned_keys) if keys is None else [k for k in keys if k in job.pinned_keys]
            for key in drop:
                job.pinned_keys.remove(key)
        if drop:
            self.cpu.unpin(drop, PinKind.FETCH)

    def close(self) -> None:
        """Stop taking jobs; queued reads are dropped (idempotent)."""
        with self._lock:
            self._closed = True
            pools = list(self._name_to_pool.values())
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)  # a read stuck on a dead tier must not hang exit

    # ---- internals -------------------------------------------------------------
    def _pool(self, tier_name: str) -> ThreadPoolExecutor:
        with self._lock:
            pool = self._name_to_pool.get(tier_name)
            if pool is None:
                pool = started_thread_pool(self.reads_in_flight, f"kvstash-fetch-{tier_name}")
                self._name_to_pool[tier_name] = pool
            return pool

    def _read(self, read: _Read, shape: tuple[int, ...]) -> None:
        """A pool thread: read one chunk into a reserved slot and publish it."""
        tier = self.name_to_tier[read.tier_name]
        breaker = self.name_to_breaker.get(read.tier_name)
        reservation = None
        ok = False
        num_bytes = 0
        try:
            reservation = self.cpu.reserve(read.key, shape)
            if reservation is not None:
                chunk = tier.get_into(read.key, reservation.buffer)
                if breaker is not None:
                    breaker.succeeded()
                ok = (
                    chunk is not None
                    and tuple(chunk.tensor.shape) == tuple(shape)
                    and chunk.tensor.dtype == self.dtype
                    and chunk.layout == self.layout
                )
                num_bytes = reservation.buffer.numel() * reservation.buffer.element_size() if ok else 0
        except CapacityError:
            pass  # every slot pinned: a miss for now, not the tier's fault
        except ValueError as exc:
            # a value that is no chunk of this shape (another model's, or damaged): a miss
            # that is recomputed, not the tier's failure (its breaker stays closed)
            log.warning(
                "fetch of %s from %s: not a usable chunk, recomputed: %s", read.key, read.tier_name, exc
            )
        except Exception as exc:
            self.num_failed_reads += 1
            log.debug("fetch of %s from %s failed: %s", read.key, read.tier_name, exc)
            if breaker is not None:
                breaker.failed(f"read failed: {type(exc).__name__}: {exc}")
        finished = self._clock()
        with self._lock:
            self._key_to_read.pop(read.key, None)
            waiters = [(job, index) for job, index in read.waiters if not job.done]
            if reservation is not None:
                if ok:
                    self.cpu.publish(reservation, num_pins=len(waiters), kind=PinKind.FETCH)
                else:
                    self.cpu.cancel(reservation)
            elif waiters:
                # Present already (stored or promoted meanwhile): pin it for each waiter.
                ok = all(self.cpu.pin_each([read.key] * len(waiters), PinKind.FETCH))
            for job, index in waiters:
                if ok and num_bytes:
                    old_bytes, _ = job.tier_to_transfer.get(read.tier_name, (0, 0.0))
                    job.tier_to_transfer[read.tier_name] = (old_bytes + num_bytes, finished - job.started)
                self._resolve(job, index, ok)
                self._check_done(job)
            self._progress.notify_all()

    def _resolve(self, job: FetchJob, index: int, ok: bool) -> None:
        job.outcomes[index] = ok
        if ok:
            job.pinned_keys.append(job.keys[index])

    def _check_done(self, job: FetchJob) -> None:
        if not job.done and all(outcome is not None for outcome in job.outcomes):
            self._finish(job)

    def _finish(self, job: FetchJob) -> None:
        """Under the lock: end the job, drop pins past its usable prefix."""
        self._detach(job)
        job.done = True
        num_ready = job.num_ready_chunks
        elapsed = self._clock() - job.started
        for index in range(len(job.outcomes)):
            if job.outcomes[index] is None:
                # Still being read at the deadline: the tier delivered at most what arrived in
                # that time, and the planner must learn it (else it keeps waiting on it).
                tier_name = job.tier_names[index]
                num_bytes, _ = job.tier_to_transfer.get(tier_name, (0, 0.0))
                job.tier_to_transfer[tier_name] = (max(num_bytes, 1), elapsed)
                job.outcomes[index] = False
                job.cut = True
        usable = set(job.keys[:num_ready])
        drop = [key for key in job.pinned_keys if key not in usable]
        job.pinned_keys = [key for key in job.pinned_keys if key in usable]
        if drop:
            self.cpu.unpin(drop, PinKind.FETCH)
        if job in self._running_jobs:
            self._running_jobs.remove(job)
        self._finished_jobs.append(job)
        self._progress.notify_all()

    def _detach(self, job: FetchJob) -> None:
        for read in self._key_to_read.values():
            read.waiters = [(waiter, index) for waiter, index in read.waiters if waiter is not job]
