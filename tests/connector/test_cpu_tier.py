"""The connector's CPU tier: chunk-shaped slots, reservations, pins and LRU eviction."""

from __future__ import annotations

import pytest
import torch

from connector.cpu_tier import PinnedChunkPool
from storage_backends import CapacityError, KVChunk

CHUNK_SHAPE = (2, 2, 8, 2, 4)  # [layers, K/V, chunk_size, heads, head_dim]
SLOT_BYTES = 2 * 2 * 8 * 2 * 4 * 4


def pool(num_slots: int) -> PinnedChunkPool:
    return PinnedChunkPool(
        num_slots * SLOT_BYTES, CHUNK_SHAPE, torch.float32, pin_memory=False, layout="LKTHD"
    )


def chunk(num_tokens: int = 8, value: float = 1.0) -> KVChunk:
    return KVChunk(torch.full((2, 2, num_tokens, 2, 4), value))


def test_reservations_are_invisible_until_published_and_never_evicted():
    tier = pool(2)
    first = tier.reserve("a", CHUNK_SHAPE)
    tier.reserve("b", CHUNK_SHAPE)
    assert tier.contains(["a"]) == 0 and tier.get("a") is None
    with pytest.raises(CapacityError):
        tier.reserve("c", CHUNK_SHAPE)  # both slots are being written
    first.buffer.fill_(3.0)
    tier.publish(first)
    assert torch.equal(tier.get("a").tensor, torch.full(CHUNK_SHAPE, 3.0))
    assert tier.reserve("c", CHUNK_SHAPE) is not None  # evicts the published "a"
    assert tier.contains(["a"]) == 0
    assert tier.reserve("b", CHUNK_SHAPE) is None  # already reserved: nothing to do


def test_publish_and_cancel_go_by_the_reservation_not_the_key():
    tier = pool(1)
    first = tier.reserve("a", CHUNK_SHAPE)
    tier.cancel(first)
    second = tier.reserve("a", CHUNK_SHAPE)  # the same key reserved again, same slot
    tier.cancel(first)  # stale: ignored, the second reservation stays
    with pytest.raises(ValueError, match="not outstanding"):
        tier.publish(first)
    assert tier.contains(["a"]) == 0
    second.buffer.fill_(4.0)
    tier.publish(second)
    assert torch.equal(tier.get("a").tensor, torch.full(CHUNK_SHAPE, 4.0))


def test_partial_chunks_use_one_slot_and_keep_their_shape():
    tier = pool(1)
    tier.put("tail", chunk(3, 2.0))
    got = tier.get("tail").tensor
    assert got.shape == (2, 2, 3, 2, 4) and bool((got == 2.0).all())
    with pytest.raises(ValueError, match="does not fit a cpu-tier slot"):
        tier.put("big", chunk(9))


def test_pins_protect_views_from_eviction_and_deletion():
    tier = pool(1)
    tier.put("a", chunk(value=1.0))
    assert tier.pin(["a"]) == 1
    view = tier.get("a").tensor
    with pytest.raises(CapacityError):
        tier.put("b", chunk(value=5.0))
    assert not tier.delete("a")
    assert bool((view == 1.0).all())  # the zero-copy view still holds "a"
    tier.unpin(["a"])
    tier.put("b", chunk(value=5.0))
    assert tier.contains(["a"]) == 0 and tier.contains(["b"]) == 1


def test_capacity_smaller_than_one_chunk_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot hold one chunk"):
        PinnedChunkPool(SLOT_BYTES - 1, CHUNK_SHAPE, torch.float32, pin_memory=False, layout="LKTHD")


def test_pins_of_each_kind_are_counted_and_released_on_their_own():
    from connector.slot_index import PinKind

    tier = pool(2)
    tier.put("a", chunk())
    assert tier.pin(["a"]) == 1  # a lookup pin
    assert set(tier.pin_and_get(["a"])) == {"a"}  # a read pin
    assert tier.pin_counts() == {"lookup": 1, "read": 1}
    tier.unpin(["a"], PinKind.FETCH)  # nobody holds a fetch pin: changes nothing
    tier.unpin(["a"], PinKind.READ)
    assert tier.pin_counts() == {"lookup": 1}
    tier.unpin(["a"], PinKind.READ)  # a second read release must not drop the lookup pin
    assert tier.pin_counts() == {"lookup": 1} and not tier.delete("a")
    tier.unpin(["a"])
    assert tier.pin_counts() == {} and tier.stats()["pins_by_kind"] == {} and tier.delete("a")
