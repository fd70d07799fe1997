"""PrivateWriteBuffers: host buffers of chunks on their way to the lower tiers, bounded in
bytes alive; a buffer counts until its tensor is dropped."""

from __future__ import annotations

import gc

import pytest
import torch

from connector.write_buffers import PrivateWriteBuffers

SHAPE = (2, 2, 8, 2, 4)  # 256 float32 values: 1 KiB
NUM_BYTES = 1024


def test_buffers_past_the_budget_are_refused_until_one_is_dropped():
    buffers = PrivateWriteBuffers(2 * NUM_BYTES)
    first = buffers.take(SHAPE, torch.float32, pin_memory=False)
    second = buffers.take(SHAPE, torch.float32, pin_memory=False)
    assert first.shape == SHAPE and first.dtype == torch.float32
    assert buffers.num_bytes == 2 * NUM_BYTES
    assert buffers.take(SHAPE, torch.float32, pin_memory=False) is None
    assert buffers.num_refused == 1
    view = first[0]  # a view keeps the tensor's storage, not the tensor object
    del first, view
    gc.collect()
    assert buffers.num_bytes == NUM_BYTES
    third = buffers.take(SHAPE, torch.float32, pin_memory=False)
    assert third is not None and buffers.num_bytes == 2 * NUM_BYTES
    del second, third
    gc.collect()
    assert buffers.num_bytes == 0 and buffers.peak_bytes == 2 * NUM_BYTES


def test_a_budget_under_one_chunk_still_lets_one_buffer_live():
    buffers = PrivateWriteBuffers(NUM_BYTES // 2)
    only = buffers.take(SHAPE, torch.float32, pin_memory=False)
    assert only is not None and buffers.num_bytes == NUM_BYTES
    assert buffers.take(SHAPE, torch.float32, pin_memory=False) is None
    del only
    gc.collect()
    assert buffers.take(SHAPE, torch.float32, pin_memory=False) is not None


def test_a_failed_allocation_gives_its_bytes_back():
    buffers = PrivateWriteBuffers(1 << 40)
    with pytest.raises(RuntimeError):
        buffers.take((1 << 40,), torch.float32, pin_memory=False)  # 4 TiB: the allocator refuses
    assert buffers.num_bytes == 0


@pytest.mark.parametrize("max_bytes", [-1, 1.5, True, "1"])
def test_a_budget_must_be_a_byte_count(max_bytes):
    with pytest.raises(ValueError, match="max_bytes"):
        PrivateWriteBuffers(max_bytes)
