"""Which chunk each slot of the CPU tier holds: the tier's index, with no tensors.

The CPU tier (``connector.cpu_tier``) is a slab of equal slots, one chunk each. This
module is its bookkeeping alone: key -> (slot id, chunk shape), recency for LRU
eviction, pins counted per kind (:class:`PinKind`), and reservations (a slot being
filled, invisible until published). It touches no memory, so the side that decides
(the connector's scheduler side: lookups, what a load may read, what stays pinned for
a waiting request) can hold it apart from the side that holds the bytes; see
docs/architecture.md, "The connector contract".

Rules: a pinned key is never evicted nor deleted; a reserved slot takes room but is
not readable; publishing goes by the reservation's identity, never by key, so a second
writer of the same key can never publish a slot another copy is still filling; a key is
indexed at most once. Thread-safe (one lock; every method holds it briefly): in a
connector the scheduler side changes it (``connector.slot_grants``: saves', fetches' and
loads' slots and pins; deferred loads' pins), but the producer's direct exporter pins from
the server's threads, the slab's growing thread adds slots and the lookups' threads read it.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from storage_backends.base import CapacityError
from storage_backends.counters import Counters
from storage_backends.lru import LRUIndex


class PinKind(str, enum.Enum):
    """Who holds a pin: each kind is taken and released on its own, so one holder can
    never release another's pin, and ``pin_counts`` shows which kind keeps a slot."""

    LOOKUP = "lookup"  # an admitted request's chunks, until its load is planned (or a timeout)
    READ = "read"  # a load reading the slot's zero-copy view
    WRITE_THROUGH = "write_through"  # a write to the lower tiers reading the slot
    FETCH = "fetch"  # a request waiting on its background fetch
    DEFERRED = "deferred"  # an admitted request's CPU-tier chunks a step's time cap left for later steps
    EXPORT = "export"  # a producer's chunks a consumer reads directly (connector.direct_export)


@dataclass(frozen=True, eq=False)
class SlotReservation:
    """One slot reserved for ``key`` (:meth:`SlotIndex.reserve`), to publish or cancel.
    Compared by identity: two reservations of one key are never the same."""

    key: str
    slot_id: int
    shape: tuple[int, ...]


