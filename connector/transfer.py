"""Moves KV between the engine's paged KV tensor and host chunks.

One :class:`KVMover` per connector (per KV tensor). On CUDA every move runs on
the mover's own stream through one preallocated device staging buffer of one
chunk: a load is one host→device DMA of the pinned chunk plus an
``unpack_kv`` kernel; a store is a ``pack_kv`` kernel plus one device→host DMA
into the pinned destination. Stream order makes reusing the one staging buffer
safe. Slot values are validated once on the host by the caller (the cache
engine), so the kernels run without their per-call device sync.

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
            self._pack_layer, self._unpack_layer = kernels.pack_kv_layer, kernels.unpack_kv_layer
            self._options = {"check_values": False}
            self.stream = torch.cuda.Stream(self.device)
            self._staging = torch.empty(math.prod(chunk_shape), dtype=dtype, device=self.device)  # flat
        else:
            from kernels import reference

            self._pack, self._unpack = reference.pack_kv_ref, reference.unpack_kv_ref
            self._pack_layer, self._unpack_layer = reference.pack_kv_layer_ref, reference.unpack_kv_layer_ref
            self._options = {}
            self.stream = None

    def _staged(self, shape: torch.Size) -> torch.Tensor:
        return self._staging[: math.prod(shape)].view(shape)

    def load(
        self,
        chunk: torch.Tensor,  # host [num_layers, 2, num_tokens, num_kv_heads, head_dim] (pinned on CUDA)
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens] on kv_cache's device, -1 = skip
        layer: int | None = None,
    ) -> None:
        """Write ``chunk`` (or only its layer ``layer``) into the paged slots.
        Asynchronous on CUDA (the caller must keep ``chunk`` alive until :meth:`synchronize`)."""
        if not self.on_cuda:
            if layer is None:
                self._unpack(chunk, kv_cache, slot_mapping)
            else:
                self._unpack_layer(chunk[layer], kv_cache[layer], slot_mapping)
            return
        with torch.cuda.stream(self.stream):
            source = chunk if layer is None else chunk[layer]
            staged = self._staged(source.shape)
            staged.copy_(source, non_blocking=True)
            if layer is None:
                self._unpack(staged, kv_cache, slot_mapping, **self._options)
            else:
                self._unpack_layer(staged, kv_cache[layer], slot_mapping, **self._options)

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
        with torch.cuda.stream(self.stream):
            staged = self._staged(out.shape)
            self._pack(kv_cache, slot_mapping, staged, **self._options)
            out.copy_(staged, non_blocking=True)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy a small host tensor (slot maps) to the device on this mover's stream, so
        the moves that read it are ordered after the copy and its memory belongs to this stream."""
        if not self.on_cuda:
            return tensor
        with torch.cuda.stream(self.stream):
            return tensor.to(self.device, non_blocking=True)

    def wait_for_compute(self) -> None:
        """Order this mover's next moves after everything the compute stream queued so
        far (KV written by the forward pass, earlier reads of reused blocks)."""
        if self.on_cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self) -> torch.cuda.Event | None:
        """An event marking the moves queued so far (None on CPU, where moves are done)."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        """Block the host until every queued move has finished."""
        if self.on_cuda:
            self.stream.synchronize()
