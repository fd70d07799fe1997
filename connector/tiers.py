"""Tier manager: CPU memory → local disk → remote, over ``storage_backends``
(docs/architecture.md, Connector).

Stores go to the CPU tier at once and are written through to the lower tiers
by one background thread fed by a bounded queue; when the queue is full the
lower-tier writes are dropped and counted so the engine's step loop never
stalls on slow I/O. Reads walk the tiers top-down; a chunk found below the CPU
tier is promoted into it. Pins (taken by ``lookup(pin=True)``) keep CPU-tier
chunks from being evicted until the retrieve releases them or they time out.

The CPU tier is the connector's own :class:`~connector.cpu_tier.PinnedChunkPool`
(zero-copy reads and writes on the transfer path); the lower tiers come from
``storage_backends.create_backend``.

Any tier error is a miss (reads) or a dropped write (stores): it is counted per
tier and logged once when the tier starts failing and once when it recovers.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from connector.base import SAVE_NO_ROOM, SAVE_SKIP
from connector.config import OffloadConfig, backend_urls
from connector.cpu_tier import PinnedChunkPool
from connector.slot_index import PinKind
from connector.token_db import KV_LAYOUT
from connector.write_buffers import PrivateWriteBuffers
from storage_backends import create_backend
from storage_backends.base import StorageBackend
from storage_backends.chunk import KVChunk
from storage_backends.write_gate import WriteGate

log = logging.getLogger(__name__)

_STOP = object()


class TierHealth:
    """Error bookkeeping for one tier; logs once per incident, not per request.

    An incident starts at the first failed operation and ends when that same
    operation succeeds again: other operations may keep working meanwhile (the
    disk tier answers ``contains`` from its index while its folder is gone), and
    their successes must not end the incident and restart it on every request.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        #: the operation whose failure started the current incident (None: healthy)
        self.failing_operation: str | None = None
        self.counts: Counter[str] = Counter()

    @property
    def failing(self) -> bool:
        return self.failing_operation is not None

    def failed(self, operation: str, exc: BaseException) -> None:
        self.counts["errors"] += 1
        if self.failing_operation is None:
            self.failing_operation = operation
            log.warning("tier %s failing (%s: %s); treating its reads as misses", self.name, operation, exc)

    def succeeded(self, operation: str) -> None:
        if self.failing_operation == operation:
            self.failing_operation = None
            log.info("tier %s recovered after %d errors", self.name, self.counts["errors"])


class PrefixRead(NamedTuple):
    """What :meth:`TierManager.get_prefix` found: the chunks of the leading present keys,
    the CPU-tier keys it pinned for reading, and the name of the tier each chunk came
    from (``tier_names[i]`` for ``chunks[i]``: "cpu", "disk", "redis", "grpc")."""

    chunks: list[KVChunk]
    held_keys: list[str]
    tier_names: list[str]
    #: (key, slot id, ok) of each granted promotion slot (filled, or not)
    fills: list[tuple[str, int, bool]] = []


class PendingPut(NamedTuple):
    """A store of one chunk between :meth:`TierManager.begin_put` and ``end_put``."""

    key: str
    buffer: torch.Tensor  # host [num_layers, 2, num_tokens, num_kv_heads, head_dim] to fill
    slot_id: int | None  # the granted CPU-tier slot ``buffer`` is, or None (a private buffer)


#: longest pause of the lower tiers' background writes per load (ends a hold never
#: released, e.g. of a request admitted, then aborted)
LOAD_WRITE_HOLD_S = 0.25