class SlotIndex:
    """Byte-free LRU index of ``num_slots`` equal slots, with pins per kind."""

    def __init__(self, num_slots: int, num_ready_slots: int | None = None) -> None:
        """``num_ready_slots`` (default all): how many of the first slots have memory now;
        :meth:`add_ready_slots` makes the others usable as their memory arrives."""
        if num_slots <= 0:
            raise ValueError(f"a slot index needs at least one slot, got {num_slots}")
        num_ready_slots = num_slots if num_ready_slots is None else num_ready_slots
        if not 0 < num_ready_slots <= num_slots:
            raise ValueError(f"num_ready_slots must be in [1, {num_slots}], got {num_ready_slots}")
        self.num_slots = num_slots
        #: slots with memory behind them (the CPU tier's slab may still be growing)
        self.num_ready_slots = num_ready_slots
        self._free_slot_ids = list(range(num_ready_slots - 1, -1, -1))
        self._index = LRUIndex(num_ready_slots)  # size unit: slots; record: (slot_id, shape)
        self._key_to_reservation: dict[str, SlotReservation] = {}
        self._key_to_pin_kinds: dict[str, Counter[PinKind]] = {}
        self._lock = threading.Lock()
        #: hits, misses, puts, evictions, rejected (the tier's stats)
        self.counters = Counters()
        #: told ``("stored" | "removed", keys)`` after a key becomes readable or goes (the
        #: engine's KV events); called outside the lock, on the thread that made the change
        self.on_change: Callable[[str, list[str]], None] | None = None

    def _changed(self, kind: str, keys: list[str]) -> None:
        if keys and self.on_change is not None:
            self.on_change(kind, keys)

    # ---- questions -------------------------------------------------------------
    def contains(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are indexed (stops at the first absent one); each
        one found becomes the most recently used."""
        with self._lock:
            num_present = 0
            for key in keys:
                if self._index.get(key) is None:
                    break
                num_present += 1
            return num_present

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is indexed."""
        with self._lock:
            return [key in self._index for key in keys]

    def find(self, key: str) -> tuple[int, tuple[int, ...]] | None:
        """``(slot_id, shape)`` of ``key`` (now the most recently used), or None; counts a
        hit or a miss. The slot stays ``key``'s only while a pin holds it."""
        with self._lock:
            entry = self._index.get(key)
        self.counters.add("hits" if entry is not None else "misses")
        return None if entry is None else entry.record

    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return [key for key, _ in self._index.items() if key.startswith(prefix)]

    # ---- pins ------------------------------------------------------------------
    def pin_and_find(self, keys: Sequence[str], kind: PinKind) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Pin every indexed key once (``kind``) and return its ``(slot_id, shape)``, under
        one lock; absent keys are skipped (and counted as misses)."""
        key_to_record = {}
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                if entry is not None:
                    self._add_pins(key, kind, 1)
                    key_to_record[key] = entry.record
        self.counters.add("hits", len(key_to_record))
        self.counters.add("misses", len(keys) - len(key_to_record))
        return key_to_record

    def pin(self, keys: Sequence[str], kind: PinKind = PinKind.LOOKUP) -> int:
        """Pin the leading indexed ``keys`` (stops at the first absent one); returns how many."""
        with self._lock:
            num_pinned = 0
            for key in keys:
                if key not in self._index:
                    break
                self._add_pins(key, kind, 1)
                num_pinned += 1
            return num_pinned

    def pin_each(self, keys: Sequence[str], kind: PinKind = PinKind.LOOKUP) -> list[bool]:
        """Pin each indexed key (absent ones are skipped, not a stop); one lock for all."""
        with self._lock:
            pinned = []
            for key in keys:
                present = key in self._index
                if present:
                    self._add_pins(key, kind, 1)
                pinned.append(present)
            return pinned

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
        self._index.get(key, touch=False).num_pins += count

    def pin_counts(self) -> dict[str, int]:
        """Pins held now, per kind (``lookup``, ``read``, ``write_through``, ``fetch``, ``deferred``)."""
        with self._lock:
            totals: Counter[str] = Counter()
            for kinds in self._key_to_pin_kinds.values():
                for kind, count in kinds.items():
                    totals[kind.value] += count
            return dict(totals)

    # ---- writes ----------------------------------------------------------------
    def reserve(self, key: str, shape: tuple[int, ...]) -> SlotReservation | None:
        """A slot for the chunk stored under ``key``, invisible until :meth:`publish`.

        Evicts least-recently-used unpinned chunks. Returns None when ``key`` is already
        indexed or reserved (same key, same KV: nothing to do; an indexed key becomes the
        most recently used). Raises ``CapacityError`` when pinned chunks and reservations
        leave no room."""
        with self._lock:
            if key in self._index or key in self._key_to_reservation:
                self._index.get(key)
                return None
            if not self._free_slot_ids:
                # Reserved slots are outside the index but take capacity all the same.
                victim_keys = self._index.victims_for(1 + len(self._key_to_reservation))
                if victim_keys is None:
                    self.counters.add("rejected")
                    raise CapacityError(
                        f"cpu tier: all {self.num_ready_slots} slots ready (of {self.num_slots}) are pinned "
                        "or being written"
                    )
                for victim_key in victim_keys:
                    self._free_slot_ids.append(self._index.remove(victim_key).record[0])
                self.counters.add("evictions", len(victim_keys))
            else:
                victim_keys = []
            reservation = SlotReservation(key, self._free_slot_ids.pop(), tuple(shape))
            self._key_to_reservation[key] = reservation
        self._changed("removed", victim_keys)
        return reservation

    def publish(
        self, reservation: SlotReservation, *, num_pins: int = 0, kind: PinKind = PinKind.WRITE_THROUGH
    ) -> None:
        """Make a filled reservation readable (most recently used), holding ``num_pins``
        pins of ``kind`` taken under the same lock, so no concurrent reservation can evict
        it first. ``ValueError`` for a reservation that is not outstanding."""
        with self._lock:
            if self._key_to_reservation.get(reservation.key) is not reservation:
                raise ValueError(f"reservation of {reservation.key!r} is not outstanding")
            del self._key_to_reservation[reservation.key]
            self._index.add(reservation.key, 1, (reservation.slot_id, reservation.shape))
            self._add_pins(reservation.key, kind, num_pins)
        self.counters.add("puts")
        self._changed("stored", [reservation.key])

    def cancel(self, reservation: SlotReservation) -> None:
        """Give back a reservation that will not be filled; one that is no longer
        outstanding is ignored."""
        with self._lock:
            if self._key_to_reservation.get(reservation.key) is reservation:
                del self._key_to_reservation[reservation.key]
                self._free_slot_ids.append(reservation.slot_id)

    def delete(self, key: str) -> bool:
        """Remove ``key`` unless a pin holds it (a reader's view must stay valid)."""
        with self._lock:
            entry = self._index.get(key, touch=False)
            if entry is None or entry.num_pins > 0:
                return False
            self._free_slot_ids.append(self._index.remove(key).record[0])
        self._changed("removed", [key])
        return True

    def add_ready_slots(self, num_slots: int) -> None:
        """The next ``num_slots`` slots got their memory (the CPU tier's slab grew): they
        are free from now on. Called by the tier's growing thread."""
        with self._lock:
            first = self.num_ready_slots
            if num_slots <= 0 or first + num_slots > self.num_slots:
                raise ValueError(f"cannot add {num_slots} ready slots to {first} of {self.num_slots}")
            self.num_ready_slots += num_slots
            self._index.capacity += num_slots
            # behind the slots free now (reserve pops from the end)
            self._free_slot_ids[:0] = range(first + num_slots - 1, first - 1, -1)

    def gauges(self) -> dict[str, Any]:
        """How full the index is: keys, slots used (reserved ones included) and pinned keys."""
        with self._lock:
            return {
                "num_keys": len(self._index),
                "num_used_slots": self.num_ready_slots - len(self._free_slot_ids),
                "num_pinned": self._index.num_pinned(),
            }
