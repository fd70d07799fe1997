"""The connector's CPU-memory tier: one chunk-shaped slot per chunk in a pinned slab.

Why not ``storage_backends``' ``cpu://`` backend: that one copies on every get
and put (its contract, right for a server holding bytes). The connector's
CPU tier sits on the transfer path, so here a slot *is* the staging buffer:
a store copies the paged cache straight into a slot (device → pinned host,
one DMA), a retrieve copies straight out of it (pinned host → device, one DMA).
Every slot holds ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` of the
model's dtype, so slots never fragment and the byte cap is the slab's size.

Zero-copy reads: :meth:`get` returns a view into the slab. A view stays valid
only while its key holds a pin (:meth:`pin`) — the tier manager takes one for
every read and releases it after the transfer. Writes go through
:meth:`reserve` (a :class:`Reservation`: a slot that nobody can see yet) and
:meth:`publish` of that same reservation: publishing goes by the reservation's
identity, never by key, so a second writer of the same key (which got a private
buffer earlier, or came later) can never publish a slot another copy is still
filling. Thread-safe.
"""

from __future__ import annotations

import enum
import math
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from storage_backends.base import CapacityError, StorageBackend
from storage_backends.chunk import KVChunk, decode_chunk, encode_chunk
from storage_backends.counters import Counters
from storage_backends.lru import LRUIndex, SlabTierMixin

#: alignment of the slab (the disk tier's O_DIRECT needs block-aligned memory)
_PAGE_BYTES = 4096


class PinKind(str, enum.Enum):
    """Who holds a pin: each kind is taken and released on its own, so one holder can
    never release another's pin, and ``pin_counts`` shows which kind keeps a slot."""

    LOOKUP = "lookup"  # an admitted request's chunks, until its load is planned (or a timeout)
    READ = "read"  # a load reading the slot's zero-copy view
    WRITE_THROUGH = "write_through"  # a write to the lower tiers reading the slot
    FETCH = "fetch"  # a request waiting on its background fetch
    DEFERRED = "deferred"  # an admitted request's CPU-tier chunks a step's time cap left for later steps


@dataclass(eq=False)
class Reservation:
    """One slot reserved for ``key`` by :meth:`PinnedChunkPool.reserve`: fill ``buffer``,
    then :meth:`~PinnedChunkPool.publish` or :meth:`~PinnedChunkPool.cancel` this object.
    Compared by identity: two reservations of one key are never the same."""

    key: str
    slot_id: int
    shape: tuple[int, ...]
    buffer: torch.Tensor  # the slot's view [num_layers, 2, num_tokens, num_kv_heads, head_dim]


