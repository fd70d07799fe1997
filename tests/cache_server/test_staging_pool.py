"""The bulk server's pool of staging areas of ended connections (``cache_server.staging_pool``):
an area goes only to the same tenant, the smallest that fits, and never more than the pool's
bytes are kept (the rest is freed: descriptor closed, room released)."""

from __future__ import annotations

import os

import pytest

from cache_server.memory_tier import EncodedMemoryTier
from cache_server.staging_pool import HeldArea, StagingAreaPool
from storage_backends.staging_area import create_sealed_area, staging_supported

MIB = 1 << 20
pytestmark = pytest.mark.skipif(not staging_supported(), reason="needs memfd_create and file seals")


def held_area(tier: EncodedMemoryTier, num_bytes: int) -> HeldArea:
    fd, area = create_sealed_area(num_bytes)
    return HeldArea(fd, area, tier.reserve("<area>", num_bytes))


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_an_area_goes_back_only_to_its_tenant_and_the_smallest_that_fits() -> None:
    tier = EncodedMemoryTier(64 * MIB)
    pool = StagingAreaPool(max_spare_bytes=16 * MIB)
    small, large, other = held_area(tier, MIB), held_area(tier, 4 * MIB), held_area(tier, 2 * MIB)
    pool.keep("a", large)
    pool.keep("a", small)
    pool.keep("b", other)
    assert pool.num_spare_bytes == 7 * MIB
    assert tier.reserved_bytes == 0  # kept areas do not hold room in the memory tier
    assert pool.take("c", MIB) is None  # another tenant never gets them
    assert pool.take("a", 5 * MIB) is None  # none large enough
    assert pool.take("a", MIB // 2) is small  # the smallest that fits
    assert pool.take("a", MIB // 2) is large
    assert pool.take("a", 1) is None
    assert pool.take("b", 2 * MIB) is other
    for held in (small, large, other):
        assert is_open(held.fd)
        held.free()
    assert tier.reserved_bytes == 0


def test_areas_beyond_the_pools_bytes_and_after_close_are_freed() -> None:
    tier = EncodedMemoryTier(64 * MIB)
    pool = StagingAreaPool(max_spare_bytes=5 * MIB)
    kept, extra = held_area(tier, 4 * MIB), held_area(tier, 2 * MIB)
    pool.keep("a", kept)
    pool.keep("a", extra)  # 6 MiB > 5: freed at once
    assert not is_open(extra.fd) and pool.num_spare_bytes == 4 * MIB
    assert tier.reserved_bytes == 0
    pool.close()
    assert not is_open(kept.fd) and tier.reserved_bytes == 0
    late = held_area(tier, MIB)
    pool.keep("a", late)  # a connection that ends while the server stops
    assert not is_open(late.fd) and tier.reserved_bytes == 0
