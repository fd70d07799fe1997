"""The CPU tier's slab grows in pieces after the engine is ready (connector.cpu_tier):
stores before a piece arrives are not kept, the tier serves meanwhile, and every piece's
slots hold their own chunks. Plain memory here; the pinning step is injected."""

from __future__ import annotations

import threading

import torch

from connector.cpu_tier import PinnedChunkPool, _page_aligned_slab
from storage_backends import KVChunk

CHUNK_SHAPE = (2, 2, 8, 2, 4)  # [layers, K/V, chunk_size, heads, head_dim]
SLOT_BYTES = 2 * 2 * 8 * 2 * 4 * 4


def chunk(value: float, num_tokens: int = 8) -> KVChunk:
    return KVChunk(torch.full((2, 2, num_tokens, 2, 4), value))


class GatedAllocator:
    """Allocates plain memory; every piece after the first waits for ``gate`` (a slow
    pinning step), and it records the piece sizes asked for."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.num_slots_asked: list[int] = []

    def __call__(self, num_slots, slot_numel, dtype, pin_memory):
        if self.num_slots_asked:
            assert self.gate.wait(30)
        self.num_slots_asked.append(num_slots)
        return _page_aligned_slab(num_slots, slot_numel, dtype, pin_memory)


def growing_pool(allocator, num_slots=7, slots_per_piece=3) -> PinnedChunkPool:
    return PinnedChunkPool(
        num_slots * SLOT_BYTES,
        CHUNK_SHAPE,
        torch.float32,
        pin_memory=False,
        layout="LKTHD",
        grow_in_background=True,
        allocate_piece=allocator,
        piece_bytes=slots_per_piece * SLOT_BYTES,
    )


def test_the_tier_serves_from_its_first_piece_while_the_rest_is_allocated():
    allocator = GatedAllocator()
    tier = growing_pool(allocator)
    assert allocator.num_slots_asked == [3] and tier.allocation_s is None
    assert tier.stats()["ready_bytes"] == 3 * SLOT_BYTES and tier.stats()["capacity_bytes"] == 7 * SLOT_BYTES
    tier.start_growing()  # the next piece waits at the gate: the tier still serves its first
    for index in range(5):
        tier.put(f"k{index}", chunk(float(index)))
    # three slots are ready: the two oldest stores were not kept
    assert tier.contains(["k0"]) == 0 and tier.contains(["k1"]) == 0
    assert torch.equal(tier.get("k4").tensor, chunk(4.0).tensor)
    allocator.gate.set()
    assert tier.wait_grown(30)
    assert allocator.num_slots_asked == [3, 3, 1]
    assert tier.stats()["ready_bytes"] == 7 * SLOT_BYTES and tier.allocation_s >= 0
    for index in range(5, 11):
        tier.put(f"k{index}", chunk(float(index)))
    kept = [f"k{index}" for index in range(4, 11)]  # the 7 newest, across the three pieces
    assert all(tier.contains([key]) == 1 for key in kept)
    for key in kept:
        assert torch.equal(tier.get(key).tensor, chunk(float(key[1:])).tensor)
    assert tier.get("k3") is None
    tier.close()


def test_without_background_growth_every_piece_is_there_at_once():
    allocator = GatedAllocator()
    allocator.gate.set()
    tier = growing_pool(allocator)  # the constructor asks for every piece
    assert allocator.num_slots_asked == [3]
    tier = PinnedChunkPool(
        7 * SLOT_BYTES,
        CHUNK_SHAPE,
        torch.float32,
        pin_memory=False,
        layout="LKTHD",
        allocate_piece=allocator,
        piece_bytes=3 * SLOT_BYTES,
    )
    assert allocator.num_slots_asked == [3, 3, 3, 1]
    assert tier.stats()["ready_bytes"] == 7 * SLOT_BYTES and tier.wait_grown(0)
    for index in range(7):
        tier.put(f"k{index}", chunk(float(index), num_tokens=5))  # partial chunks too
    assert all(torch.equal(tier.get(f"k{i}").tensor, chunk(float(i), 5).tensor) for i in range(7))


def test_a_host_out_of_memory_stops_the_growth_and_keeps_what_there_is():
    calls = []

    def allocator(num_slots, slot_numel, dtype, pin_memory):
        calls.append(num_slots)
        if len(calls) > 2:
            raise RuntimeError("cudaHostAlloc: out of memory")
        return _page_aligned_slab(num_slots, slot_numel, dtype, pin_memory)

    tier = growing_pool(allocator)
    tier.start_growing()
    assert tier.wait_grown(30)
    assert tier.stats()["ready_bytes"] == 6 * SLOT_BYTES
    for index in range(8):
        tier.put(f"k{index}", chunk(float(index)))
    assert sum(tier.contains([f"k{index}"]) for index in range(8)) == 6
