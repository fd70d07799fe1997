"""Host buffers for chunks stored without a CPU-tier slot, bounded in bytes.

A chunk the engine stores goes into a CPU-tier slot. When the CPU tier has no room (every
slot pinned by reads or by writes still on their way to the lower tiers) or there is none,
it goes into a private buffer that lives until the write-through has written it below. On a
CUDA engine those buffers are pinned, and torch keeps freed pinned memory cached for later
allocations without ever handing it back: under write pressure (a 16k-token save rate the
disk and a remote could not absorb) the buffers of a queue of 256 chunks plus the batches in
flight pinned ~21 GiB more host memory than the 1.6 GiB CPU tier of an 8B soak, for good.
So private buffers come from here: at most ``max_bytes`` of them alive at a time, and a store
that would exceed it is not written through (counted as a dropped write, like a full queue).

Thread-safe: ``take`` is called on the step thread, buffers die on the write-through thread.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch


class PrivateWriteBuffers:
    """Host buffers for chunks on their way to the lower tiers, ``max_bytes`` of them alive
    at most. A buffer counts until the last reference to its tensor is dropped (the
    write-through wrote it, or its store was aborted): no path has to hand it back.
    One buffer is always allowed when none is alive, so a budget smaller than a chunk
    still writes chunks through, one at a time."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._num_bytes = 0
        #: most bytes alive at once since the start
        self.peak_bytes = 0
        #: buffers refused for the budget
        self.num_refused = 0

    @property
    def num_bytes(self) -> int:
        """Bytes of buffers alive now."""
        with self._lock:
            return self._num_bytes

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool) -> torch.Tensor | None:
        """An uninitialized host tensor of ``shape``, or None when it would take the bytes
        alive past ``max_bytes`` (the caller drops that write)."""
        num_bytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            if self._num_bytes and self._num_bytes + num_bytes > self.max_bytes:
                self.num_refused += 1
                return None
            self._num_bytes += num_bytes
            self.peak_bytes = max(self.peak_bytes, self._num_bytes)
        try:
            buffer = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
        except BaseException:
            self._give_back(num_bytes)
            raise
        weakref.finalize(buffer, self._give_back, num_bytes)
        return buffer

    def _give_back(self, num_bytes: int) -> None:
        with self._lock:
            self._num_bytes -= num_bytes