class TierManager:
    """The ordered tiers of one connector. Thread-safe; called by the cache engine
    on every lookup, store and retrieve, and owns the write-through thread."""

    def __init__(
        self,
        cpu: PinnedChunkPool | None,
        lower: Sequence[StorageBackend],
        *,
        dtype: torch.dtype,
        save_queue_size: int,
        pin_timeout_s: float,
        save_buffer_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cpu = cpu
        self.lower = list(lower)
        self.tiers: list[StorageBackend] = ([cpu] if cpu is not None else []) + self.lower
        if not self.tiers:
            raise ValueError("TierManager needs at least one tier")
        self.health = {id(tier): TierHealth(tier.name) for tier in self.tiers}
        self.dtype = dtype
        self.pin_timeout_s = pin_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        # key -> one (deadline, tiers holding the pin) per pin taken, oldest first
        self._key_to_pins: dict[str, list[tuple[float, list[StorageBackend]]]] = {}
        # tiers that evict on their own override StorageBackend.pin
        self._pinnable = [tier for tier in self.tiers if type(tier).pin is not StorageBackend.pin]
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()  # the writer thread counts too
        self._write_queue: queue.Queue = queue.Queue(maxsize=save_queue_size)
        #: buffers of chunks stored without a CPU-tier slot, at most save_buffer_bytes of them
        self.write_buffers = PrivateWriteBuffers(save_buffer_bytes)
        self._writer: threading.Thread | None = None
        self._closed = False
        #: called first by :meth:`close` (users of the tiers that must stop before them)
        self._close_hooks: list[Callable[[], None]] = []
        #: lower tier name -> its circuit breaker (set by create_kv_connector with async loads)
        self.breakers: dict = {}
        #: held by the connector while a step's loads are planned and copied: the lower
        #: tiers' background writes (those that support it: the disk tier) wait at it
        self.write_gate = WriteGate()
        for tier in self.lower:
            if hasattr(tier, "write_gate"):
                tier.write_gate = self.write_gate
        #: the engine's KV event recorder, ``(kind, medium, keys)`` (None: no events)
        self._record_kv_event: Callable[[str, str, list[str]], None] | None = None
        #: keys whose write-through read their CPU-tier slot and ended, not yet taken
        self._written_through: list[str] = []

    def add_lower(self, tier: StorageBackend, *, before: frozenset[str] = frozenset()) -> None:
        """Add a lower tier before the first lower tier named in ``before`` (else last): the
        direct path's ``nixl`` tier goes before the shared tier (read first). A tier with
        ``read_only`` set gets no write-through. Called once at start-up, before any use."""
        index = next((i for i, lower in enumerate(self.lower) if lower.name in before), len(self.lower))
        self.lower.insert(index, tier)
        self.tiers = ([self.cpu] if self.cpu is not None else []) + self.lower
        self.health[id(tier)] = TierHealth(tier.name)

    def attach_kv_events(self, record: Callable[[str, str, list[str]], None]) -> None:
        """Tell ``record(kind, medium, keys)`` what the tiers hold from now on (the engine's
        KV events, docs/architecture.md): first what each tier that lists its keys holds
        now, then every chunk the CPU and disk tiers store or drop, and every write-through
        a shared tier took (its evictions are its own: a router learns them as misses).
        Called once, at start-up, before any request."""
        self._record_kv_event = record
        if self.cpu is not None:
            record("stored", self.cpu.name, self.cpu.keys())
            self.cpu.index.on_change = functools.partial(_record_for, record, self.cpu.name)
        for tier in self.lower:
            if hasattr(tier, "on_change"):
                record("stored", tier.name, tier.keys())
                tier.on_change = functools.partial(_record_for, record, tier.name)

    @classmethod
    def from_config(
        cls,
        config: OffloadConfig,
        chunk_shape: tuple[int, ...],  # [num_layers, 2, chunk_size, num_kv_heads, head_dim]
        dtype: torch.dtype,
        *,
        pin_memory: bool,
        grow_cpu_tier: bool = False,
    ) -> TierManager:
        """Build the configured tiers; ``pin_memory`` when the KV cache is on CUDA.
        ``grow_cpu_tier``: the CPU tier allocates its first slab piece now and the rest
        after :meth:`start_background_allocation` (connector.cpu_tier)."""
        lower: list[StorageBackend] = []
        cpu = None
        try:
            for url in backend_urls(config):
                lower.append(create_backend(url))
            if config.cpu_bytes > 0:
                cpu = PinnedChunkPool(
                    config.cpu_bytes,
                    chunk_shape,
                    dtype,
                    pin_memory=pin_memory,
                    layout=KV_LAYOUT,
                    grow_in_background=grow_cpu_tier,
                )
            elif lower and config.async_loads and config.staging_bytes > 0:
                # No CPU tier: fetched chunks still land off the step, in a staging area of their own.
                cpu = PinnedChunkPool(
                    config.staging_bytes,
                    chunk_shape,
                    dtype,
                    pin_memory=pin_memory,
                    layout=KV_LAYOUT,
                    staging=True,
                )
        except Exception:
            for tier in lower:
                tier.close()
            raise
        return cls(
            cpu,
            lower,
            dtype=dtype,
            save_queue_size=config.save_queue_size,
            pin_timeout_s=config.pin_timeout_s,
            save_buffer_bytes=config.save_buffer_bytes,
        )

    def start_background_allocation(self) -> None:
        """Let the CPU tier grow its slab on a thread of its own (when it was built to)."""
        if self.cpu is not None:
            self.cpu.start_growing()

    # ---- reads ---------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """The tiers' names, the CPU tier's first (``SchedulerIndex.tiers``)."""
        return [tier.name for tier in self.tiers]

    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are present in some tier (each key may sit in a
        different tier). Side-effect free apart from LRU recency."""
        num_found = 0
        progressed = True
        while progressed and num_found < len(keys):
            progressed = False
            for tier in self.tiers:
                try:
                    num_more = tier.contains(keys[num_found:])
                except Exception as exc:
                    self.health[id(tier)].failed("contains", exc)
                    continue
                self.health[id(tier)].succeeded("contains")
                if num_more:
                    num_found += num_more
                    progressed = True
                    if num_found == len(keys):
                        break
        return num_found

    def get_prefix(
        self,
        keys: Sequence[str],
        *,
        cpu_only: bool = False,
        cpu_chunks: dict[str, KVChunk] | None = None,
        promotion_slots: dict[str, int] | None = None,
    ) -> PrefixRead:
        """The chunks of the leading present ``keys`` (stops at the first key that no
        tier returns; with ``cpu_only`` the lower tiers are not read: the fetcher
        brought what a step may load into the CPU tier). Lower-tier hits are promoted
        into the CPU tier. ``cpu_chunks``: the CPU tier's chunks as the scheduler side
        granted them (views of READ-pinned slots): the CPU tier is not asked, nothing pinned;
        ``promotion_slots``: key -> the slot granted to promote it into (nothing else is).

        Returns ``(chunks, held_keys, tier_names)``: CPU-tier chunks are zero-copy views
        kept valid by a pin on each of ``held_keys``; the caller must :meth:`release`
        them once its transfer has finished reading.
        """
        key_to_found: dict[str, tuple[KVChunk, StorageBackend]] = {}
        held_keys: list[str] = []
        if cpu_chunks is not None:
            key_to_found = {key: (chunk, self.cpu) for key, chunk in cpu_chunks.items()}
        elif self.cpu is not None:
            for key, chunk in self.cpu.pin_and_get(keys).items():
                key_to_found[key] = (chunk, self.cpu)
                held_keys.append(key)
        for tier in [] if cpu_only else self.lower:
            wanted = [key for key in keys if key not in key_to_found]
            if not wanted:
                break
            try:
                key_chunk_pairs = list(zip(wanted, tier.get_many(wanted), strict=True))
            except Exception as exc:
                self.health[id(tier)].failed("get", exc)
                continue
            self.health[id(tier)].succeeded("get")
            for key, chunk in key_chunk_pairs:
                if chunk is not None:
                    key_to_found[key] = (chunk, tier)
        found, tier_names = [], []
        for key in keys:
            if key not in key_to_found:
                break
            chunk, tier = key_to_found[key]
            found.append(chunk)
            tier_names.append(tier.name)
            self._count(f"hits_{tier.name}", 1)
            if self.cpu is not None and tier is not self.cpu and promotion_slots is None:
                self._put_cpu(key, chunk)
                self._count("promotions", 1)
        fills = []
        for key, slot_id in (promotion_slots or {}).items():
            chunk = key_to_found[key][0] if key in key_to_found and key in keys[: len(found)] else None
            fills.append((key, slot_id, chunk is not None and self.cpu.fill(slot_id, chunk)))
            self._count("promotions", int(fills[-1][2]))
        return PrefixRead(found, held_keys, tier_names, fills)

    def count_hits(self, tier_to_num_chunks: dict[str, int]) -> None:
        """Count chunks read from lower tiers outside :meth:`get_prefix` (background fetches)."""
        for tier_name, num_chunks in tier_to_num_chunks.items():
            self._count(f"hits_{tier_name}", num_chunks)

    def release(self, held_keys: Sequence[str]) -> None:
        """Drop the read pins that :meth:`get_prefix` took."""
        if self.cpu is not None and held_keys:
            self.cpu.unpin(held_keys, PinKind.READ)

    # ---- writes --------------------------------------------------------------
    def begin_put(
        self, key: str, shape: tuple[int, ...], *, slot_id: int, pin_memory: bool
    ) -> PendingPut | None:
        """A host buffer ``shape`` ([num_layers, 2, num_tokens, heads, head_dim]) to fill
        with the chunk for ``key``: the CPU-tier slot ``slot_id`` the scheduler side (or the
        cache engine, standing alone) reserved for it, or a private tensor when there is no
        slot (``SAVE_NO_ROOM``, ``SAVE_NO_CPU``: lower tiers only). None for ``SAVE_SKIP``
        (the CPU tier holds or fills it already) or when there is nowhere to put it.
        Follow with :meth:`end_put`. Changes nothing of the CPU tier's index."""
        if slot_id == SAVE_SKIP:
            return None
        if slot_id >= 0:
            return PendingPut(key, self.cpu.view(slot_id, tuple(shape)), slot_id)
        if slot_id == SAVE_NO_ROOM:
            # Every slot is pinned (reads, lookups, writes in flight to lower tiers):
            # skip the CPU tier, still write through below.
            self._count("dropped_writes_cpu", 1)
        if not self.lower:
            return None
        buffer = self.write_buffers.take(shape, self.dtype, pin_memory=pin_memory)
        if buffer is None:
            # the private buffers alive (chunks on their way below) are at their byte budget
            self._count("dropped_writes_no_buffer", 1)
            return None
        return PendingPut(key, buffer, None)

    def end_put(self, pending: PendingPut) -> None:
        """Queue a filled :meth:`begin_put` buffer's write-through (never blocks). A slot's
        write-through ends in :meth:`take_written_through` (written, failed or dropped); its
        publication is the slot's granter's (the fill is reported)."""
        if not self.lower:
            return
        in_cpu = pending.slot_id is not None
        self._ensure_writer()
        try:
            self._write_queue.put_nowait((pending.key, KVChunk(pending.buffer, KV_LAYOUT), in_cpu))
        except queue.Full:
            self._count("dropped_writes", 1)
            if in_cpu:
                self._written_through_now([pending.key])

    def take_written_through(self) -> list[str]:
        """Keys of CPU-tier slots whose write-through ended since the last call (their
        granter drops the write-through pins). Any thread."""
        with self._counts_lock:
            keys, self._written_through = self._written_through, []
        return keys

    def _written_through_now(self, keys: list[str]) -> None:
        with self._counts_lock:
            self._written_through += keys

    def _put_cpu(self, key: str, chunk: KVChunk) -> None:
        """Copy a lower-tier hit into the CPU tier (no write-through: it came from below)."""
        try:
            self.cpu.put(key, chunk)
            self.health[id(self.cpu)].succeeded("promote")
        except Exception as exc:
            self.health[id(self.cpu)].failed("promote", exc)

    def _ensure_writer(self) -> None:
        with self._lock:
            if self._writer is None and not self._closed:
                self._writer = threading.Thread(
                    target=self._write_through, name="kvstash-write-through", daemon=True
                )
                self._writer.start()

    def _write_through(self) -> None:
        """Background loop: drain the queue in batches into every lower tier."""
        while True:
            item = self._write_queue.get()
            batch = [item]
            while True:
                try:
                    batch.append(self._write_queue.get_nowait())
                except queue.Empty:
                    break
            entries = [entry for entry in batch if entry is not _STOP]
            items = [(key, chunk) for key, chunk, _ in entries]
            for tier in self.lower:
                if not items:
                    break
                if getattr(tier, "read_only", False):
                    continue
                try:
                    tier.put_many(items)
                    self.health[id(tier)].succeeded("put")
                    self._count(f"written_{tier.name}", len(items))
                    if self._record_kv_event is not None and not hasattr(tier, "on_change"):
                        self._record_kv_event("stored", tier.name, [key for key, _ in items])
                except Exception as exc:
                    self.health[id(tier)].failed("put", exc)
                    self._count(f"dropped_writes_{tier.name}", len(items))
            held_keys = [key for key, _, held in entries if held]
            if held_keys:
                self._written_through_now(held_keys)
            done_stop = len(entries) != len(batch)
            num_done = len(batch)
            # Drop this batch's chunks before waiting for the next: a private buffer counts
            # against save_buffer_bytes for as long as anything refers to it.
            del item, batch, entries, items
            for _ in range(num_done):
                self._write_queue.task_done()
            if done_stop:
                return

    def flush(self) -> None:
        """Block until every queued lower-tier write was attempted (tests, shutdown)."""
        self._write_queue.join()

    def num_pending_writes(self) -> int:
        """Lower-tier writes queued or running (a producer's hand-over waits for its own). Any thread."""
        return self._write_queue.unfinished_tasks

    # ---- pins ----------------------------------------------------------------
    def pin(self, keys: Sequence[str]) -> None:
        """Protect ``keys`` from eviction in every tier that evicts on its own (CPU,
        disk) until :meth:`unpin` or ``pin_timeout_s``. Remote tiers cannot be pinned:
        a chunk that vanishes there is a miss at retrieve time and gets recomputed."""
        self.expire_pins()
        deadline = self._clock() + self.pin_timeout_s
        key_to_tiers: dict[str, list[StorageBackend]] = {key: [] for key in keys}
        # The tiers pin outside ``_lock``: a tier may wait on its own lock (the disk tier's,
        # behind its writes), and ``unpin``/``expire_pins`` of other keys must not wait with
        # it. A pin is recorded once taken, so a concurrent unpin releases only recorded pins.
        for tier in self._pinnable:
            for key, pinned in zip(keys, self._pin_each(tier, keys), strict=True):
                if pinned:
                    key_to_tiers[key].append(tier)
        with self._lock:
            for key, pinned_tiers in key_to_tiers.items():
                if pinned_tiers:
                    self._key_to_pins.setdefault(key, []).append((deadline, pinned_tiers))

    def _pin_each(self, tier: StorageBackend, keys: Sequence[str]) -> list[bool]:
        if tier is self.cpu:
            return self.cpu.pin_each(keys)
        pinned = []
        for key in keys:
            try:
                pinned.append(tier.pin([key]) == 1)
            except Exception as exc:
                self.health[id(tier)].failed("pin", exc)
                pinned.append(False)
        return pinned

    def unpin(self, keys: Sequence[str]) -> None:
        """Release the oldest pin of each of ``keys`` (keys without pins are ignored)."""
        tier_to_keys: dict[int, list[str]] = {}
        with self._lock:
            for key in keys:
                pins = self._key_to_pins.get(key)
                if pins:
                    for tier in pins.pop(0)[1]:
                        tier_to_keys.setdefault(id(tier), []).append(key)
                    if not pins:
                        del self._key_to_pins[key]
        self._release(tier_to_keys)

    def expire_pins(self) -> None:
        """Release every pin older than ``pin_timeout_s``; called on each pin, lookup and store."""
        now = self._clock()
        num_expired = 0
        tier_to_keys: dict[int, list[str]] = {}
        with self._lock:
            for key in list(self._key_to_pins):
                pins = self._key_to_pins[key]
                while pins and pins[0][0] <= now:
                    for tier in pins.pop(0)[1]:
                        tier_to_keys.setdefault(id(tier), []).append(key)
                    num_expired += 1
                if not pins:
                    del self._key_to_pins[key]
        self._release(tier_to_keys)
        if num_expired:
            self._count("expired_pins", num_expired)

    def _release(self, tier_to_keys: dict[int, list[str]]) -> None:
        for tier in self.tiers:
            keys = tier_to_keys.get(id(tier))
            if not keys:
                continue
            try:
                tier.unpin(keys)
            except Exception as exc:
                self.health[id(tier)].failed("unpin", exc)

    def num_pinned(self) -> int:
        """Number of keys holding at least one pin."""
        with self._lock:
            return len(self._key_to_pins)

    # ---- stats, lifecycle ----------------------------------------------------
    def _count(self, name: str, amount: int) -> None:
        with self._counts_lock:
            self._counts[name] += amount

    def counters(self) -> dict[str, int]:
        """The manager's own counters (hits per tier, promotions, dropped writes, expired
        pins); no tier I/O."""
        with self._counts_lock:
            return dict(self._counts)

    def stats(self) -> dict[str, Any]:
        """Manager counters (hits per tier, promotions, dropped writes...) and each
        tier's own ``stats()`` with its error count."""
        tier_stats = {}
        for tier in self.tiers:
            try:
                backend = tier.stats()
                self.health[id(tier)].succeeded("stats")
            except Exception as exc:
                self.health[id(tier)].failed("stats", exc)
                backend = {}
            tier_stats[tier.name] = {**backend, "connector_errors": self.health[id(tier)].counts["errors"]}
        buffers = self.write_buffers
        return {
            **self.counters(),
            "pinned_keys": self.num_pinned(),
            "write_buffer_bytes": buffers.num_bytes,
            "write_buffer_peak_bytes": buffers.peak_bytes,
            "tiers": tier_stats,
        }

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` first when the tiers close (a background user of them, such as the
        tier prober, stops and cleans up before they do)."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        """Stop the users registered with :meth:`on_close`, finish queued writes, stop the
        writer thread, close every tier. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writer = self._writer
            hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook()
        if writer is not None:
            self._write_queue.put(_STOP)
            writer.join()
        for tier in self.tiers:
            tier.close()


def _record_for(
    record: Callable[[str, str, list[str]], None], medium: str, kind: str, keys: list[str]
) -> None:
    record(kind, medium, keys)