class PinnedChunkPool(SlabTierMixin, StorageBackend):
    """Byte-capped LRU pool of chunk slots; pinned host memory when ``pin_memory``."""

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        chunk_shape: tuple[int, ...],  # [num_layers, 2, chunk_size, num_kv_heads, head_dim]
        dtype: torch.dtype,
        *,
        pin_memory: bool,
        layout: str,
        staging: bool = False,
    ) -> None:
        if len(chunk_shape) != 5 or chunk_shape[1] != 2:
            raise ValueError(
                f"chunk_shape must be [num_layers, 2, chunk_size, heads, head_dim], got {chunk_shape}"
            )
        self.slot_numel = math.prod(chunk_shape)
        self.slot_bytes = self.slot_numel * torch.empty((), dtype=dtype).element_size()
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots == 0:
            what = "staging area" if staging else "cpu tier"
            raise ValueError(
                f"{what} of {capacity_bytes} bytes cannot hold one chunk of {self.slot_bytes} bytes; "
                f"raise {'staging_bytes' if staging else 'cpu_bytes'} or lower chunk_size"
            )
        #: a staging area (no CPU tier configured): fetched chunks only, stores skip it
        self.staging = staging
        self.chunk_shape = tuple(chunk_shape)
        self.layout = layout
        self.pinned = pin_memory
        self._slab = _page_aligned_slab(self.num_slots, self.slot_numel, dtype, pin_memory=pin_memory)
        # slot id -> its full-chunk view, made on the slot's first use and kept: a read of
        # whole chunks then makes no tensor (each torch call gives up the GIL and waits to
        # take it back, per chunk, on the step's path while the disk tier's I/O threads run)
        self._slot_id_to_view: dict[int, torch.Tensor] = {}
        self._free_slot_ids = list(range(self.num_slots - 1, -1, -1))
        self._index = LRUIndex(self.num_slots)  # size unit: slots; record: (slot_id, shape)
        self._key_to_reservation: dict[str, Reservation] = {}
        self._key_to_pin_kinds: dict[str, Counter[PinKind]] = {}
        self._lock = threading.Lock()
        self._counters = Counters()

    def _view(self, slot_id: int, shape: tuple[int, ...]) -> torch.Tensor:
        if shape != self.chunk_shape:
            return self._slab[slot_id, : math.prod(shape)].view(shape)
        view = self._slot_id_to_view.get(slot_id)
        if view is None:  # two threads may both make it: equal views, either one kept
            view = self._slot_id_to_view[slot_id] = self._slab[slot_id].view(shape)
        return view

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        expected = self.chunk_shape
        if (
            len(shape) != 5
            or shape[:2] != expected[:2]
            or shape[3:] != expected[3:]
            or not 0 < shape[2] <= expected[2]
        ):
            raise ValueError(f"chunk shape {tuple(shape)} does not fit a cpu-tier slot of shape {expected}")

    # ---- reads ---------------------------------------------------------------
    def get(self, key: str) -> KVChunk | None:
        """A zero-copy view of the chunk; hold a pin on ``key`` while reading it."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._counters.add("misses")
                return None
            slot_id, shape = entry.record
            view = self._view(slot_id, shape)
        self._counters.add("hits")
        return KVChunk(view, self.layout)

    def pin_and_get(self, keys: Sequence[str]) -> dict[str, KVChunk]:
        """Pin every present key and return its zero-copy view, under one lock (the
        read path of a retrieve). Each returned key holds one READ pin to release with :meth:`unpin`."""
        key_to_record = {}
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                if entry is not None:
                    self._add_pins(key, PinKind.READ, 1)
                    key_to_record[key] = entry.record
        # The views are made outside the lock: the READ pins keep the slots.
        key_to_chunk = {
            key: KVChunk(self._view(slot_id, shape), self.layout)
            for key, (slot_id, shape) in key_to_record.items()
        }
        self._counters.add("hits", len(key_to_chunk))
        self._counters.add("misses", len(keys) - len(key_to_chunk))
        return key_to_chunk

    def pin_each(self, keys: Sequence[str], kind: PinKind = PinKind.LOOKUP) -> list[bool]:
        """Pin each present key (absent ones are skipped, not a stop); one lock for all."""
        with self._lock:
            pinned = []
            for key in keys:
                present = key in self._index
                if present:
                    self._add_pins(key, kind, 1)
                pinned.append(present)
            return pinned

    def pin(self, keys: Sequence[str], kind: PinKind = PinKind.LOOKUP) -> int:
        """Pin the leading present ``keys`` (stops at the first absent one); returns how many."""
        with self._lock:
            num_pinned = 0
            for key in keys:
                if key not in self._index:
                    break
                self._add_pins(key, kind, 1)
                num_pinned += 1
            return num_pinned

    def unpin(self, keys: Sequence[str], kind: PinKind = PinKind.LOOKUP) -> None:
        """Drop one pin of ``kind`` from each key (keys without such a pin are ignored)."""
        with self._lock:
            for key in keys:
                kinds = self._key_to_pin_kinds.get(key)
                if not kinds or kinds[kind] <= 0:
                    continue
                kinds[kind] -= 1
                if kinds[kind] == 0:
                    del kinds[kind]
                    if not kinds:
                        del self._key_to_pin_kinds[key]
                self._index.unpin([key])

    def _add_pins(self, key: str, kind: PinKind, count: int) -> None:
        """Under the lock, ``key`` indexed."""
        if count <= 0:
            return
        self._key_to_pin_kinds.setdefault(key, Counter())[kind] += count
        entry = self._index.get(key, touch=False)
        entry.num_pins += count

    def pin_counts(self) -> dict[str, int]:
        """Pins held now, per kind (``lookup``, ``read``, ``write_through``, ``fetch``, ``deferred``)."""
        with self._lock:
            totals: Counter[str] = Counter()
            for kinds in self._key_to_pin_kinds.values():
                for kind, count in kinds.items():
                    totals[kind.value] += count
            return dict(totals)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "pins_by_kind": self.pin_counts()}

    def get_encoded(self, key: str) -> bytes | None:
        if self.pin([key], PinKind.READ) == 0:
            return None
        try:
            chunk = self.get(key)
            return None if chunk is None else encode_chunk(chunk, key=key)
        finally:
            self.unpin([key], PinKind.READ)

    # ---- writes --------------------------------------------------------------
    def reserve(self, key: str, shape: tuple[int, ...]) -> Reservation | None:
        """A slot to fill with the chunk stored under ``key``, invisible until :meth:`publish`.

        Evicts least-recently-used unpinned chunks. Returns None when ``key`` is
        already stored or reserved (same key, same KV: nothing to do). Raises
        ``CapacityError`` when pinned chunks leave no room.
        """
        self._check_shape(tuple(shape))
        with self._lock:
            if key in self._index or key in self._key_to_reservation:
                self._index.get(key)  # refresh recency
                return None
            if not self._free_slot_ids:
                # Reserved slots are outside the index but take capacity all the same.
                victim_keys = self._index.victims_for(1 + len(self._key_to_reservation))
                if victim_keys is None:
                    self._counters.add("rejected")
                    raise CapacityError(f"cpu tier: all {self.num_slots} slots are pinned or being written")
                for victim_key in victim_keys:
                    self._free_slot_ids.append(self._index.remove(victim_key).record[0])
                self._counters.add("evictions", len(victim_keys))
            slot_id = self._free_slot_ids.pop()
            reservation = Reservation(key, slot_id, tuple(shape), self._view(slot_id, tuple(shape)))
            self._key_to_reservation[key] = reservation
            return reservation

    def publish(
        self, reservation: Reservation, *, num_pins: int = 0, kind: PinKind = PinKind.WRITE_THROUGH
    ) -> None:
        """Make a filled reservation readable (most recently used), holding ``num_pins``
        pins (each released with :meth:`unpin`), taken under the same lock so no
        concurrent put can evict it first (pins of ``kind``). ``ValueError`` for a reservation that is not
        outstanding (already published or cancelled)."""
        with self._lock:
            if self._key_to_reservation.get(reservation.key) is not reservation:
                raise ValueError(f"reservation of {reservation.key!r} is not outstanding")
            del self._key_to_reservation[reservation.key]
            self._index.add(reservation.key, 1, (reservation.slot_id, reservation.shape))
            self._add_pins(reservation.key, kind, num_pins)
        self._counters.add("puts")

    def cancel(self, reservation: Reservation) -> None:
        """Give back a reservation that will not be filled (the transfer failed); a
        reservation that is no longer outstanding is ignored."""
        with self._lock:
            if self._key_to_reservation.get(reservation.key) is reservation:
                del self._key_to_reservation[reservation.key]
                self._free_slot_ids.append(reservation.slot_id)

    def put(self, key: str, chunk: KVChunk) -> None:
        if chunk.layout != self.layout:
            raise ValueError(f"cpu tier stores layout {self.layout!r}, got {chunk.layout!r}")
        reservation = self.reserve(key, tuple(chunk.tensor.shape))
        if reservation is None:
            return
        try:
            reservation.buffer.copy_(chunk.tensor)
        except Exception:
            self.cancel(reservation)
            raise
        self.publish(reservation)

    def put_encoded(self, key: str, data: bytes) -> None:
        self.put(key, decode_chunk(data, key=key))

    def delete(self, key: str) -> bool:
        """Remove ``key`` unless a reader holds a pin on it (its view must stay valid)."""
        with self._lock:
            entry = self._index.get(key, touch=False)
            if entry is None or entry.num_pins > 0:
                return False
            self._free_slot_ids.append(self._index.remove(key).record[0])
            return True

    # keys comes from SlabTierMixin


def _page_aligned_slab(
    num_slots: int, slot_numel: int, dtype: torch.dtype, *, pin_memory: bool
) -> torch.Tensor:
    """``[num_slots, slot_numel]`` of ``dtype`` starting on a page boundary. Pinned memory is
    page-aligned already; plain memory is allocated one page larger and offset, so that the
    disk tier writes and reads slots with O_DIRECT (it falls back to buffered I/O, a
    kernel copy through the page cache, for memory that is not block-aligned)."""
    if pin_memory:
        return torch.empty((num_slots, slot_numel), dtype=dtype, pin_memory=True)
    element_size = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(num_slots * slot_numel * element_size + _PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE_BYTES
    return raw[start : start + num_slots * slot_numel * element_size].view(dtype).view(num_slots, slot_numel)
