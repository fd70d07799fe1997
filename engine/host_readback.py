"""Small device results that the host reads every step (sampled token ids, draft
verdicts), moved into pinned memory by a kernel instead of a copy engine.

A device-to-host `copy_` runs on a copy engine, and copies of one direction queue
there behind each other whatever their streams: with the connector saving a step's KV
to the CPU tier (1 GiB for 8,192 tokens of an 8B model, ~20 ms), the step's sampled
ids waited behind those saves on the H100 while the GPU idled, and 0%-hit throughput
lost ~4%. `kernels.zero_copy.copy_to_host` writes them from a kernel on the step's own
stream instead.

The model runner owns one `HostReadback` (CUDA only) and calls `queue` once per step
that samples; the step's future reads the values once (`PendingRead.tolist`). Pinned
buffers are reused once read (or once their reader is gone) and their kernel is done.
Not thread-safe.
"""

from __future__ import annotations

import weakref

import torch

from kernels.launch import next_power_of_2
from kernels.zero_copy import copy_to_host

#: smallest buffer: a step's samples of up to this many sequences fit without growing
_MIN_CAPACITY = 256


class _Buffer:
    def __init__(self, dtype: torch.dtype, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=dtype, pin_memory=True)
        self.written: torch.cuda.Event | None = None  # after the last kernel that wrote it


class PendingRead:
    """Values queued by `HostReadback.queue`: `tolist()` waits for their kernel and
    returns them (once; the buffer then goes back to the pool)."""

    def __init__(self, buffer: _Buffer, num_elements: int, shape: torch.Size, release) -> None:
        self._buffer = buffer
        self._num_elements = num_elements
        self._shape = shape
        self._values: list | None = None
        self._release = weakref.finalize(self, release, buffer)

    def tolist(self) -> list:
        if self._values is None:
            self._buffer.written.synchronize()
            self._values = self._buffer.host[: self._num_elements].view(self._shape).tolist()
            self._release()
        return self._values


class HostReadback:
    """A pool of pinned buffers that kernels write a step's small results into."""

    def __init__(self) -> None:
        self._free: list[_Buffer] = []

    def queue(self, values: torch.Tensor) -> PendingRead:
        """Queue on the current stream the write of ``values`` (a small CUDA tensor) into
        a pinned buffer -> the read to finish later. Never waits for the device."""
        values = values.contiguous()
        num_elements = values.numel()
        buffer = self._take(values.dtype, num_elements)
        copy_to_host(values.view(-1), buffer.host[:num_elements])
        buffer.written = torch.cuda.Event()
        buffer.written.record()
        return PendingRead(buffer, num_elements, values.shape, self._free.append)

    def read(self, values: torch.Tensor) -> list:
        """``values.tolist()`` without a copy engine: waits for the values' kernel only."""
        return self.queue(values).tolist()

    def _take(self, dtype: torch.dtype, num_elements: int) -> _Buffer:
        for index, buffer in enumerate(self._free):
            # a buffer whose last write may still be pending on another stream is skipped
            written = buffer.written
            if (
                buffer.host.dtype == dtype
                and buffer.host.numel() >= num_elements
                and (written is None or written.query())
            ):
                return self._free.pop(index)
        return _Buffer(dtype, next_power_of_2(max(num_elements, _MIN_CAPACITY)))
