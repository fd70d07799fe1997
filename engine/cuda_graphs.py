"""CUDA graphs for pure-decode steps: the whole forward pass (every layer's GEMMs,
norms, RoPE, cache writes and paged attention) replayed as one graph, so a decode
step costs one launch instead of ~40 per layer.

Used by the model runner only on CUDA, when every scheduled request has exactly one
new token (no speculative drafts), in steps without loads or with loads that need no
per-layer host hooks (the stream waits for them before the replay; saves are queued
after the pass). Other small steps replay engine.mixed_graphs. Captured once at
start-up for batch sizes up to
`max_batch_size`; a step with n sequences replays the smallest captured size >= n,
the extra rows padded (cache write skipped with slot -1, attention over one key).

A step's inputs reach the graph's buffers in one host-to-device copy: the buffers are
views of one device byte buffer, written on the host into a pinned mirror of it (the
padding rows too), so a decode step makes one copy call where it made five copies from
freshly pinned memory and a fill per padded buffer, all host time between two steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphSizes:
    """What an engine captures CUDA graphs for (``EngineCore`` picks it from its args; a
    pipeline stage gets it in its ``StageAllocation``): decode graphs for up to
    ``max_batch_size`` sequences, mixed graphs (engine.mixed_graphs) for up to
    ``max_graph_tokens`` new tokens over up to ``max_num_seqs`` sequences, block tables
    wide enough for ``max_model_len`` tokens. 0 leaves that kind out."""

    max_batch_size: int
    max_graph_tokens: int
    max_num_seqs: int
    max_model_len: int


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch_size (and it)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 16))
    if max_batch_size not in sizes:
        sizes.append(max_batch_size)
    return sorted(sizes)


class CapturedPasses:
    """Captured forward passes keyed by their padded size (a decode batch size, a token
    bucket), sharing one memory pool. Owned by `DecodeGraphs` and `MixedGraphs`; used on
    the step thread only."""

    def __init__(self, device: torch.device, pool=None) -> None:
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool

    def capture(self, size: int, forward: Callable, args: tuple) -> None:
        """Record `forward(*args)` (reading the owner's static buffers) for `size`."""
        forward(*args)  # warm-up: compiles kernels and settles allocator state outside the capture
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = forward(*args)
        self.graphs[size] = graph
        # The first replay uploads the graph: no request pays it. The buffers still hold the
        # capture's inputs, which write no KV.
        graph.replay()

    def replay(self, size: int) -> torch.Tensor:
        """Run the pass captured for `size` over the buffers' current contents -> its
        output (a view: read it before the next replay)."""
        self.graphs[size].replay()
        return self.outputs[size]


#: each input buffer starts at a multiple of this many bytes (as separate allocations did)
_ALIGN = 256


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


class _InputLayout:
    """Where each input buffer of a decode graph lies in its one byte buffer: input ids,
    positions and slots (int64 [rows] each), sequence lengths (int32 [rows]), then the
    block tables (int32 [rows, max_blocks], row-major, last: a step copies their first
    rows only)."""

    def __init__(self, rows: int, max_blocks: int) -> None:
        self.rows, self.max_blocks = rows, max_blocks
        longs = _aligned(8 * rows)
        # where input ids, positions, slots and sequence lengths start
        self.offsets = (0, longs, 2 * longs, 3 * longs)
        self.block_tables_offset = 3 * longs + _aligned(4 * rows)
        self.num_bytes = self.block_tables_offset + 4 * rows * max_blocks

    def views(self, buffer) -> tuple:
        """-> (input_ids, positions, slot_mapping, seq_lens, block_tables) over `buffer`
        (a uint8 torch tensor or numpy array of `num_bytes`)."""
        rows = self.rows
        on_torch = isinstance(buffer, torch.Tensor)
        int64, int32 = (torch.int64, torch.int32) if on_torch else (np.int64, np.int32)
        parts = [
            buffer[offset : offset + width * rows].view(dtype)
            for offset, width, dtype in zip(
                self.offsets, (8, 8, 8, 4), (int64, int64, int64, int32), strict=True
            )
        ]
        tables = buffer[self.block_tables_offset : self.num_bytes].view(int32)
        return (*parts, tables.reshape(rows, self.max_blocks))

    def num_bytes_for(self, size: int) -> int:
        """Bytes of the buffer that a graph of `size` rows reads (a prefix of it)."""
        return self.block_tables_offset + 4 * size * self.max_blocks


class _HostInputs:
    """A pinned mirror (CUDA) of a decode graph's input buffer, with numpy views of its
    parts, and the event after its latest copy to the device (None: never copied)."""

    def __init__(self, layout: _InputLayout, pin: bool) -> None:
        self.buffer = torch.empty(layout.num_bytes, dtype=torch.uint8, pin_memory=pin)
        array = self.buffer.numpy()
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables = layout.views(
            array
        )
        array[:] = 0
        self.slot_mapping[:] = -1
        self.seq_lens[:] = 1
        self.copied: torch.cuda.Event | None = None


class DecodeGraphs:
    """Static input buffers and one captured graph per batch size.

    `forward(input_ids, positions, metadata)` is the model's forward pass with the
    attention metadata passed in (the runner's closure); it must not sync the host."""

    def __init__(
        self,
        forward: Callable,
        metadata_type: type,
        device: torch.device,
        max_batch_size: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        pool=None,
    ) -> None:
        """`pool`: a CUDA graph memory pool shared with the engine's other graphs
        (replayed one at a time, never concurrently); None makes one."""
        self.device = device
        self.sizes = capture_sizes(max_batch_size)
        largest = self.sizes[-1]
        # the static input buffers: views of one device buffer, filled by one copy per step
        self._layout = _InputLayout(largest, max_blocks_per_seq)
        self._host_inputs: list[_HostInputs] = [_HostInputs(self._layout, pin=device.type == "cuda")]
        self._inputs = self._host_inputs[0].buffer.to(device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables = (
            self._layout.views(self._inputs)
        )
        # one new token per sequence: query_start_loc is 0, 1, 2, ... for every size
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len  # split-KV sizing is fixed at capture: size it for the longest
        self._passes = CapturedPasses(device, pool)
        with torch.inference_mode():
            self._capture_all(forward, metadata_type)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _capture_all(self, forward: Callable, metadata_type: type) -> None:
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its memory
            metadata = metadata_type(
                slot_mapping=self.slot_mapping[:size],
                block_tables=self.block_tables[:size],
                seq_lens=self.seq_lens[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                max_query_len=1,
                max_seq_len=self.max_seq_len,
                num_paged_seqs=size,
            )
            self._capture(size, forward, (self.input_ids[:size], self.positions[:size], metadata))

    def _capture(self, size: int, forward: Callable, args: tuple) -> None:
        """Record the pass for `size` (CPU tests swap this and `_replay` for eager calls)."""
        self._passes.capture(size, forward, args)

    def _replay(self, size: int) -> torch.Tensor:
        return self._passes.replay(size)

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_blocks <= self.max_blocks_per_seq

    def run(
        self,
        input_ids: np.ndarray,  # int64 [n]
        positions: np.ndarray,  # int64 [n]
        slot_mapping: np.ndarray,  # int64 [n]
        block_tables: np.ndarray,  # int32 [n, max_blocks]
        seq_lens: np.ndarray,  # int32 [n]
        before_replay: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Replay for n sequences of one new token each -> hidden [n, hidden_size]
        (a view into the graph's output; read it before the next replay).
        `before_replay` runs once the inputs are queued, right before the replay (the
        runner makes the stream wait for connector loads there, and fills the input ids
        the previous step samples). The inputs go through pinned memory, in one copy: a
        copy from pageable memory may wait for the work queued before it (loads, a step in
        flight)."""
        num_seqs = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_seqs)
        host = self._take_host_inputs()
        host.input_ids[:num_seqs] = input_ids
        host.positions[:num_seqs] = positions
        host.slot_mapping[:num_seqs] = slot_mapping
        host.block_tables[:num_seqs, : block_tables.shape[1]] = block_tables
        host.seq_lens[:num_seqs] = seq_lens
        if size > num_seqs:
            # padding rows: write nothing, attend to one key of block 0 (finite, discarded)
            host.slot_mapping[num_seqs:size] = -1
            host.seq_lens[num_seqs:size] = 1
            host.block_tables[num_seqs:size, 0] = 0
            host.positions[num_seqs:size] = 0
            host.input_ids[num_seqs:size] = 0
        # rows past `size` hold whatever this mirror last had: no graph of `size` reads them
        num_bytes = self._layout.num_bytes_for(size)
        self._inputs[:num_bytes].copy_(host.buffer[:num_bytes], non_blocking=True)
        if self.device.type == "cuda":
            if host.copied is None:
                host.copied = torch.cuda.Event()
            host.copied.record()
        if before_replay is not None:
            before_replay()
        return self._replay(size)[:num_seqs]

    def _take_host_inputs(self) -> _HostInputs:
        """A mirror whose latest copy has run (two steps may be in flight: async
        scheduling), made anew when none has; never waits for the device."""
        for host in self._host_inputs:
            if host.copied is None or host.copied.query():
                return host
        host = _HostInputs(self._layout, pin=True)
        self._host_inputs.append(host)
        return host
