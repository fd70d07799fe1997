"""The cache server's memory tier: serialized chunks kept as ``bytes``, LRU under a byte cap.

The engine-side CPU tier (``cpu://``) holds tensors in a slab, so serving
bytes from it would decode every Put and re-encode every Get (about 40 ms for a
32 MiB chunk). The server only moves bytes, so this tier stores them as they
arrived (after verifying header and checksum) and hands the same object back:
a Get costs no copy and no checksum. It implements the full
:class:`~storage_backends.base.StorageBackend` interface, the tensor methods by
encoding and decoding.

Thread-safe (one lock); called from the server's worker threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from storage_backends.base import CapacityError, StorageBackend
from storage_backends.chunk import KVChunk, decode_chunk, encode_chunk, verify_chunk
from storage_backends.counters import Counters
from storage_backends.lru import LRUIndex


class EncodedMemoryTier(StorageBackend):
    """Bytes in a dict, total length capped at ``capacity_bytes``; evicts least recently used."""

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"memory tier capacity must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self._index = LRUIndex(capacity_bytes)  # record: the value's bytes
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
        """Verify then store; ValueError for a corrupt value or one larger than the whole tier."""
        verify_chunk(data, key=key)
        self.put_verified(key, bytes(data))

    def put_verified(self, key: str, data: bytes | memoryview) -> None:
        """Store a value the caller has verified and hands over (it must never change again).

        The cache server's Put verifies while the pieces arrive, so a second pass would only cost time.
        ValueError for a value larger than the whole tier; CapacityError when pins leave no room.
        """
        if len(data) > self.capacity_bytes:
            raise ValueError(
                f"value of {len(data)} bytes exceeds the memory tier's {self.capacity_bytes} bytes"
            )
        with self._lock:
            old = self._index.remove(key)
            victim_keys = self._index.victims_for(len(data))
            if victim_keys is None:
                if old is not None:
                    self._index.add(key, old.size, old.record, old.num_pins)
                self._counters.add("rejected")
                raise CapacityError(f"memory tier: no room for {len(data)} bytes; the rest is pinned")
            for victim_key in victim_keys:
                self._index.remove(victim_key)
            self._index.add(key, len(data), data, old.num_pins if old is not None else 0)
        self._counters.add("evictions", len(victim_keys))
        self._counters.add("puts")

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

    def stats(self) -> dict[str, Any]:
        with self._lock:
            gauges = {
                "num_keys": len(self._index),
                "bytes_used": self._index.used,
                "capacity_bytes": self.capacity_bytes,
            }
        return {**gauges, **self._counters.snapshot()}

    def close(self) -> None:
        with self._lock:
            for key, _ in self._index.items():
                self._index.remove(key)
