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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_copy import staged

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
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
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
        the previous step samples). The inputs are staged in pinned memory: a copy from
        pageable memory may wait for the work queued before it (loads, a step in flight)."""
        num_seqs = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_seqs)
        self.input_ids[:num_seqs].copy_(staged(input_ids, self.device), non_blocking=True)
        self.positions[:num_seqs].copy_(staged(positions, self.device), non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(staged(slot_mapping, self.device), non_blocking=True)
        self.block_tables[:num_seqs, : block_tables.shape[1]].copy_(
            staged(block_tables, self.device), non_blocking=True
        )
        self.seq_lens[:num_seqs].copy_(staged(seq_lens, self.device), non_blocking=True)
        if size > num_seqs:
            # padding rows: write nothing, attend to one key of block 0 (finite, discarded)
            self.slot_mapping[num_seqs:size].fill_(-1)
            self.seq_lens[num_seqs:size].fill_(1)
            self.block_tables[num_seqs:size, 0].fill_(0)
            self.positions[num_seqs:size].fill_(0)
            self.input_ids[num_seqs:size].fill_(0)
        if before_replay is not None:
            before_replay()
        return self._replay(size)[:num_seqs]
