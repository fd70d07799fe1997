"""CUDA graphs for small steps of any mix: a chunked-prefill chunk over a cached
prefix, a prompt's suffix after a cache hit, prefills beside decodes, and
speculative verification (K + 1 new tokens per request).

Why: the eager forward pass of a large model is host-bound (hundreds of kernel
launches and torch.compile guard checks per step, ~40-50 ms for the 8B shape
whatever the token count), so a step of a few hundred tokens costs what the host
needs to launch it. Replaying a captured graph costs the device work only.
Pure-decode steps keep their own graphs (engine.cuda_graphs); this module covers
every other step of up to `max_graph_tokens` new tokens whose attention is paged
(whole-prompt prefills of >= DENSE_PREFILL_MIN_TOKENS tokens take the fused path
and stay eager).

Captured once at start-up by the model runner, one graph per token bucket
(:func:`token_buckets`), all sharing one memory pool. A step of t new tokens over
n sequences replays the smallest bucket T >= t; the bucket has n_max + 1 sequence
seats (n_max = min(max_num_seqs, T): every sequence has a new token). Padding
(:func:`pad_step`):

- tokens [t, T): input id 0, position 0, slot -1 (no KV is written); they form one
  padding sequence (seat n) of T - t tokens whose block table row is block 0:
  its attention reads block 0 only -- finite values, discarded;
- seats (n, n_max]: no tokens (their attention tiles exit at once).

The attention launch shape is fixed per bucket: max_query_len = T (the tile size
follows it), max_seq_len = the model's limit (split-KV is sized for the longest
sequence; the kernel cuts each tile's real key range). The forward pass the runner
hands in waits, before each layer's attention, for an event the runner records once
that layer's connector load is done (engine.model_runner), so a step with loads
computes its first layers while the later ones still load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.cuda_graphs import CapturedPasses
from engine.host_copy import staged

logger = logging.getLogger(__name__)

# (engine.config.DEFAULT_MAX_GRAPH_TOKENS: steps of up to this many new tokens replay a graph)
#: the smallest bucket: a speculative verification of one request with K <= 7 drafts
MIN_BUCKET_TOKENS = 8


def token_buckets(max_graph_tokens: int) -> list[int]:
    """Padded token counts captured for steps of up to `max_graph_tokens` tokens:
    powers of two from MIN_BUCKET_TOKENS to 64, then multiples of 64 (padding stays
    under half the tokens below 128 and under a third above), and the limit itself.
    Empty when `max_graph_tokens` < 1."""
    if max_graph_tokens < 1:
        return []
    buckets = []
    size = MIN_BUCKET_TOKENS
    while size < 64 and size < max_graph_tokens:
        buckets.append(size)
        size *= 2
    buckets += list(range(64, max_graph_tokens, 64))
    buckets.append(max_graph_tokens)
    return sorted(set(buckets))


@dataclass
class PaddedStep:
    """One step's attention inputs laid out for a bucket of `num_tokens` tokens and
    `num_seats` sequences (host arrays, copied into the graph's static buffers)."""

    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    seq_lens: np.ndarray  # int32 [num_seats]
    query_start_loc: np.ndarray  # int32 [num_seats + 1]
    #: the seat of the padding sequence (its block table row must be block 0)
    padding_seat: int


def pad_step(
    input_ids: np.ndarray,  # int64 [t]
    positions: np.ndarray,  # int64 [t]
    slot_mapping: np.ndarray,  # int64 [t]
    seq_lens: np.ndarray,  # int32 [n]
    query_start_loc: np.ndarray,  # int32 [n + 1]
    num_tokens: int,
    num_seats: int,
) -> PaddedStep:
    """Pad a step of t tokens over n sequences to `num_tokens` >= t tokens and
    `num_seats` > n sequences (module docstring). Raises ValueError when it does not fit."""
    num_real_tokens = int(input_ids.shape[0])
    num_seqs = int(seq_lens.shape[0])
    if num_real_tokens > num_tokens or num_seqs >= num_seats:
        raise ValueError(
            f"a step of {num_real_tokens} tokens over {num_seqs} sequences does not fit a graph "
            f"of {num_tokens} tokens and {num_seats} seats (one is the padding sequence)"
        )
    if query_start_loc.shape[0] != num_seqs + 1 or int(query_start_loc[-1]) != num_real_tokens:
        raise ValueError("query_start_loc must have n + 1 entries ending at the number of tokens")
    num_pad = num_tokens - num_real_tokens

    def padded(values: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(num_tokens, fill, dtype=np.int64)
        out[:num_real_tokens] = values
        return out

    lens = np.zeros(num_seats, dtype=np.int32)
    lens[:num_seqs] = seq_lens
    lens[num_seqs] = num_pad  # the padding sequence: its own tokens only, no prefix
    starts = np.full(num_seats + 1, num_tokens, dtype=np.int32)
    starts[: num_seqs + 1] = query_start_loc
    return PaddedStep(
        input_ids=padded(input_ids, 0),
        positions=padded(positions, 0),
        slot_mapping=padded(slot_mapping, -1),
        seq_lens=lens,
        query_start_loc=starts,
        padding_seat=num_seqs,
    )


class MixedGraphs:
    """Static input buffers and one captured graph per token bucket.

    `forward(input_ids, positions, metadata)` is the model's forward pass with the
    attention metadata passed in (the runner's closure); it must not sync the host.
    Used by the model runner only; `run` is called once per graph step."""

    def __init__(
        self,
        forward: Callable,
        metadata_type: type,
        device: torch.device,
        max_graph_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        block_size: int,
        pool=None,
    ) -> None:
        """`pool`: a CUDA graph memory pool shared with the engine's other graphs
        (replayed one at a time, never concurrently); None makes one."""
        if max_graph_tokens < 1 or max_num_seqs < 1:
            raise ValueError(
                f"mixed graphs need max_graph_tokens >= 1 and max_num_seqs >= 1, "
                f"got {max_graph_tokens} and {max_num_seqs}"
            )
        self.device = device
        self.buckets = token_buckets(max_graph_tokens)
        self.max_num_seqs = max_num_seqs
        largest = self.buckets[-1]
        max_seats = self.num_seats(largest)
        self.max_blocks_per_seq = max_blocks_per_seq
        # the padding sequence of up to `largest` tokens reads block 0 through its row
        width = max(max_blocks_per_seq, -(-largest // block_size))
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((max_seats, width), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seats, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_seats + 1, dtype=torch.int32, device=device)
        self.max_seq_len = max(max_seq_len, largest)
        self._passes = CapturedPasses(device, pool)
        with torch.inference_mode():
            self._capture_all(forward, metadata_type)

    def num_seats(self, num_tokens: int) -> int:
        """Sequences a bucket of `num_tokens` holds: every real one plus the padding one."""
        return min(self.max_num_seqs, num_tokens) + 1

    def _capture_all(self, forward: Callable, metadata_type: type) -> None:
        for num_tokens in reversed(self.buckets):  # largest first so smaller graphs reuse its memory
            seats = self.num_seats(num_tokens)
            # capture over an empty step: every token in the padding sequence
            empty = np.zeros(0, dtype=np.int64)
            self._fill(
                pad_step(
                    empty, empty, empty, np.zeros(0, np.int32), np.zeros(1, np.int32), num_tokens, seats
                ),
                None,
            )
            metadata = metadata_type(
                slot_mapping=self.slot_mapping[:num_tokens],
                block_tables=self.block_tables[:seats],
                seq_lens=self.seq_lens[:seats],
                query_start_loc=self.query_start_loc[: seats + 1],
                max_query_len=num_tokens,
                max_seq_len=self.max_seq_len,
                num_paged_seqs=seats,
            )
            self._capture(
                num_tokens, forward, (self.input_ids[:num_tokens], self.positions[:num_tokens], metadata)
            )

    def _capture(self, num_tokens: int, forward: Callable, args: tuple) -> None:
        """Record the pass for `num_tokens` (CPU tests swap this and `_replay` for eager calls)."""
        self._passes.capture(num_tokens, forward, args)

    def _replay(self, num_tokens: int) -> torch.Tensor:
        return self._passes.replay(num_tokens)

    def bucket_for(self, num_tokens: int) -> int | None:
        """The bucket a step of `num_tokens` tokens replays, None when none is large enough."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def can_run(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        return (
            num_tokens <= self.buckets[-1]
            and num_seqs <= self.max_num_seqs
            and max_blocks <= self.max_blocks_per_seq
        )

    def _fill(self, step: PaddedStep, block_tables: np.ndarray | None) -> None:
        """Queue the copies of one padded step into the static buffers."""
        num_tokens = step.input_ids.shape[0]
        seats = step.seq_lens.shape[0]
        device = self.device
        self.input_ids[:num_tokens].copy_(staged(step.input_ids, device), non_blocking=True)
        self.positions[:num_tokens].copy_(staged(step.positions, device), non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(staged(step.slot_mapping, device), non_blocking=True)
        if block_tables is not None and block_tables.shape[0]:
            rows, width = block_tables.shape
            self.block_tables[:rows, :width].copy_(staged(block_tables, device), non_blocking=True)
        self.block_tables[step.padding_seat].zero_()
        self.seq_lens[:seats].copy_(staged(step.seq_lens, device), non_blocking=True)
        self.query_start_loc[: seats + 1].copy_(staged(step.query_start_loc, device), non_blocking=True)

    def run(
        self,
        input_ids: np.ndarray,  # int64 [t]
        positions: np.ndarray,  # int64 [t]
        slot_mapping: np.ndarray,  # int64 [t]
        block_tables: np.ndarray,  # int32 [n, max_blocks]
        seq_lens: np.ndarray,  # int32 [n]
        query_start_loc: np.ndarray,  # int32 [n + 1]
        before_replay: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Replay for a step of t tokens over n paged sequences -> hidden [t, hidden_size]
        (a view into the graph's output; read it before the next replay). Raises
        ValueError when `can_run` is False for it. `before_replay` runs once the inputs
        are queued, right before the replay (the runner makes the stream wait for
        connector loads there, and fills the input ids the previous step samples)."""
        num_real_tokens = input_ids.shape[0]
        if not self.can_run(num_real_tokens, seq_lens.shape[0], block_tables.shape[1]):
            raise ValueError(
                f"a step of {num_real_tokens} tokens, {seq_lens.shape[0]} sequences and "
                f"{block_tables.shape[1]} blocks per sequence does not fit the mixed graphs"
            )
        num_tokens = self.bucket_for(num_real_tokens)
        step = pad_step(
            input_ids,
            positions,
            slot_mapping,
            seq_lens,
            query_start_loc,
            num_tokens,
            self.num_seats(num_tokens),
        )
        self._fill(step, block_tables)
        if before_replay is not None:
            before_replay()
        return self._replay(num_tokens)[:num_real_tokens]
