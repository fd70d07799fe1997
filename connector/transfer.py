"""Moves KV between the engine's paged KV tensor and host chunks.

One :class:`KVMover` per connector (per KV tensor). On CUDA it owns two lanes,
one for loads and one for stores, so a step's loads never queue behind earlier
steps' saves still draining to the host (PCIe moves both directions at once).
Each lane has a kernel stream, a copy stream and two device staging buffers of
half a chunk each (a chunk's layers split in two pieces, contiguous in the
``[layers, 2, tokens, heads, head_dim]`` layout). A load copies piece i
host→device on its copy stream while its kernel stream unpacks piece i-1 into
the paged cache; a store packs piece i on its kernel stream while its copy
stream moves piece i-1 device→host into its pinned destination. Events order
each buffer's reuse after its previous use, so the PCIe copies run back to back
and the kernels hide behind them. A step's loads (`load_chunks`) go through
`connector.staged_loads` instead: the same two streams, but a group of chunks
per batch of copies and per unpack launch, which cuts the host's cost of
queueing them. Slot values are validated once on the host by the caller (the
cache engine), so the kernels run without their per-call device sync.

On CPU the pure-torch references do the same moves, synchronously; or, with
``cpu_worker_thread``, on one worker thread in queue order, with events that
complete when the thread gets there: the asynchronous publish and load paths the
cache engine and the worker side run on CUDA then run the same way on a CPU (CI).
"""

from __future__ import annotations

import math
from concurrent.futures import Future

import torch

from connector.staged_loads import GroupedStaging
from storage_backends.thread_pools import started_thread_pool


class ThreadEvent:
    """The CPU stand-in for a CUDA event: done once the mover's worker thread ran every
    move queued before it."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        self._future.result()


class _Lane:
    """Streams and staging buffers of one direction (CUDA only)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, piece_numel: int) -> None:
        self.kernel_stream = torch.cuda.Stream(device)  # pack/unpack kernels, slot maps
        self.copy_stream = torch.cuda.Stream(device)  # host <-> device copies
        self._device, self._dtype, self._piece_numel = device, dtype, piece_numel
        # allocated at first use: a step's loads go through `staged_loads` instead
        self._buffers: list[torch.Tensor] | None = None
        # event after which buffer i may be overwritten (its last reader or writer is done)
        self.buffer_free: list[torch.cuda.Event | None] = [None, None]
        self._next_buffer = 0

    def take_buffer(self, stream: torch.cuda.Stream, shape: torch.Size) -> tuple[int, torch.Tensor]:
        """The next staging buffer as a tensor of ``shape``, with ``stream`` ordered after its last use."""
        if self._buffers is None:
            self._buffers = [
                torch.empty(self._piece_numel, dtype=self._dtype, device=self._device) for _ in range(2)
            ]
        index = self._next_buffer
        self._next_buffer ^= 1
        free = self.buffer_free[index]
        if free is not None:
            stream.wait_event(free)
        return index, self._buffers[index][: math.prod(shape)].view(shape)

    def synchronize(self) -> None:
        self.copy_stream.synchronize()
        self.kernel_stream.synchronize()


