"""Background fetcher: brings a request's chunks from the lower tiers (disk, Redis,
the cache server) into CPU-tier slots, several reads in flight per tier, so no
step ever waits on a lower tier (docs/architecture.md, Connector: "Loads never block a step").

A :class:`FetchJob` lists the chunks of one request in prompt order, each with the
CPU-tier slot the scheduler side granted it (``FetchSpec.slot_ids``,
``connector.slot_grants``). Each chunk with a slot is read with
``StorageBackend.get_into`` straight into that slot's memory, verified in the reading
thread, and reported as a fill ``(key, slot_id, ok)`` (:meth:`ChunkFetcher.take_fills`);
the scheduler side publishes it (with a pin per fetch waiting for it) or frees the slot.
A chunk another fetch is reading (``FETCH_SHARED``) waits for that read: two requests
waiting on the same chunks share one read. A job is done when each of its chunks was
read, missed or failed, or at its deadline (the planner's "never wait for a tier longer
than recomputing"); its usable part is the leading run of chunks that arrived. While a
job runs, :meth:`ChunkFetcher.poll_progress` reports its ready prefix as it grows, so its
request can load those chunks already (pipelined loads: the host→device copy of one
chunk overlaps the reads of the next). The fetcher holds the slab's memory only (a view
per slot): it changes nothing of the CPU tier's index.

Threads: one pool per lower tier (``tier_to_reads_in_flight`` threads: a remote gets more). The engine's step
thread calls :meth:`start`, :meth:`poll`, :meth:`release` and :meth:`take_fills`;
everything shared with the pools is under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from connector.base import FETCH_IN_CPU, FETCH_MISS, FETCH_SHARED, FetchSpec
from connector.breaker import CircuitBreaker
from storage_backends.base import StorageBackend
from storage_backends.thread_pools import started_thread_pool

log = logging.getLogger(__name__)

#: tier name of a chunk that is already in the CPU tier when its job starts
CPU = "cpu"

#: (slot id, shape) -> the slab's memory of that slot as a chunk of that shape
SlotView = Callable[[int, tuple[int, ...]], torch.Tensor]


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
    #: per chunk: the slot granted to read it into, or FETCH_IN_CPU, FETCH_MISS, FETCH_SHARED
    slot_ids: list[int] = field(default_factory=list)
    started: float = 0.0
    deadline: float = 0.0
    #: per chunk: None while being read, then whether it is in the CPU tier (pinned for
    #: this fetch by the scheduler side once it applied the fill)
    outcomes: list[bool | None] = field(default_factory=list)
    done: bool = False
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
            slot_ids=list(spec.slot_ids),
        )

    @property
    def num_ready_chunks(self) -> int:
        """Leading chunks that are in the CPU tier (read, or there already)."""
        count = 0
        for outcome in self.outcomes:
            if outcome is not True:
                break
            count += 1
        return count


class _Read:
    """One key being read into its granted slot; every job waiting for it is a waiter."""

    def __init__(self, key: str, tier_name: str, slot_id: int) -> None:
        self.key = key
        self.tier_name = tier_name
        self.slot_id = slot_id
        self.waiters: list[tuple[FetchJob, int]] = []


class ChunkFetcher:
    """One per connector: the CPU tier's slot memory (``slot_view``), its lower tiers by
    name, a breaker per lower tier."""

    def __init__(
        self,
        slot_view: SlotView,
        name_to_tier: dict[str, StorageBackend],
        name_to_breaker: dict[str, CircuitBreaker],
        *,
        tier_to_reads_in_flight: dict[str, int],
        dtype,
        layout: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (
            set(tier_to_reads_in_flight) != set(name_to_tier)
            or min(tier_to_reads_in_flight.values(), default=1) <= 0
        ):
            raise ValueError(
                f"every lower tier needs a positive number of reads in flight, got {tier_to_reads_in_flight}"
            )
        #: the slab's memory of a slot (the fetcher never asks which chunk a slot holds)
        self.slot_view = slot_view
        self.name_to_tier = name_to_tier
        self.name_to_breaker = name_to_breaker
        self.dtype = dtype
        self.layout = layout
        self._clock = clock
        #: reads in flight per lower tier (one pool thread each)
        self.tier_to_reads_in_flight = dict(tier_to_reads_in_flight)
        self._name_to_pool: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._key_to_read: dict[str, _Read] = {}
        self._running_jobs: list[FetchJob] = []
        self._finished_jobs: list[FetchJob] = []
        self._closed = False
        self.num_failed_reads = 0
        #: fills not yet handed out by take_fills: (key, slot id, ok)
        self._new_fills: list[tuple[str, int, bool]] = []
        #: key -> (ok, report number it went out in; 0: not yet) of fills the scheduler side
        #: may not have applied yet: a FETCH_SHARED chunk whose read ended is answered here
        self._key_to_recent_fill: dict[str, tuple[bool, int]] = {}

    # ---- the step thread -------------------------------------------------------
    def start(self, job: FetchJob) -> None:
        """Queue reads of the job's chunks that have a granted slot; a chunk in the CPU tier
        already is ready, one another job reads waits for that read. Never blocks on I/O.
        A job released before it started reads nothing: its slots are reported unfilled."""
        if len(job.slot_ids) != len(job.keys):
            raise ValueError(
                f"fetch {job.fetch_id} has {len(job.slot_ids)} slot ids for {len(job.keys)} keys"
            )
        to_submit: list[_Read] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("fetcher is closed")
            if job.done:
                for key, slot_id in zip(job.keys, job.slot_ids, strict=True):
                    if slot_id >= 0:
                        self._record_fill(key, slot_id, False)
                return
            job.started = self._clock()
            job.deadline = job.started + job.deadline_s
            job.outcomes = [None] * len(job.keys)
            for index, (key, tier_name, slot_id) in enumerate(
                zip(job.keys, job.tier_names, job.slot_ids, strict=True)
            ):
                if slot_id in (FETCH_IN_CPU, FETCH_MISS):
                    job.outcomes[index] = slot_id == FETCH_IN_CPU
                    continue
                read = self._key_to_read.get(key)
                if slot_id == FETCH_SHARED:
                    if read is not None:
                        read.waiters.append((job, index))
                    else:  # that read ended: its outcome, if the scheduler side had not seen it
                        job.outcomes[index] = self._key_to_recent_fill.get(key, (False, 0))[0]
                    continue
                breaker = self.name_to_breaker.get(tier_name)
                if (
                    read is not None
                    or tier_name not in self.name_to_tier
                    or (breaker is not None and not breaker.allow())
                ):
                    job.outcomes[index] = False
                    self._record_fill(key, slot_id, False)
                    continue
                read = _Read(key, tier_name, slot_id)
                read.waiters.append((job, index))
                self._key_to_read[key] = read
                to_submit.append(read)
            self._running_jobs.append(job)
            self._check_done(job)
        for read, shape in ((read, job.shapes[job.keys.index(read.key)]) for read in to_submit):
            self._pool(read.tier_name).submit(self._read, read, shape)

    def take_fills(self, report_number: int) -> list[tuple[str, int, bool]]:
        """The reads that ended since the last call, ``(key, slot id, ok)``, for the report
        numbered ``report_number`` (the step thread, once per report)."""
        with self._lock:
            fills, self._new_fills = self._new_fills, []
            for key, _, ok in fills:
                self._key_to_recent_fill[key] = (ok, report_number)
        return fills

    def forget_fills(self, num_reports_applied: int) -> None:
        """The scheduler side applied the reports up to ``num_reports_applied``: their fills
        are in its index, no later grant names them as shared (each step's metadata)."""
        with self._lock:
            self._key_to_recent_fill = {
                key: fill
                for key, fill in self._key_to_recent_fill.items()
                if fill[1] == 0 or fill[1] > num_reports_applied
            }

    def _record_fill(self, key: str, slot_id: int, ok: bool) -> None:
        """Under the lock: the read of ``key`` into ``slot_id`` ended (or never ran)."""
        self._new_fills.append((key, slot_id, ok))
        self._key_to_recent_fill[key] = (ok, 0)

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

    def release(self, job: FetchJob) -> None:
        """Stop the job if it still runs (its request loaded it, ended or dropped it): reads
        in flight then complete for the tier alone. Its pins are the scheduler side's."""
        with self._lock:
            if not job.done:
                self._detach(job)
                job.done = True
                if job in self._running_jobs:
                    self._running_jobs.remove(job)

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
                pool = started_thread_pool(
                    self.tier_to_reads_in_flight[tier_name], f"kvstash-fetch-{tier_name}"
                )
                self._name_to_pool[tier_name] = pool
            return pool

    def _read(self, read: _Read, shape: tuple[int, ...]) -> None:
        """A pool thread: read one chunk into its granted slot and record the fill."""
        tier = self.name_to_tier[read.tier_name]
        breaker = self.name_to_breaker.get(read.tier_name)
        ok = False
        num_bytes = 0
        try:
            buffer = self.slot_view(read.slot_id, tuple(shape))
            chunk = tier.get_into(read.key, buffer)
            if breaker is not None:
                breaker.succeeded()
            ok = (
                chunk is not None
                and tuple(chunk.tensor.shape) == tuple(shape)
                and chunk.tensor.dtype == self.dtype
                and chunk.layout == self.layout
            )
            num_bytes = buffer.numel() * buffer.element_size() if ok else 0
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
            self._record_fill(read.key, read.slot_id, ok)
            for job, index in read.waiters:
                if job.done:
                    continue
                if ok and num_bytes:
                    old_bytes, _ = job.tier_to_transfer.get(read.tier_name, (0, 0.0))
                    job.tier_to_transfer[read.tier_name] = (old_bytes + num_bytes, finished - job.started)
                job.outcomes[index] = ok
                self._check_done(job)
            self._progress.notify_all()

    def _check_done(self, job: FetchJob) -> None:
        if not job.done and all(outcome is not None for outcome in job.outcomes):
            self._finish(job)

    def _finish(self, job: FetchJob) -> None:
        """Under the lock: end the job (the scheduler side drops its pins past its usable
        prefix when the report says it ended)."""
        self._detach(job)
        job.done = True
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
        if job in self._running_jobs:
            self._running_jobs.remove(job)
        self._finished_jobs.append(job)
        self._progress.notify_all()

    def _detach(self, job: FetchJob) -> None:
        for read in self._key_to_read.values():
            read.waiters = [(waiter, index) for waiter, index in read.waiters if waiter is not job]
