"""The scheduler side's grants of CPU-tier slots (docs/architecture.md, "The connector
contract"): which slot a save or a background fetch fills, which chunks a fetch holds
pinned, and what the worker side's reports of finished copies, reads and write-throughs
change in the tier's index.

Saves: :meth:`grant_save` (``build_connector_meta``, once per save) reserves a slot for
each chunk the CPU tier neither holds nor fills already (``SaveSpec.slot_ids``); the
worker copies the chunk into it and reports the fill; :meth:`apply_fills` publishes it
with a WRITE_THROUGH pin while the worker writes it to the lower tiers, dropped by
:meth:`write_through_done` when a report lists the key in ``written_through``. A store is
visible from the report that says its copy ended (the step's report).

Loads: :meth:`grant_load` (``build_connector_meta``, once per load) READ-pins the chunks
the CPU tier holds and names their slots (``LoadSpec.slot_ids``); :meth:`release_load`
drops those pins when a report lists the load in ``ended_loads``, and hands back what the
load's caller asked to keep with it (the lookup pins of the lower tiers).

The worker side's fetcher (``connector.fetcher``) reads chunks into the slots named in a
:class:`~connector.base.FetchSpec` and reports each read as ``(key, slot_id, ok)``
(``WorkerReport.fills``); it never reserves, publishes or pins. This object does, from the
scheduler side:

- :meth:`grant_fetch` (``build_connector_meta``, once per fetch handed to the worker):
  for each chunk, a FETCH pin when the tier holds it already (:data:`FETCH_IN_CPU`), a
  reserved slot for the fetch to fill, :data:`FETCH_SHARED` when another fetch's read of
  the same key is under way (one read, several waiters), or :data:`FETCH_MISS` (no room,
  or a chunk listed in the CPU tier that has gone);
- :meth:`apply_fills` (``update_connector_output``, before the report's fetch progress):
  a filled slot is published with one FETCH pin per fetch still waiting for it, a failed
  one is given back;
- :meth:`fetch_ended` (a report says a fetch is done): its pins past its ready prefix go;
- :meth:`release_fetch` (its request loaded it, ended or was preempted): its pins go.

A reservation is given back only on its fill's report, so no slot a read may still be
writing is ever given out again. Called from the scheduler's thread only; the index keeps
its own lock, since the lookups' threads and the server's hand-over threads read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from connector.base import (
    FETCH_IN_CPU,
    FETCH_MISS,
    FETCH_SHARED,
    LOAD_NOT_IN_CPU,
    SAVE_NO_CPU,
    SAVE_NO_ROOM,
    SAVE_SKIP,
    FetchSpec,
)
from connector.slot_index import PinKind, SlotIndex, SlotReservation
from storage_backends.base import CapacityError

#: tier name of a chunk the lookup found in the CPU tier (nothing to read: pinned only)
CPU_TIER = "cpu"


@dataclass
class _PendingFill:
    """A slot reserved for one key's read, until the worker reports it."""

    reservation: SlotReservation
    #: fetches that take the chunk once it is published (each gets one FETCH pin)
    waiting_fetch_ids: list[int] = field(default_factory=list)
    #: a save's copy (published with a write-through pin), not a fetch's read
    for_save: bool = False


@dataclass
class _FetchGrant:
    """What one fetch holds: its keys in prompt order and those pinned for it."""

    keys: tuple[str, ...]
    #: keys holding one FETCH pin of this fetch
    pinned_keys: set[str] = field(default_factory=set)


