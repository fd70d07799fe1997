"""storage_backends.write_gate: background writes wait while the engine holds the gate
(issue 23), and a hold always ends. The disk tier's writers wait at it between their
system calls; the gate is real (threads and a real disk tier), no clocks are faked."""

from __future__ import annotations

import os
import threading
import time

import pytest

from storage_backends.disk_backend import DiskBackend
from storage_backends.write_gate import WriteGate
from tests.storage_backends.helpers import aligned_copy, make_chunk
from tests.waiting import wait_until

#: bound on waits that only a hang would reach
HANG_S = 30.0


def test_an_open_gate_lets_writers_through_and_a_held_one_stops_them_until_released():
    gate = WriteGate()
    gate.wait_open()  # open: returns at once
    assert not gate.is_held
    gate.hold(HANG_S)
    assert gate.is_held
    passed = threading.Event()
    writer = threading.Thread(target=lambda: (gate.wait_open(), passed.set()), daemon=True)
    writer.start()
    assert wait_until(lambda: gate.num_waiting == 1, HANG_S)
    assert not passed.is_set()
    gate.release()
    assert passed.wait(HANG_S)
    assert not gate.is_held and gate.num_waiting == 0


def test_a_hold_that_is_never_released_ends_by_itself():
    gate = WriteGate()
    gate.hold(0.05)
    began = time.monotonic()
    gate.wait_open()  # returns at the hold's end, not never
    assert time.monotonic() - began < HANG_S
    assert not gate.is_held


def test_a_shorter_hold_does_not_cut_a_longer_one():
    gate = WriteGate()
    gate.hold(HANG_S)
    gate.hold(0.001)
    time.sleep(0.01)
    assert gate.is_held
    gate.release()
    assert not gate.is_held


@pytest.mark.parametrize("seconds", [0, -1.0])
def test_a_hold_needs_a_positive_duration(seconds):
    with pytest.raises(ValueError, match="positive"):
        WriteGate().hold(seconds)


def chunk_files(root) -> list[str]:
    return [name for name in os.listdir(root) if name.endswith(".kvc")]


def test_the_disk_tiers_writes_wait_at_a_held_gate_and_finish_after_its_release(tmp_path):
    disk = DiskBackend(str(tmp_path), 64 << 20)
    gate = WriteGate()
    disk.write_gate = gate
    items = [(f"key-{i}", aligned_copy(make_chunk(i))) for i in range(6)]
    gate.hold(HANG_S)
    writer = threading.Thread(target=disk.put_many, args=(items,), daemon=True)
    writer.start()
    assert wait_until(lambda: gate.num_waiting >= 1, HANG_S)
    assert chunk_files(tmp_path) == [] and disk.contains([key for key, _ in items]) == 0
    gate.release()
    writer.join(HANG_S)
    assert not writer.is_alive()
    assert disk.contains([key for key, _ in items]) == len(items)
    assert len(chunk_files(tmp_path)) == len(items)
    assert all(disk.get(key) is not None for key, _ in items)


def test_the_tier_manager_hands_its_gate_to_the_disk_tier(tmp_path):
    import torch

    from connector.config import OffloadConfig
    from connector.tiers import TierManager

    config = OffloadConfig(cpu_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=16 << 20)
    tiers = TierManager.from_config(config, (2, 2, 16, 2, 8), torch.bfloat16, pin_memory=False)
    try:
        (disk,) = tiers.lower
        assert disk.write_gate is tiers.write_gate
    finally:
        tiers.close()
