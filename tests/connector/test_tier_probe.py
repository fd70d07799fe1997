"""The tier prober measures what a fetch gets: reads into memory that is faulted in already
(a fetch's CPU-tier slots), not a new buffer per measurement (issue 31: page faults made the
planner believe the cache server delivered half of what fetches got)."""

from __future__ import annotations

import threading

import torch

from connector.planner import LoadPlanner
from connector.tier_probe import TierProber
from connector.token_db import KV_LAYOUT
from engine.step_time import StepTimeModel
from storage_backends import create_backend

CHUNK_SHAPE = (2, 2, 16, 2, 8)


class RecordingTier:
    """A ``cpu://`` tier (named as a remote) whose ``get_into`` records the buffers it fills."""

    name = "grpc"

    def __init__(self) -> None:
        self.backend = create_backend("cpu://?capacity=1048576&slot_bytes=4096")
        self.lock = threading.Lock()
        #: every buffer filled, in order (kept alive: no two are the same memory by accident)
        self.buffers: list[torch.Tensor] = []

    def put(self, key, chunk):
        self.backend.put(key, chunk)

    def get_into(self, key, out):
        with self.lock:
            self.buffers.append(out)
        return self.backend.get_into(key, out)

    def delete(self, key):
        return self.backend.delete(key)


def make_prober(tier: RecordingTier, connections: int = 4) -> tuple[TierProber, LoadPlanner]:
    planner = LoadPlanner(bytes_per_token=1024, step_times=StepTimeModel())
    prober = TierProber(
        planner,
        {tier.name: tier},
        key="ns:probe",
        chunk_shape=CHUNK_SHAPE,
        dtype=torch.float32,
        layout=KV_LAYOUT,
        connections=connections,
        interval_s=3600.0,
    )
    return prober, planner


def test_measurements_read_into_buffers_kept_from_one_to_the_next():
    tier = RecordingTier()
    prober, planner = make_prober(tier, connections=4)
    prober.start()
    prober._thread.join(timeout=0.5)  # its loop waits for the interval after the opening measurement
    assert prober.tier_to_num_probes == {"grpc": 1}
    opening = [id(buffer) for buffer in tier.buffers]
    # one read, then four at once, each into a buffer of its own (the first one twice)
    assert len(opening) == 5 and len(set(opening)) == 4 and opening.count(opening[0]) == 2
    kept = tier.buffers[0]
    tier.buffers.clear()
    for _ in range(3):
        assert prober.probe("grpc", full=False)
    # later measurements read one chunk, always into the buffer kept from the opening one
    assert len(tier.buffers) == 6 and all(buffer is kept for buffer in tier.buffers)
    assert planner.tier_rate("grpc", 1) > 0
    prober.close()