class KVMover:
    """Called by the cache engine for every chunk it stores or retrieves; never
    changes the paged cache outside the given slots (slot -1 = leave untouched)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        chunk_shape: tuple[int, ...],  # [num_layers, 2, chunk_size, num_kv_heads, head_dim]
        *,
        cpu_worker_thread: bool = False,
        direct_host_loads: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        #: CPU moves run on one worker thread (asynchronous, like CUDA copies)
        self.threaded = not self.on_cuda and cpu_worker_thread
        self._worker = started_thread_pool(1, "kvstash-cpu-mover") if self.threaded else None
        if self.on_cuda:
            import kernels  # Triton kernels; imported only where a GPU moves data

            self._pack, self._unpack = kernels.pack_kv, kernels.unpack_kv
            self._unpack_layer = kernels.unpack_kv_layer
            #: loads of pinned chunks read the host memory in the kernel (kernels.host_unpack)
            self.direct_host_loads = direct_host_loads
            self.layers_per_piece = (chunk_shape[0] + 1) // 2
            piece_numel = self.layers_per_piece * math.prod(chunk_shape[1:])
            self.load_lane = _Lane(self.device, dtype, piece_numel)
            self.store_lane = _Lane(self.device, dtype, piece_numel)
            #: a step's staged loads, a group of chunks per copy batch and unpack launch
            self._grouped_loads = GroupedStaging(self.device, dtype, max_chunk_tokens=chunk_shape[2])
        else:
            from kernels import reference

            self._pack, self._unpack = reference.pack_kv_ref, reference.unpack_kv_ref
            self._unpack_layer = reference.unpack_kv_layer_ref
            self.direct_host_loads = False

    def _run(self, move, *args) -> None:
        """A CPU move: now, or queued on the worker thread."""
        if self._worker is None:
            move(*args)
        else:
            self._worker.submit(move, *args)

    def _drain(self) -> None:
        if self._worker is not None:
            self._worker.submit(lambda: None).result()

    def _layer_pieces(self, num_layers: int) -> list[tuple[int, int]]:
        step = self.layers_per_piece
        return [(first, min(first + step, num_layers)) for first in range(0, num_layers, step)]

    def load(
        self,
        chunk: torch.Tensor,  # host [num_layers, 2, num_tokens, num_kv_heads, head_dim] (pinned on CUDA)
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens] on kv_cache's device, -1 = skip
        layer: int | None = None,
        *,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Write ``chunk`` (or only its layer ``layer``, or its layers [first, last)
        ``layers``) into the paged slots.
        Asynchronous on CUDA: keep ``chunk`` alive until :meth:`synchronize`."""
        if layer is not None and layers is not None:
            raise ValueError("give layer or layers, not both")
        if not self.on_cuda:
            if layer is not None:
                self._run(self._unpack_layer, chunk[layer], kv_cache[layer], slot_mapping)
            elif layers is not None:
                first, last = layers
                self._run(self._unpack, chunk[first:last], kv_cache[first:last], slot_mapping)
            else:
                self._run(self._unpack, chunk, kv_cache, slot_mapping)
            return
        lane = self.load_lane
        if layer is not None:
            pieces = [(layer, layer + 1)]
        else:
            begin, end = layers if layers is not None else (0, chunk.shape[0])
            step = self.layers_per_piece
            pieces = [(first, min(first + step, end)) for first in range(begin, end, step)]
        for first, last in pieces:
            source = chunk[first] if layer is not None else chunk[first:last]
            index, staged = lane.take_buffer(lane.copy_stream, source.shape)
            with torch.cuda.stream(lane.copy_stream):
                staged.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(lane.copy_stream)
            lane.kernel_stream.wait_event(copied)
            with torch.cuda.stream(lane.kernel_stream):
                if layer is None:
                    self._unpack(staged, kv_cache[first:last], slot_mapping, check_values=False)
                else:
                    self._unpack_layer(staged, kv_cache[layer], slot_mapping, check_values=False)
            unpacked = torch.cuda.Event()
            unpacked.record(lane.kernel_stream)
            lane.buffer_free[index] = unpacked

    def loads_directly(self, chunks: list[torch.Tensor]) -> bool:
        """Whether `load_chunks` moves these chunks with the direct kernel: on CUDA, with
        ``direct_host_loads``, when every chunk is pinned host memory (CPU-tier slots)
        starting 16-byte aligned."""
        return (
            self.on_cuda
            and self.direct_host_loads
            and all(chunk.is_pinned() and chunk.data_ptr() % 16 == 0 for chunk in chunks)
        )

    def load_chunks(
        self,
        chunks: list[torch.Tensor],  # host [num_layers, 2, num_tokens_i, num_kv_heads, head_dim]
        slot_mappings: list[torch.Tensor],  # int64 [num_tokens_i] on kv_cache's device (`to_device`)
        kv_cache: torch.Tensor,
        layer_ranges: list[tuple[int, int]],
    ) -> list[torch.cuda.Event | None]:
        """Write every chunk into its slots, range of layers by range (in the order given);
        -> per range an event recorded once that range of every chunk is in place (None
        on CPU, where the moves are done or queued on the worker thread in order).

        With ``direct_host_loads``, pinned chunks (see `loads_directly`) go through one
        kernel launch per range that reads them over PCIe; otherwise on CUDA through
        device staging buffers, a group of chunks per copy batch and unpack launch
        (`connector.staged_loads`); on CPU chunk by chunk. Keep
        the chunks alive until :meth:`synchronize_loads`. Called by the cache engine once
        per step with loads (from the worker side's ``start_load_kv``)."""
        if chunks and self.on_cuda and not self.loads_directly(chunks):
            lane = self.load_lane
            return self._grouped_loads.load(
                lane.kernel_stream,
                lane.copy_stream,
                self.to_device,
                chunks,
                slot_mappings,
                kv_cache,
                layer_ranges,
            )
        if not chunks or not self.loads_directly(chunks):
            events = []
            for first, last in layer_ranges:
                for chunk, slots in zip(chunks, slot_mappings, strict=True):
                    self.load(chunk, kv_cache, slots, layers=(first, last))
                events.append(self.record())
            return events
        from kernels.host_unpack import chunk_table, unpack_kv_from_host

        lane = self.load_lane
        table = self.to_device(chunk_table(chunks, slot_mappings))
        max_tokens = max(chunk.shape[2] for chunk in chunks)
        events = []
        with torch.cuda.stream(lane.kernel_stream):
            for first, last in layer_ranges:
                unpack_kv_from_host(table, kv_cache, max_tokens, (first, last))
                events.append(self.record())
        return events

    def store(
        self,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens] on kv_cache's device, all valid
        out: torch.Tensor,  # host [num_layers, 2, num_tokens, num_kv_heads, head_dim] (pinned on CUDA)
    ) -> None:
        """Copy the tokens at ``slot_mapping`` into ``out``. Asynchronous on CUDA."""
        if not self.on_cuda:
            self._run(self._pack, kv_cache, slot_mapping, out)
            return
        lane = self.store_lane
        for first, last in self._layer_pieces(out.shape[0]):
            target = out[first:last]
            index, staged = lane.take_buffer(lane.kernel_stream, target.shape)
            with torch.cuda.stream(lane.kernel_stream):
                self._pack(kv_cache[first:last], slot_mapping, staged, check_values=False)
            packed = torch.cuda.Event()
            packed.record(lane.kernel_stream)
            lane.copy_stream.wait_event(packed)
            with torch.cuda.stream(lane.copy_stream):
                target.copy_(staged, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(lane.copy_stream)
            lane.buffer_free[index] = copied

    def to_device(self, tensor: torch.Tensor, *, for_store: bool = False) -> torch.Tensor:
        """Copy a small host tensor (slot maps) to the device on the kernel stream of the
        loads (or of the stores), so the kernels that read it are ordered after the copy
        and its memory belongs to that stream."""
        if not self.on_cuda:
            return tensor
        lane = self.store_lane if for_store else self.load_lane
        # From pageable memory the copy would first wait for the stream's queued work (the
        # previous saves' copies): a pinned copy (torch's caching host allocator) does not.
        pinned = tensor.pin_memory()
        with torch.cuda.stream(lane.kernel_stream):
            return pinned.to(self.device, non_blocking=True)

    def wait_for_compute(self) -> None:
        """Order the next kernels after everything the compute stream queued so far
        (KV written by the forward pass, earlier reads of reused blocks)."""
        if self.on_cuda:
            compute = torch.cuda.current_stream(self.device)
            self.load_lane.kernel_stream.wait_stream(compute)
            self.store_lane.kernel_stream.wait_stream(compute)

    def record(self, timing: bool = False) -> torch.cuda.Event | None:
        """An event marking the loads queued so far (None on CPU, where moves are done)."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self.load_lane.kernel_stream)
        return event

    def record_stores(self) -> torch.cuda.Event | ThreadEvent:
        """An event after every store queued so far (a store ends with its copy; CUDA or
        a threaded CPU mover)."""
        if self._worker is not None:
            return ThreadEvent(self._worker.submit(lambda: None))
        event = torch.cuda.Event()
        event.record(self.store_lane.copy_stream)
        return event

    def record_start(self, direct: bool = False) -> torch.cuda.Event:
        """A timing event before the next load's first copy (its first kernel when
        ``direct``: that one waits for the compute queued before it). CUDA only."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.load_lane.kernel_stream if direct else self.load_lane.copy_stream)
        return event

    def synchronize_loads(self) -> None:
        """Block the host until every queued load has finished."""
        if self.on_cuda:
            self.load_lane.synchronize()
        self._drain()

    def synchronize(self) -> None:
        """Block the host until every queued move has finished."""
        if self.on_cuda:
            self.load_lane.synchronize()
            self.store_lane.synchronize()
        self._drain()