class SlotGrants:
    """The CPU tier's slots as the scheduler side grants them (over the tier's index)."""

    def __init__(self, index: SlotIndex, *, stores_in_cpu: bool = True, write_through: bool = False) -> None:
        """``stores_in_cpu``: saves keep their chunks in the tier (False for a staging area);
        ``write_through``: lower tiers exist, so a saved chunk's slot is read once more by
        its write to them (it is published with a WRITE_THROUGH pin)."""
        self.index = index
        self.stores_in_cpu = stores_in_cpu
        self.write_through = write_through
        #: key -> the reservation its read fills (one read per key at a time)
        self._key_to_pending_fill: dict[str, _PendingFill] = {}
        #: fetch id -> what it holds, from its grant until it is released
        self._fetch_id_to_grant: dict[int, _FetchGrant] = {}
        #: (request id, num_load_start) -> per load so named, oldest first: (its READ-pinned
        #: keys, what its caller keeps with it)
        self._load_id_to_grants: dict[tuple[str, int], list[tuple[list[str], object]]] = {}

    # ---- loads ---------------------------------------------------------------------
    def grant_load(
        self, load_id: tuple[str, int], keys: Sequence[str], keep: object = None
    ) -> tuple[int, ...]:
        """The slot of each of a load's chunks the CPU tier holds, READ-pinned until
        :meth:`release_load` (``LOAD_NOT_IN_CPU`` for the others); ``keep`` comes back
        from that release. ``load_id``: (request id, num_load_start)."""
        key_to_record = self.index.pin_and_find(keys, PinKind.READ)
        self._load_id_to_grants.setdefault(load_id, []).append((list(key_to_record), keep))
        return tuple(key_to_record[key][0] if key in key_to_record else LOAD_NOT_IN_CPU for key in keys)

    def grant_promotions(
        self, keys: Sequence[str], shapes: Sequence[tuple[int, ...]], slot_ids: Sequence[int]
    ) -> tuple[int, ...]:
        """A load that reads lower-tier hits in the step: a slot reserved for each chunk the
        CPU tier does not hold (``slot_ids``, from :meth:`grant_load`) to promote it into,
        published unpinned when its fill is reported; ``LOAD_NOT_IN_CPU`` where none is."""
        if not self.stores_in_cpu:
            return (LOAD_NOT_IN_CPU,) * len(keys)
        promotion_slot_ids = []
        for key, shape, slot_id in zip(keys, shapes, slot_ids, strict=True):
            reservation = None
            # every slot pinned or being filled: the hit is loaded, not kept
            with contextlib.suppress(CapacityError):
                if slot_id == LOAD_NOT_IN_CPU:
                    reservation = self.index.reserve(key, tuple(shape))
            if reservation is None:
                promotion_slot_ids.append(LOAD_NOT_IN_CPU)
                continue
            self._key_to_pending_fill[key] = _PendingFill(reservation)
            promotion_slot_ids.append(reservation.slot_id)
        return tuple(promotion_slot_ids)

    def release_load(self, load_id: tuple[str, int]) -> object:
        """The load ended: drop its READ pins (of its oldest grant under ``load_id``) and
        return its ``keep`` (None for an unknown load)."""
        grants = self._load_id_to_grants.get(load_id)
        if not grants:
            return None
        keys, keep = grants.pop(0)
        if not grants:
            del self._load_id_to_grants[load_id]
        if keys:
            self.index.unpin(keys, PinKind.READ)
        return keep

    def num_granted_loads(self) -> int:
        """Loads whose READ pins are held (tests, gauges)."""
        return sum(len(grants) for grants in self._load_id_to_grants.values())

    # ---- saves ---------------------------------------------------------------------
    def grant_save(self, keys: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        """A slot id per chunk of a save (``SaveSpec.slot_ids``): reserved for its copy, or
        ``SAVE_SKIP`` (held or being filled already), ``SAVE_NO_ROOM`` (every slot pinned or
        being filled: lower tiers only) or ``SAVE_NO_CPU`` (stores skip this tier)."""
        if not self.stores_in_cpu:
            return (SAVE_NO_CPU,) * len(keys)
        slot_ids = []
        for key, shape in zip(keys, shapes, strict=True):
            try:
                reservation = self.index.reserve(key, tuple(shape))
            except CapacityError:
                slot_ids.append(SAVE_NO_ROOM)
                continue
            if reservation is None:
                slot_ids.append(SAVE_SKIP)
                continue
            self._key_to_pending_fill[key] = _PendingFill(reservation, for_save=True)
            slot_ids.append(reservation.slot_id)
        return tuple(slot_ids)

    def write_through_done(self, keys: Sequence[str]) -> None:
        """These saved chunks' writes to the lower tiers ended: their slots may be evicted."""
        if keys:
            self.index.unpin(keys, PinKind.WRITE_THROUGH)

    # ---- fetches -------------------------------------------------------------------
    def grant_fetch(self, spec: FetchSpec) -> FetchSpec:
        """``spec`` with a slot id per chunk (see the module docstring). Called once per
        fetch, when the step's metadata is built."""
        if spec.fetch_id in self._fetch_id_to_grant:
            raise ValueError(f"fetch {spec.fetch_id} was granted already")
        grant = _FetchGrant(tuple(spec.keys))
        self._fetch_id_to_grant[spec.fetch_id] = grant
        slot_ids = []
        for key, shape, tier_name in zip(spec.keys, spec.shapes, spec.tier_names, strict=True):
            pending = self._key_to_pending_fill.get(key)
            if pending is not None and pending.for_save:
                slot_ids.append(FETCH_MISS)  # a save is copying it: not there for this fetch
            elif pending is not None:
                pending.waiting_fetch_ids.append(spec.fetch_id)
                slot_ids.append(FETCH_SHARED)
            elif self.index.pin_each([key], PinKind.FETCH)[0]:
                grant.pinned_keys.add(key)
                slot_ids.append(FETCH_IN_CPU)
            elif tier_name == CPU_TIER:
                slot_ids.append(FETCH_MISS)  # evicted since the lookup
            else:
                slot_ids.append(self._reserve(key, tuple(shape), spec.fetch_id))
        return spec._replace(slot_ids=tuple(slot_ids))

    def _reserve(self, key: str, shape: tuple[int, ...], fetch_id: int) -> int:
        try:
            reservation = self.index.reserve(key, shape)
        except CapacityError:
            return FETCH_MISS  # every slot pinned or being filled: a miss for now
        if reservation is None:
            # a store is filling the key's slot (or published it since): a miss for this fetch
            return FETCH_MISS
        self._key_to_pending_fill[key] = _PendingFill(reservation, [fetch_id])
        return reservation.slot_id

    def apply_fills(self, fills: Sequence[tuple[str, int, bool]]) -> None:
        """The worker side's finished copies and reads ``(key, slot_id, ok)``: publish each
        good one (a save's with its write-through pin, a fetch's with a FETCH pin per fetch
        still waiting for it), give back the others. A fill that matches no outstanding
        reservation (a report replayed) is ignored."""
        for key, slot_id, ok in fills:
            pending = self._key_to_pending_fill.get(key)
            if pending is None or pending.reservation.slot_id != slot_id:
                continue
            del self._key_to_pending_fill[key]
            if not ok:
                self.index.cancel(pending.reservation)
                continue
            if pending.for_save:
                num_pins = int(self.write_through)
                self.index.publish(pending.reservation, num_pins=num_pins, kind=PinKind.WRITE_THROUGH)
                continue
            waiting = [fid for fid in pending.waiting_fetch_ids if fid in self._fetch_id_to_grant]
            self.index.publish(pending.reservation, num_pins=len(waiting), kind=PinKind.FETCH)
            for fetch_id in waiting:
                self._fetch_id_to_grant[fetch_id].pinned_keys.add(key)

    def fetch_ended(self, fetch_id: int, num_ready_chunks: int) -> None:
        """The worker reported the fetch done with ``num_ready_chunks`` leading chunks in:
        its pins on chunks after them go, and reads still running fill the tier for others."""
        grant = self._fetch_id_to_grant.get(fetch_id)
        if grant is None:
            return
        usable = set(grant.keys[:num_ready_chunks])
        self._stop_waiting(fetch_id, grant)
        self._unpin(grant, [key for key in grant.pinned_keys if key not in usable])

    def release_fetch(self, fetch_id: int) -> None:
        """Nobody loads the fetch's chunks any more: every pin it holds goes (a load that
        reads them holds its own pins by then). Unknown ids are ignored."""
        grant = self._fetch_id_to_grant.pop(fetch_id, None)
        if grant is None:
            return
        self._stop_waiting(fetch_id, grant)
        self._unpin(grant, list(grant.pinned_keys))

    def fetch_pinned_keys(self, fetch_id: int) -> set[str]:
        """The keys holding a FETCH pin of ``fetch_id`` (tests, gauges)."""
        grant = self._fetch_id_to_grant.get(fetch_id)
        return set() if grant is None else set(grant.pinned_keys)

    def num_pending_fills(self) -> int:
        """Slots reserved for reads the worker has not reported yet."""
        return len(self._key_to_pending_fill)

    def _stop_waiting(self, fetch_id: int, grant: _FetchGrant) -> None:
        for key in grant.keys:
            pending = self._key_to_pending_fill.get(key)
            if pending is not None and fetch_id in pending.waiting_fetch_ids:
                pending.waiting_fetch_ids.remove(fetch_id)

    def _unpin(self, grant: _FetchGrant, keys: list[str]) -> None:
        if keys:
            grant.pinned_keys.difference_update(keys)
            self.index.unpin(keys, PinKind.FETCH)
