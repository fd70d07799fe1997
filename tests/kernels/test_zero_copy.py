"""kernels.zero_copy: small device tensors written into host memory by a kernel.

On CPU the kernel runs through Triton's interpreter on ordinary CPU tensors; on CUDA it
writes pinned memory through its device mapping, and must not wait behind the copy
engine's queue (the reason it exists)."""

from __future__ import annotations

import pytest
import torch

from kernels.zero_copy import copy_to_host


@pytest.mark.parametrize("num_elements", [1, 7, 256, 1500])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32])
def test_values_arrive_unchanged(interpreted, num_elements, dtype):
    generator = torch.Generator().manual_seed(num_elements)
    source = torch.randint(-(2**40), 2**40, (num_elements,), generator=generator).to(dtype)
    host = torch.zeros(num_elements, dtype=dtype)
    copy_to_host(source, host)
    assert torch.equal(host, source)


def test_elements_past_the_source_are_left_alone(interpreted):
    host = torch.full((10,), -1, dtype=torch.int64)
    copy_to_host(torch.arange(3), host[:3])
    assert host.tolist() == [0, 1, 2] + [-1] * 7


@pytest.mark.parametrize(
    ("source", "host", "message"),
    [
        (
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int32),
            "int64 but host is torch.int32",
        ),
        (torch.zeros(4, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), "4 elements but host 5"),
        (torch.zeros(4, 2, dtype=torch.int64).t(), torch.zeros(8, dtype=torch.int64), "contiguous"),
    ],
)
def test_mismatches_are_refused(interpreted, source, host, message):
    with pytest.raises(ValueError, match=message):
        copy_to_host(source, host)


@pytest.mark.gpu
def test_gpu_write_lands_in_pinned_memory_and_pageable_is_refused():
    source = torch.arange(1000, device="cuda") * 3
    host = torch.empty(1000, dtype=torch.int64, pin_memory=True)
    copy_to_host(source, host)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host, source.cpu())
    with pytest.raises(ValueError, match="pinned"):
        copy_to_host(source, torch.empty(1000, dtype=torch.int64))


@pytest.mark.gpu
def test_gpu_write_does_not_queue_behind_a_large_device_to_host_copy():
    """A 1 GiB device->pinned copy queued first on another stream (a connector save) is
    still running when the kernel's values are readable; a `copy_` of the values would
    have waited for it on the copy engine."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big_host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    tokens = torch.arange(64, device="cuda")
    host = torch.empty(64, dtype=torch.int64, pin_memory=True)
    copy_to_host(tokens, host)  # compiled before the clock matters
    host.zero_()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big_host.copy_(big, non_blocking=True)
        big_done = torch.cuda.Event()
        big_done.record()
    copy_to_host(tokens, host)
    written = torch.cuda.Event()
    written.record()
    written.synchronize()
    assert not big_done.query(), "the 1 GiB copy finished first: nothing was shown"
    assert host.tolist() == list(range(64))
    big_done.synchronize()
