"""Receive buffers for new Get values: own mappings for large values, reused only once dropped."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from storage_backends.receive_buffers import (
    HUGE_PAGE_BYTES,
    OWN_MAPPING_BYTES,
    ReceiveBufferPool,
    new_receive_buffer,
)

LARGE = OWN_MAPPING_BYTES + 93  # a 32 MiB payload and a chunk header
MAPPED = -(-LARGE // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES


def address_of(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


def test_a_small_buffer_is_a_bytearray_and_a_large_one_a_mapping_of_whole_huge_pages() -> None:
    small, large = new_receive_buffer(4096), new_receive_buffer(LARGE)
    assert isinstance(small.obj, bytearray) and len(small) == 4096
    assert len(large) == LARGE and not large.readonly
    assert len(large.obj) == MAPPED
    with pytest.raises(ValueError, match="-1 bytes"):
        new_receive_buffer(-1)


@pytest.mark.parametrize(
    "hold",
    [
        lambda view: torch.frombuffer(view, dtype=torch.uint8)[100:200],  # a tensor over a slice
        lambda view: np.frombuffer(view, np.uint8)[5:],  # a numpy view
        lambda view: view[1:2],  # a slice of the memoryview
        lambda view: (ctypes.c_char * 16).from_buffer(view),  # a ctypes array
        lambda view: view.obj,  # the mapping itself
    ],
    ids=["tensor", "numpy", "memoryview", "ctypes", "mapping"],
)
def test_the_pool_never_hands_out_a_buffer_something_still_refers_to(hold) -> None:
    pool = ReceiveBufferPool()
    first = pool.take(LARGE)
    address = address_of(first)
    held = hold(first)
    del first
    second = pool.take(LARGE)
    assert address_of(second) != address
    del held, second
    third = pool.take(LARGE)
    assert address_of(third) == address  # the first kept mapping, idle again
    assert pool.num_new == 2 and pool.num_reused == 1


def test_a_dropped_buffer_is_handed_out_again_and_its_bytes_are_the_new_owners() -> None:
    pool = ReceiveBufferPool()
    first = pool.take(LARGE)
    address = address_of(first)
    first[:4] = b"old!"
    del first
    again = pool.take(OWN_MAPPING_BYTES)  # smaller values fit a kept mapping too
    assert address_of(again) == address and len(again) == OWN_MAPPING_BYTES
    assert pool.num_reused == 1 and pool.num_new == 1


def test_the_pool_keeps_no_more_than_its_byte_cap_and_nothing_after_clear() -> None:
    pool = ReceiveBufferPool(max_kept_bytes=MAPPED)
    first, second = pool.take(LARGE), pool.take(LARGE)
    assert pool.num_kept_bytes == MAPPED  # the second mapping was not kept
    del first, second
    assert pool.take(LARGE) is not None and pool.num_reused == 1
    pool.clear()
    assert pool.num_kept_bytes == 0
    pool.take(LARGE)
    assert pool.num_new == 3
    nothing_kept = ReceiveBufferPool(max_kept_bytes=0)
    view = nothing_kept.take(LARGE)
    del view
    nothing_kept.take(LARGE)
    assert nothing_kept.num_reused == 0 and nothing_kept.num_kept_bytes == 0
    with pytest.raises(ValueError, match="cannot keep -1 bytes"):
        ReceiveBufferPool(max_kept_bytes=-1)


def test_small_values_are_never_pooled() -> None:
    pool = ReceiveBufferPool()
    view = pool.take(OWN_MAPPING_BYTES - 1)
    assert isinstance(view.obj, bytearray)
    assert pool.num_kept_bytes == 0 and pool.num_new == 0
