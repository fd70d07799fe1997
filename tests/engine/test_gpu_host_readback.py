"""engine.host_readback: a step's sampled ids read through a kernel into pinned buffers
that are reused once read (CUDA only: it exists for the copy engines)."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.host_readback import HostReadback

pytestmark = pytest.mark.gpu


def test_values_and_shapes_come_back():
    readback = HostReadback()
    flat = readback.queue(torch.arange(5, device="cuda"))
    table = readback.queue(torch.tensor([[1, -1], [2, 3]], device="cuda"))
    assert flat.tolist() == [0, 1, 2, 3, 4]
    assert table.tolist() == [[1, -1], [2, 3]]
    assert flat.tolist() == [0, 1, 2, 3, 4]  # read once, kept
    assert readback.read(torch.tensor([True, False], device="cuda")) == [True, False]


def test_a_buffer_is_reused_only_after_its_read():
    readback = HostReadback()
    first = readback.queue(torch.arange(4, device="cuda"))
    second = readback.queue(torch.arange(4, device="cuda") + 10)
    assert first._buffer is not second._buffer  # both unread: two buffers
    assert first.tolist() == [0, 1, 2, 3]
    third = readback.queue(torch.arange(3, device="cuda") + 20)
    assert third._buffer is first._buffer
    assert second.tolist() == [10, 11, 12, 13]  # not overwritten by the third
    assert third.tolist() == [20, 21, 22]


def test_an_unread_read_returns_its_buffer_when_dropped():
    readback = HostReadback()
    dropped = readback.queue(torch.arange(4, device="cuda"))
    buffer = dropped._buffer
    del dropped
    gc.collect()
    torch.cuda.synchronize()
    assert readback.queue(torch.arange(2, device="cuda"))._buffer is buffer


def test_more_values_than_a_buffer_holds_get_a_larger_one():
    readback = HostReadback()
    small = readback.queue(torch.arange(4, device="cuda"))
    small.tolist()
    big = readback.queue(torch.arange(5000, device="cuda"))
    assert big._buffer is not small._buffer
    assert big.tolist() == list(range(5000))
