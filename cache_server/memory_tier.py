"""The cache server's memory tier: serialized chunks kept as ``bytes``, LRU under a byte cap.

The engine-side CPU tier (``cpu://``) holds tensors in a slab, so serving
bytes from it would decode every Put and re-encode every Get (about 40 ms for a
32 MiB chunk). The server only moves bytes, so this tier stores them as they
arrived (after verifying header and checksum) and hands the same object back:
a Get costs no copy and no checksum. It implements the full
:class:`~storage_backends.base.StorageBackend` interface, the tensor methods by
encoding and decoding.

The cap counts what an entry costs the process, not only its value: the value's
bytes, the key's UTF-8 bytes and :data:`ENTRY_OVERHEAD_BYTES` for the Python
objects around them (measured, see there). It also counts values still arriving:
a Put reserves its entry's size (:meth:`EncodedMemoryTier.reserve`) before its
buffer is allocated, evicting as needed, and the reservation turns into the
stored entry or is released when the upload ends in any other way. So stored
values plus uploads in flight stay within the cap.

Thread-safe (one lock); called from the server's worker threads and the bulk
channel's connection threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from storage_backends.base import CapacityError, StorageBackend
from storage_backends.chunk import KVChunk, decode_chunk, encode_chunk, verify_chunk
from storage_backends.counters import Counters
from storage_backends.lru import LRUIndex

#: Process memory per stored entry beyond its value and key bytes: the Python objects of the
#: key, the LRU entry and its OrderedDict and sorted-index slots, the value's buffer object
#: (a bytearray, the memoryview around it) and malloc's rounding (measured when it was a numpy
#: array over torch storage, a larger object: the figure is an upper bound).
#: Measured with ``benchmarks/cache_server_entry_overhead.py`` (RSS growth of a real server
#: per tiny value under a 1 KiB key, less the value and key bytes); see docs/cache_server.md.
ENTRY_OVERHEAD_BYTES = 1536


def entry_size(key: str, num_value_bytes: int) -> int:
    """What one entry counts against the cap: value + key bytes + :data:`ENTRY_OVERHEAD_BYTES`."""
    return num_value_bytes + len(key.encode("utf-8")) + ENTRY_OVERHEAD_BYTES


def num_bytes_held(data: bytes | memoryview) -> int:
    """Bytes of the whole buffer behind ``data``: what keeping ``data`` keeps alive."""
    view = memoryview(data)
    return max(len(view), memoryview(view.obj).nbytes) if view.obj is not None else len(view)


class Reservation:
    """Room held in the memory tier for one value in flight; made by :meth:`EncodedMemoryTier.reserve`.

    The upload that took it either hands it to :meth:`EncodedMemoryTier.put_verified` (the room
    becomes the entry) or calls :meth:`release` (abort, refusal, deadline). Releasing twice,
    or after it was stored, does nothing.
    """

    def __init__(self, tier: EncodedMemoryTier, num_bytes: int) -> None:
        self._tier = tier
        self.num_bytes = num_bytes
        self.held = True

    def release(self) -> None:
        with self._tier._lock:
            self._tier._release_locked(self)


class EncodedMemoryTier(StorageBackend):
    """Bytes in a dict, total length capped at ``capacity_bytes``; evicts least recently used."""

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"memory tier capacity must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        # record: the value's bytes; size: entry_size(); ordered so ListKeys pages cheaply
        self._index = LRUIndex(capacity_bytes, ordered=True)
        #: bytes held by uploads in flight (Reservations not yet stored or released)
        self.reserved_bytes = 0
        self._lock = threading.Lock()
        self._counters = Counters()

    # ---- reads ---------------------------------------------------------------
    def contains(self, keys: Sequence[str]) -> int:
        with self._lock:
            num_present = 0
            for key in keys:
                if self._index.get(key) is None:
                    break
                num_present += 1
            return num_present

    def present(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [self._index.get(key) is not None for key in keys]

    def get_encoded(self, key: str) -> bytes | memoryview | None:
        """The stored bytes (verified when they were put and never changed since, so no copy)."""
        with self._lock:
            entry = self._index.get(key)
        self._counters.add("misses" if entry is None else "hits")
        return None if entry is None else entry.record

    def get(self, key: str) -> KVChunk | None:
        data = self.get_encoded(key)
        return None if data is None else decode_chunk(data, key=key)

    # ---- writes --------------------------------------------------------------
    def put_encoded(self, key: str, data: bytes) -> None:
        """Verify (counted in ``verified``) then store a copy; ValueError for a corrupt value or
        one larger than the whole tier. The cache server never calls it: its Puts and its
        promotions from lower tiers hand over values already verified (:meth:`put_verified`)."""
        verify_chunk(data, key=key)
        self._counters.add("verified")
        self.put_verified(key, bytes(data))

    def put_verified(
        self, key: str, data: bytes | memoryview, reservation: Reservation | None = None
    ) -> None:
        """Store a value the caller has verified and hands over (it must never change again).

        The cache server's Put verifies while the pieces arrive, and a lower tier's
        ``get_encoded`` verifies what it read, so a second pass would only cost time. The entry
        counts against the cap with the whole buffer behind ``data`` (a view's ``obj``: the
        disk tier's read buffer is up to one block longer than the value).
        ``reservation`` (from :meth:`reserve` for this value) becomes the entry's room; it is
        released whatever happens. ValueError for a value larger than the whole tier;
        CapacityError when pins and other uploads in flight leave no room.
        """
        size = entry_size(key, num_bytes_held(data))
        with self._lock:
            if reservation is not None:
                self._release_locked(reservation)
            if size > self.capacity_bytes:
                raise ValueError(
                    f"value of {len(data)} bytes exceeds the memory tier's {self.capacity_bytes} bytes"
                )
            old = self._index.remove(key)
            victim_keys = self._index.victims_for(self.reserved_bytes + size)
            if victim_keys is None:
                if old is not None:
                    self._index.add(key, old.size, old.record, old.num_pins)
                self._counters.add("rejected")
                raise CapacityError(
                    f"memory tier: no room for {size} bytes; the rest is pinned or held by uploads in flight"
                )
            for victim_key in victim_keys:
                self._index.remove(victim_key)
            self._index.add(key, size, data, old.num_pins if old is not None else 0)
        self._counters.add("evictions", len(victim_keys))
        self._counters.add("puts")

    def reserve(self, key: str, num_value_bytes: int) -> Reservation:
        """Hold room for a value of ``num_value_bytes`` under ``key`` before its buffer is allocated,
        evicting least recently used values as needed. CapacityError when stored pins and other
        uploads in flight leave no room (nothing is evicted then)."""
        size = entry_size(key, num_value_bytes)
        with self._lock:
            victim_keys = self._index.victims_for(self.reserved_bytes + size)
            if victim_keys is None:
                self._counters.add("rejected")
                raise CapacityError(
                    f"memory tier: no room for a value of {num_value_bytes} bytes: "
                    f"{self.reserved_bytes} of {self.capacity_bytes} bytes are held by uploads in flight"
                )
            for victim_key in victim_keys:
                self._index.remove(victim_key)
            self.reserved_bytes += size
        self._counters.add("evictions", len(victim_keys))
        return Reservation(self, size)

    def _release_locked(self, reservation: Reservation) -> None:
        if reservation.held:
            reservation.held = False
            self.reserved_bytes -= reservation.num_bytes

    def put(self, key: str, chunk: KVChunk) -> None:
        self.put_encoded(key, encode_chunk(chunk, key=key))

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._index.remove(key) is not None

    # ---- pins ----------------------------------------------------------------
    def pin(self, keys: Sequence[str]) -> int:
        with self._lock:
            return self._index.pin(keys)

    def unpin(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._index.unpin(keys)

    # ---- listing, stats, lifecycle ------------------------------------------
    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return [key for key, _ in self._index.items() if key.startswith(prefix)]

    def keys_page(self, prefix: str, after: str | None, limit: int) -> list[str]:
        with self._lock:
            return self._index.keys_page(prefix, after, limit)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            gauges = {
                "num_keys": len(self._index),
                # stored entries (values, keys and overhead) plus uploads in flight
                "bytes_used": self._index.used + self.reserved_bytes,
                "reserved_bytes": self.reserved_bytes,
                "capacity_bytes": self.capacity_bytes,
            }
        return {**gauges, **self._counters.snapshot()}

    def close(self) -> None:
        with self._lock:
            for key, _ in self._index.items():
                self._index.remove(key)
