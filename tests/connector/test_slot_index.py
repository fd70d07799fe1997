"""connector.slot_index: the CPU tier's index without its memory. A stateful property
test drives random reserves, publishes, cancels, pins, unpins and deletes against a plain
model of the rules: a slot is never given to two live chunks, a pinned key is never
evicted or deleted, a reservation is invisible until published and publishes only once,
and the index never holds more than its slots."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from connector.slot_index import PinKind, SlotIndex
from storage_backends.base import CapacityError

NUM_SLOTS = 4
KEYS = [f"k{i}" for i in range(7)]
SHAPE = (2, 2, 8, 1, 4)


class SlotIndexRules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = SlotIndex(NUM_SLOTS)
        self.key_to_pins: dict[str, dict[PinKind, int]] = {}  # published keys the model knows
        self.reservations = []

    def _num_pins(self, key: str) -> int:
        return sum(self.key_to_pins.get(key, {}).values())

    def _live_keys(self) -> set[str]:
        return {key for key in KEYS if self.index.present([key])[0]}

    @rule(key=st.sampled_from(KEYS))
    def reserve(self, key: str) -> None:
        pinned_before = {k for k in self._live_keys() if self._num_pins(k) > 0}
        known = key in self._live_keys() or any(r.key == key for r in self.reservations)
        try:
            reservation = self.index.reserve(key, SHAPE)
        except CapacityError:
            # only when every indexed key is pinned and the reservations fill the rest
            assert len(pinned_before) + len(self.reservations) == NUM_SLOTS
            return
        if known:
            assert reservation is None
            return
        assert reservation is not None and not self.index.present([key])[0]
        self.reservations.append(reservation)
        # an eviction never takes a pinned key
        assert pinned_before <= self._live_keys()
        for evicted in set(self.key_to_pins) - self._live_keys():
            assert self._num_pins(evicted) == 0
            del self.key_to_pins[evicted]

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), num_pins=st.integers(0, 2))
    def publish(self, data, num_pins: int) -> None:
        reservation = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        self.index.publish(reservation, num_pins=num_pins, kind=PinKind.FETCH)
        self.key_to_pins[reservation.key] = {PinKind.FETCH: num_pins} if num_pins else {}
        assert self.index.present([reservation.key])[0]
        with pytest.raises(ValueError, match="not outstanding"):
            self.index.publish(reservation)  # publishes once

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        reservation = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        self.index.cancel(reservation)
        self.index.cancel(reservation)  # a second cancel is ignored
        assert not self.index.present([reservation.key])[0]

    @rule(key=st.sampled_from(KEYS), kind=st.sampled_from(list(PinKind)))
    def pin(self, key: str, kind: PinKind) -> None:
        present = key in self._live_keys()
        assert self.index.pin([key], kind) == int(present)
        if present:
            pins = self.key_to_pins.setdefault(key, {})
            pins[kind] = pins.get(kind, 0) + 1

    @rule(key=st.sampled_from(KEYS), kind=st.sampled_from(list(PinKind)))
    def unpin(self, key: str, kind: PinKind) -> None:
        self.index.unpin([key], kind)  # another kind's pins stay
        pins = self.key_to_pins.get(key, {})
        if pins.get(kind, 0) > 0:
            pins[kind] -= 1

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: str) -> None:
        present = key in self._live_keys()
        deleted = self.index.delete(key)
        assert deleted == (present and self._num_pins(key) == 0)
        if deleted:
            del self.key_to_pins[key]

    @invariant()
    def slots_are_never_shared(self) -> None:
        live = self._live_keys()
        assert live == set(self.key_to_pins)
        slot_ids = [self.index.find(key)[0] for key in live] + [r.slot_id for r in self.reservations]
        assert len(slot_ids) == len(set(slot_ids)) <= NUM_SLOTS
        assert all(0 <= slot_id < NUM_SLOTS for slot_id in slot_ids)
        counts = self.index.pin_counts()
        for kind in PinKind:
            expected = sum(pins.get(kind, 0) for pins in self.key_to_pins.values())
            assert counts.get(kind.value, 0) == expected
        gauges = self.index.gauges()
        assert gauges["num_keys"] == len(live)
        assert gauges["num_used_slots"] == len(live) + len(self.reservations)


TestSlotIndexRules = SlotIndexRules.TestCase
TestSlotIndexRules.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_contains_counts_the_leading_keys_and_refreshes_them():
    index = SlotIndex(2)
    for key in ("a", "b"):
        index.publish(index.reserve(key, SHAPE))
    assert index.contains(["a", "b", "c"]) == 2 and index.contains(["c", "a"]) == 0
    assert index.contains(["a"]) == 1  # "a" is now the most recently used: "b" goes first
    index.publish(index.reserve("c", SHAPE))
    assert index.present(["a", "b", "c"]) == [True, False, True]


def test_a_full_index_of_pinned_keys_refuses_a_reservation():
    index = SlotIndex(1)
    index.publish(index.reserve("a", SHAPE), num_pins=1, kind=PinKind.READ)
    with pytest.raises(CapacityError, match="pinned or being written"):
        index.reserve("b", SHAPE)
    assert index.counters.snapshot()["rejected"] == 1
    index.unpin(["a"], PinKind.LOOKUP)  # another kind's pin: "a" stays pinned
    with pytest.raises(CapacityError):
        index.reserve("b", SHAPE)
    index.unpin(["a"], PinKind.READ)
    assert index.reserve("b", SHAPE) is not None and index.present(["a"]) == [False]


def test_a_slot_index_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        SlotIndex(0)
