"""LRU bookkeeping with pins, shared by the bounded tiers (CPU memory and disk).

Not thread-safe by itself: each backend calls it under its own lock.
Sizes are in the backend's unit (slots for the CPU tier, bytes for disk).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList


@dataclass
class LRUEntry:
    """One stored key: its size, pin count and the backend's own record (slot ids, file name)."""

    size: int
    record: Any
    num_pins: int = 0


class LRUIndex:
    """Keys in recency order (oldest first) with a total size that must stay within ``capacity``.

    With ``ordered=True`` the keys are also kept sorted (O(log n) per add and remove), so
    :meth:`keys_page` lists a page in time proportional to the page (the cache server's
    tiers, paged by ``ListKeys``); the engine's CPU tier never lists and leaves it off.
    """

    def __init__(self, capacity: int, *, ordered: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._key_to_entry: OrderedDict[str, LRUEntry] = OrderedDict()
        self._sorted_keys: SortedList | None = SortedList() if ordered else None

    def __len__(self) -> int:
        return len(self._key_to_entry)

    def __contains__(self, key: str) -> bool:
        return key in self._key_to_entry

    def items(self) -> list[tuple[str, LRUEntry]]:
        """(key, entry) pairs, least recent first (a snapshot)."""
        return list(self._key_to_entry.items())

    def num_pinned(self) -> int:
        return sum(1 for entry in self._key_to_entry.values() if entry.num_pins > 0)

    def get(self, key: str, touch: bool = True) -> LRUEntry | None:
        """The entry for ``key`` (made most recent when ``touch``), or None."""
        entry = self._key_to_entry.get(key)
        if entry is not None and touch:
            self._key_to_entry.move_to_end(key)
        return entry

    def add(self, key: str, size: int, record: Any, num_pins: int = 0) -> LRUEntry:
        """Insert ``key`` as most recent. The caller has made room (see :meth:`victims_for`)."""
        if key in self._key_to_entry:
            raise KeyError(f"{key!r} is already indexed; remove it first")
        entry = LRUEntry(size, record, num_pins)
        self._key_to_entry[key] = entry
        self.used += size
        if self._sorted_keys is not None:
            self._sorted_keys.add(key)
        return entry

    def remove(self, key: str) -> LRUEntry | None:
        entry = self._key_to_entry.pop(key, None)
        if entry is not None:
            self.used -= entry.size
            if self._sorted_keys is not None:
                self._sorted_keys.remove(key)
        return entry

    def keys_page(self, prefix: str, after: str | None, limit: int) -> list[str]:
        """Up to ``limit`` keys starting with ``prefix`` and greater than ``after``, in key order.

        O(log n + limit) on an ordered index; an unordered one sorts every key (O(n log n)).
        """
        if self._sorted_keys is None:
            return sorted(
                k for k in self._key_to_entry if k.startswith(prefix) and (after is None or k > after)
            )[:limit]
        # Keys with the prefix form one run of the sorted order, starting at the prefix itself.
        start, exclusive = (after, True) if after is not None and after >= prefix else (prefix, False)
        page: list[str] = []
        for key in self._sorted_keys.irange(minimum=start, inclusive=(not exclusive, True)):
            if len(page) >= limit or not key.startswith(prefix):
                break
            page.append(key)
        return page

    def victims_for(self, size: int) -> list[str] | None:
        """Least-recently-used unpinned keys whose removal frees room for ``size`` more units.

        Side-effect free. Returns None when even evicting every unpinned key is not enough.
        """
        room_needed = self.used + size - self.capacity
        victim_keys: list[str] = []
        for key, entry in self._key_to_entry.items():
            if room_needed <= 0:
                break
            if entry.num_pins == 0:
                victim_keys.append(key)
                room_needed -= entry.size
        return victim_keys if room_needed <= 0 else None

    def pin(self, keys: Sequence[str]) -> int:
        """Pin the leading present keys (stops at the first absent one); returns how many were pinned."""
        num_pinned = 0
        for key in keys:
            entry = self._key_to_entry.get(key)
            if entry is None:
                break
            entry.num_pins += 1
            num_pinned += 1
        return num_pinned

    def unpin(self, keys: Sequence[str]) -> None:
        """Drop one pin from each present, pinned key; absent or unpinned keys are ignored."""
        for key in keys:
            entry = self._key_to_entry.get(key)
            if entry is not None and entry.num_pins > 0:
                entry.num_pins -= 1


class IndexedTierMixin:
    """Contains, pin, unpin and key listing for a tier that keeps an :class:`LRUIndex` in
    ``self._index`` guarded by ``self._lock`` (the CPU and disk backends, the
    connector's CPU tier, the cache server's memory tier). Put it before the tier's
    base class so these methods win over the base's defaults."""

    _lock: Any
    _index: LRUIndex

    def contains(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are present and readable (stops at the first that is not)."""
        with self._lock:
            num_present = 0
            for key in keys:
                entry = self._index.get(key)
                if entry is None or not self._is_readable(entry):
                    break
                num_present += 1
            return num_present

    def _is_readable(self, entry: LRUEntry) -> bool:
        """Whether an indexed entry can be read now (a tier whose writes finish later overrides it)."""
        return True

    def pin(self, keys: Sequence[str]) -> int:
        """Pin the leading present ``keys`` (stops at the first absent one); returns how many."""
        with self._lock:
            return self._index.pin(keys)

    def unpin(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._index.unpin(keys)

    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return [key for key, _ in self._index.items() if key.startswith(prefix)]

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present and readable, under one hold of the lock."""
        with self._lock:
            flags = []
            for key in keys:
                entry = self._index.get(key)
                flags.append(entry is not None and self._is_readable(entry))
            return flags

    def keys_page(self, prefix: str, after: str | None, limit: int) -> list[str]:
        """Readable keys only (a disk file still being written is skipped, as in ``keys``)."""
        with self._lock:
            page: list[str] = []
            while len(page) < limit:
                batch = self._index.keys_page(prefix, after, limit - len(page))
                if not batch:
                    break
                page.extend(key for key in batch if self._is_readable(self._index.get(key, touch=False)))
                after = batch[-1]
            return page


class SlabTierMixin(IndexedTierMixin):
    """Adds ``stats()`` for a tier of ``num_slots`` equal slots of ``slot_bytes`` each
    (``pinned`` when the slab is page-locked), counting events in ``_counters``:
    the storage CPU backend and the connector's CPU tier."""

    num_slots: int
    slot_bytes: int
    pinned: bool
    _counters: Any

    def stats(self) -> dict[str, Any]:
        with self._lock:
            gauges = {
                "num_keys": len(self._index),
                "bytes_used": self._index.used * self.slot_bytes,
                "capacity_bytes": self.num_slots * self.slot_bytes,
                "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "num_pinned": self._index.num_pinned(),
                "pinned_memory": self.pinned,
            }
        return {**gauges, **self._counters.snapshot()}
