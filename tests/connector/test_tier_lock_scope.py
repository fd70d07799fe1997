"""The tier manager and the CPU tier under write-through to a real disk tier (issue 23):
the step's calls do not wait behind a lower tier, and an unpinned CPU tier's slots are
written with O_DIRECT."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from connector.cpu_tier import PinnedChunkPool
from connector.slot_grants import SlotGrants
from connector.tiers import TierManager
from connector.token_db import KV_LAYOUT
from storage_backends.disk_backend import TMP_PREFIX, DiskBackend
from storage_backends.disk_io import BLOCK, O_DIRECT

#: 128 KiB of float32 per chunk: a payload the disk tier places on a block boundary
CHUNK_SHAPE = (2, 2, 1024, 2, 4)
CHUNK_BYTES = 2 * 2 * 1024 * 2 * 4 * 4
#: bound on waits that only a hang would reach (the calls take microseconds)
HANG_S = 30.0


class SlowPinDisk(DiskBackend):
    """The real disk tier whose ``pin`` waits for ``release`` once ``blocking`` is set (a tier
    whose pins are slow: its lock is busy)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.blocking = False
        self.pin_started = threading.Event()
        self.release = threading.Event()

    def pin(self, keys):
        if self.blocking:
            self.pin_started.set()
            self.release.wait(HANG_S)
        return super().pin(keys)


def store(tiers: TierManager, key: str, value: float) -> None:
    """A save as the connector makes it: a slot granted, filled, written through, published."""
    grants = SlotGrants(tiers.cpu.index, write_through=True)
    (slot_id,) = grants.grant_save([key], [CHUNK_SHAPE])
    pending = tiers.begin_put(key, CHUNK_SHAPE, slot_id=slot_id, pin_memory=False)
    pending.buffer.fill_(value)
    tiers.end_put(pending)
    grants.apply_fills([(key, slot_id, True)])


def make_tiers(tmp_path: Path, disk_class=DiskBackend) -> TierManager:
    cpu = PinnedChunkPool(8 * CHUNK_BYTES, CHUNK_SHAPE, torch.float32, pin_memory=False, layout=KV_LAYOUT)
    disk = disk_class(str(tmp_path / "disk"), capacity_bytes=64 << 20)
    return TierManager(cpu, [disk], dtype=torch.float32, save_queue_size=16, pin_timeout_s=600.0)


def test_a_pin_waiting_on_a_lower_tier_does_not_hold_up_other_keys(tmp_path):
    tiers = make_tiers(tmp_path, SlowPinDisk)
    disk = tiers.lower[0]
    try:
        for key, value in (("a", 1.0), ("b", 2.0)):
            store(tiers, key, value)
        tiers.flush()
        tiers.pin(["b"])
        disk.blocking = True
        pinning = threading.Thread(target=tiers.pin, args=(["a"],), daemon=True)
        pinning.start()
        assert disk.pin_started.wait(HANG_S)
        done = threading.Event()
        read: list = []

        def step() -> None:  # what plan_load does with "b" meanwhile
            tiers.unpin(["b"])
            got = tiers.get_prefix(["b"], cpu_only=True)
            read.extend(got.chunks)
            tiers.release(got.held_keys)
            done.set()

        threading.Thread(target=step, daemon=True).start()
        finished = done.wait(HANG_S)
        disk.release.set()
        pinning.join(HANG_S)
        assert finished, "unpin/get_prefix of another key waited for a lower tier's pin"
        assert len(read) == 1 and bool((read[0].tensor == 2.0).all())
        assert tiers.num_pinned() == 1  # "a" pinned once its tier answered
    finally:
        disk.release.set()
        tiers.close()


def test_unpinned_cpu_tier_slots_are_written_through_with_o_direct(tmp_path, monkeypatch):
    """Plain (unpinned) CPU-tier memory is page-aligned like pinned memory, so the disk tier
    writes its slots straight from them (O_DIRECT) instead of copying them through the page
    cache (a kernel copy per chunk, and its pages' writeback, on the machine's cores)."""
    tiers = make_tiers(tmp_path)
    try:
        if not tiers.lower[0].direct_io:
            pytest.skip("this file system refuses O_DIRECT")
        tmp_file_flags: list[int] = []
        real_open = os.open

        def recording_open(path, flags, *args, **kwargs):
            if os.path.basename(os.fspath(path)).startswith(TMP_PREFIX):
                tmp_file_flags.append(flags)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", recording_open)
        for index in range(3):
            store(tiers, f"k{index}", float(index))
        tiers.flush()
        assert len(tmp_file_flags) == 3
        assert all(flags & O_DIRECT for flags in tmp_file_flags)
        for index in range(3):
            tiers.cpu.pin([f"k{index}"])
            assert tiers.cpu.get(f"k{index}").tensor.data_ptr() % BLOCK == 0
        monkeypatch.undo()
        assert all(bool((tiers.lower[0].get(f"k{index}").tensor == index).all()) for index in range(3))
    finally:
        tiers.close()
