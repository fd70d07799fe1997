"""CUDA loads of a step's chunks through device staging buffers, a group of chunks at a time.

A staged load used to cost the host one copy, two events and one unpack launch per
chunk and per piece of layers, ~0.2-0.3 ms each: 64 of them for an 8k-token hit of an
8B model, so on the H100 the host spent as long queueing a hit's loads (14-19 ms) as
the copies took, and the forward pass, queued after them, started only once the last
copy had landed (no overlap of the first layers with the later ones' copies).

Here the chunks of a piece of layers go in groups: each group's pieces are copied back
to back into one of two staging buffers of `GROUP_BUFFER_BYTES` on the copy stream,
and one launch of `kernels.host_unpack`'s table-driven kernel (which reads the staged
device copies) scatters the whole group into the paged cache on the kernel stream. The
tables of every group of the step go to the device in one copy, made while the first
group's copies run (before the first unpack, which needs them). The
two buffers alternate: a group's copies wait for the unpack that last read its buffer.

Used by `transfer.KVMover.load_chunks` on CUDA (one call per step with loads); owns
the staging buffers of the mover's load lane. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: bytes of one staging buffer (two are kept): a group holds as many chunks' pieces as fit
GROUP_BUFFER_BYTES = 64 << 20
#: programs per unpack launch: it reads device memory, so more than host_unpack's 16 for PCIe
NUM_UNPACK_PROGRAMS = 264
#: staged pieces start at multiples of this many bytes (the kernel reads 16-byte vectors)
_ALIGN_BYTES = 16


class _Group:
    """Pieces of layers [first, last) of consecutive chunks of the step, from `start_chunk`."""

    def __init__(self, buffer_index: int, first: int, last: int, start_chunk: int) -> None:
        self.buffer_index = buffer_index
        self.first, self.last = first, last
        self.start_chunk = start_chunk
        self.num_chunks = 0
        self.offsets: list[int] = []  # element offsets into the staging buffer, one per chunk
        self.num_elements = 0


class GroupedStaging:
    """Two device staging buffers and the order of their reuse."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_chunk_tokens: int) -> None:
        self._device = device
        self._dtype = dtype
        # the unpack kernel is compiled per tile count: one for every step, the chunk size's
        # (a step's largest chunk would compile a new kernel for each shorter length met)
        self._max_chunk_tokens = max_chunk_tokens
        self._element_bytes = torch.empty(0, dtype=dtype).element_size()
        self._buffers: list[torch.Tensor | None] = [None, None]
        # event after which buffer i may be overwritten (the unpack that read it is done)
        self._buffer_free: list[torch.cuda.Event | None] = [None, None]
        self._next_buffer = 0

    def load(
        self,
        kernel_stream: torch.cuda.Stream,
        copy_stream: torch.cuda.Stream,
        to_device: Callable[[torch.Tensor], torch.Tensor],
        chunks: Sequence[torch.Tensor],  # host [num_layers, 2, num_tokens_i, heads, dim], pinned
        slot_mappings: Sequence[torch.Tensor],  # int64 [num_tokens_i] on the device
        kv_cache: torch.Tensor,
        layer_ranges: Sequence[tuple[int, int]],
    ) -> list[torch.cuda.Event]:
        """Queue every chunk's layers, range by range -> per range an event recorded once
        that range of every chunk is in the cache. `to_device` copies the tables (on the
        kernel stream). Keep the chunks alive until the loads have finished."""
        from kernels.host_unpack import unpack_kv_from_host

        groups = self._plan(chunks, layer_ranges)
        for group in groups:
            self._ensure_buffer(group.buffer_index, group.num_elements)
        max_tokens = max(self._max_chunk_tokens, *(chunk.shape[2] for chunk in chunks))
        table = None
        events: list[torch.cuda.Event] = []
        position = 0
        for index, group in enumerate(groups):
            buffer = self._buffers[group.buffer_index]
            free = self._buffer_free[group.buffer_index]
            if free is not None:
                copy_stream.wait_event(free)
            with torch.cuda.stream(copy_stream):
                group_chunks = chunks[group.start_chunk : group.start_chunk + group.num_chunks]
                for chunk, offset in zip(group_chunks, group.offsets, strict=True):
                    source = chunk[group.first : group.last]
                    buffer[offset : offset + source.numel()].view(source.shape).copy_(
                        source, non_blocking=True
                    )
            copied = torch.cuda.Event()
            copied.record(copy_stream)
            if table is None:
                # Made while the first group's copies run: the unpacks need the tables, the
                # copies do not (a hit's first copy starts ~0.5 ms sooner on the H100).
                table = to_device(self._tables(groups, slot_mappings, chunks))
            kernel_stream.wait_event(copied)
            with torch.cuda.stream(kernel_stream):
                unpack_kv_from_host(
                    table[position : position + 3 * group.num_chunks].view(3, group.num_chunks),
                    kv_cache,
                    max_tokens,
                    (group.first, group.last),
                    num_programs=NUM_UNPACK_PROGRAMS,
                    chunks_hold_only_these_layers=True,
                )
            position += 3 * group.num_chunks
            unpacked = torch.cuda.Event()
            unpacked.record(kernel_stream)
            self._buffer_free[group.buffer_index] = unpacked
            last_of_range = index + 1 == len(groups) or groups[index + 1].first != group.first
            if last_of_range:
                events.append(unpacked)
        return events

    def _plan(self, chunks: Sequence[torch.Tensor], layer_ranges: Sequence[tuple[int, int]]) -> list[_Group]:
        """Groups of chunk pieces, range by range, each filling at most one buffer (sizes
        only: the pieces are sliced when copied, so the first copy is queued sooner)."""
        capacity = GROUP_BUFFER_BYTES // self._element_bytes
        align = max(1, _ALIGN_BYTES // self._element_bytes)
        layer_numels = [chunk.numel() // chunk.shape[0] for chunk in chunks]
        groups: list[_Group] = []
        for first, last in layer_ranges:
            group = None
            for chunk_index, layer_numel in enumerate(layer_numels):
                size = -(-layer_numel * (last - first) // align) * align
                if group is None or (group.num_chunks and group.num_elements + size > capacity):
                    group = _Group(self._next_buffer, first, last, chunk_index)
                    self._next_buffer ^= 1
                    groups.append(group)
                group.num_chunks += 1
                group.offsets.append(group.num_elements)
                group.num_elements += size
        return groups

    def _tables(
        self, groups: Sequence[_Group], slot_mappings: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Every group's ``[3, num_chunks]`` table (staged address, slot map address, token
        count: the rows of `kernels.host_unpack.chunk_table`), one after the other."""
        slot_addresses = [slots.data_ptr() for slots in slot_mappings]
        num_tokens = [chunk.shape[2] for chunk in chunks]
        flat: list[int] = []
        for group in groups:
            base = self._buffers[group.buffer_index].data_ptr()
            start, end = group.start_chunk, group.start_chunk + group.num_chunks
            flat += [base + offset * self._element_bytes for offset in group.offsets]
            flat += slot_addresses[start:end]
            flat += num_tokens[start:end]
        return torch.tensor(flat, dtype=torch.int64)

    def _ensure_buffer(self, index: int, num_elements: int) -> None:
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < num_elements:
            if buffer is not None and self._buffer_free[index] is not None:
                self._buffer_free[index].synchronize()  # its last reader is done before it goes
            self._buffers[index] = torch.empty(
                max(num_elements, GROUP_BUFFER_BYTES // self._element_bytes),
                dtype=self._dtype,
                device=self._device,
            )
