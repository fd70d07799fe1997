"""Moves KV between the engine's paged KV tensor and host chunks.

One :class:`KVMover` per connector (per KV tensor). On CUDA it owns two
streams and two device staging buffers of half a chunk each (a chunk's layers
split in two pieces, contiguous in the ``[layers, 2, tokens, heads, head_dim]``
layout). A load copies piece i host→device on the copy stream while the
kernel stream unpacks piece i-1 into the paged cache; a store packs piece i
on the kernel stream while the copy stream moves piece i-1 device→host into
its pinned destination. Events order each buffer's reuse after its previous
use, so the PCIe copies run back to back and the kernels hide behind them.
Slot values are validated once on the host by the caller (the cache engine),
so the kernels run without their per-call device sync.

On CPU the pure-torch references do the same moves synchronously.
"""

from __future__ import annotations

import math

import torch


class KVMover:
    """Called by the cache engine for every chunk it stores or retrieves; never
    changes the paged cache outside the given slots (slot -1 = leave untouched)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        chunk_shape: tuple[int, ...],  # [num_layers, 2, chunk_size, num_kv_heads, head_dim]
    ) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda:
            import kernels  # Triton kernels; imported only where a GPU moves data

            self._pack, self._unpack = kernels.pack_kv, kernels.unpack_kv
            self._unpack_layer = kernels.unpack_kv_layer
            self.kernel_stream = torch.cuda.Stream(self.device)  # pack/unpack kernels, slot maps
            self.copy_stream = torch.cuda.Stream(self.device)  # host <-> device copies
            self.layers_per_piece = (chunk_shape[0] + 1) // 2
            piece_numel = self.layers_per_piece * math.prod(chunk_shape[1:])
            self._buffers = [torch.empty(piece_numel, dtype=dtype, device=self.device) for _ in range(2)]
            # event after which buffer i may be overwritten (its last reader or writer is done)
            self._buffer_free: list[torch.cuda.Event | None] = [None, None]
            self._next_buffer = 0
        else:
            from kernels import reference

            self._pack, self._unpack = reference.pack_kv_ref, reference.unpack_kv_ref
            self._unpack_layer = reference.unpack_kv_layer_ref

    def _take_buffer(self, stream: torch.cuda.Stream, shape: torch.Size) -> tuple[int, torch.Tensor]:
        """The next staging buffer as a tensor of ``shape``, with ``stream`` ordered after its last use."""
        index = self._next_buffer
        self._next_buffer ^= 1
        free = self._buffer_free[index]
        if free is not None:
            stream.wait_event(free)
        return index, self._buffers[index][: math.prod(shape)].view(shape)

    def _layer_pieces(self, num_layers: int) -> list[tuple[int, int]]:
        step = self.layers_per_piece
        return [(first, min(first + step, num_layers)) for first in range(0, num_layers, step)]

    def load(
        self,
        chunk: torch.Tensor,  # host [num_layers, 2, num_tokens, num_kv_heads, head_dim] (pinned on CUDA)
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens] on kv_cache's device, -1 = skip
        layer: int | None = None,
    ) -> None:
        """Write ``chunk`` (or only its layer ``layer``) into the paged slots.
        Asynchronous on CUDA: keep ``chunk`` alive until :meth:`synchronize`."""
        if not self.on_cuda:
            if layer is None:
                self._unpack(chunk, kv_cache, slot_mapping)
            else:
                self._unpack_layer(chunk[layer], kv_cache[layer], slot_mapping)
            return
        pieces = [(layer, layer + 1)] if layer is not None else self._layer_pieces(chunk.shape[0])
        for first, last in pieces:
            source = chunk[first] if layer is not None else chunk[first:last]
            index, staged = self._take_buffer(self.copy_stream, source.shape)
            with torch.cuda.stream(self.copy_stream):
                staged.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
            self.kernel_stream.wait_event(copied)
            with torch.cuda.stream(self.kernel_stream):
                if layer is None:
                    self._unpack(staged, kv_cache[first:last], slot_mapping, check_values=False)
                else:
                    self._unpack_layer(staged, kv_cache[layer], slot_mapping, check_values=False)
            unpacked = torch.cuda.Event()
            unpacked.record(self.kernel_stream)
            self._buffer_free[index] = unpacked

    def store(
        self,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens] on kv_cache's device, all valid
        out: torch.Tensor,  # host [num_layers, 2, num_tokens, num_kv_heads, head_dim] (pinned on CUDA)
    ) -> None:
        """Copy the tokens at ``slot_mapping`` into ``out``. Asynchronous on CUDA."""
        if not self.on_cuda:
            self._pack(kv_cache, slot_mapping, out)
            return
        for first, last in self._layer_pieces(out.shape[0]):
            target = out[first:last]
            index, staged = self._take_buffer(self.kernel_stream, target.shape)
            with torch.cuda.stream(self.kernel_stream):
                self._pack(kv_cache[first:last], slot_mapping, staged, check_values=False)
            packed = torch.cuda.Event()
            packed.record(self.kernel_stream)
            self.copy_stream.wait_event(packed)
            with torch.cuda.stream(self.copy_stream):
                target.copy_(staged, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
            self._buffer_free[index] = copied

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy a small host tensor (slot maps) to the device on the kernel stream, so
        the kernels that read it are ordered after the copy and its memory belongs to that stream."""
        if not self.on_cuda:
            return tensor
        with torch.cuda.stream(self.kernel_stream):
            return tensor.to(self.device, non_blocking=True)

    def wait_for_compute(self) -> None:
        """Order the next kernels after everything the compute stream queued so far
        (KV written by the forward pass, earlier reads of reused blocks)."""
        if self.on_cuda:
            self.kernel_stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self, timing: bool = False) -> torch.cuda.Event | None:
        """An event marking the loads queued so far (None on CPU, where moves are done)."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self.kernel_stream)
        return event

    def record_start(self) -> torch.cuda.Event:
        """A timing event before the next load's first copy (CUDA only)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.copy_stream)
        return event

    def synchronize(self) -> None:
        """Block the host until every queued move has finished."""
        if self.on_cuda:
            self.copy_stream.synchronize()
            self.kernel_stream.synchronize()
