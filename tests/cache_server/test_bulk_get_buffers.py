"""Gets of 32 MiB values into new buffers reuse dropped ones instead of faulting in new memory
each time, and never one a caller still holds (issue 16)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from storage_backends import create_backend
from storage_backends.chunk import decode_chunk

MIB = 1 << 20
#: a fresh 32 MiB buffer costs 8,193 faults of 4 KiB pages; a reused one none of its own
MAX_FAULTS_OF_A_REUSED_BUFFER = 1000


@pytest.fixture(scope="module")
def backend():
    server = CacheServerProcess("--memory-gb", "0.25").start()
    backend = create_backend(server.url)
    for seed in (1, 2):
        backend.put_encoded(f"big/{seed}", make_value(seed, 32 * MIB, key=f"big/{seed}"))
    yield backend
    backend.close()
    server.close()


def minor_faults() -> int:
    with open("/proc/self/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def test_repeated_gets_of_a_32_mib_value_fault_in_no_new_memory(backend) -> None:
    value = make_value(1, 32 * MIB, key="big/1")
    assert bytes(backend.get_encoded("big/1")) == value  # the pool's first buffer, dropped at once
    before = minor_faults()
    again = backend.get_encoded("big/1")
    faults = minor_faults() - before
    assert bytes(again) == value
    assert faults < MAX_FAULTS_OF_A_REUSED_BUFFER, f"{faults} minor faults for one Get"


def test_a_chunk_still_held_keeps_its_bytes_while_later_gets_reuse_dropped_buffers(backend) -> None:
    expected = {
        seed: decode_chunk(make_value(seed, 32 * MIB, key=f"big/{seed}"), key=f"big/{seed}").tensor
        for seed in (1, 2)
    }
    held = backend.get("big/1")
    for _ in range(3):  # each lands in a buffer other than the held chunk's
        other = backend.get("big/2")
        assert torch.equal(other.tensor, expected[2])
        del other
    assert torch.equal(held.tensor, expected[1])
    view_of_held = held.tensor[0, 1]  # a view outlives the chunk object
    del held
    backend.get("big/2")
    assert torch.equal(view_of_held, expected[1][0, 1])
    del view_of_held
    before = minor_faults()
    chunk = backend.get("big/1")
    faults = minor_faults() - before
    assert torch.equal(chunk.tensor, expected[1])
    assert faults < MAX_FAULTS_OF_A_REUSED_BUFFER, f"{faults} minor faults for one Get"
