"""What each tensor-parallel rank holds: its attention heads, KV heads, MLP columns
and vocabulary rows, the model config it computes with, and its share of the offload
tiers. Pure functions of the model config and the rank; called once per rank at
engine start (docs/architecture.md, "Tensor parallelism")."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import NamedTuple

from connector.config import OffloadConfig
from engine.config import ModelConfig


class TensorParallelLayout(NamedTuple):
    """Rank ``rank`` of ``size`` computes query heads ``[head_start, head_end)``, holds KV
    heads ``[kv_head_start, kv_head_end)`` (one replicated head when the model has fewer
    KV heads than ranks), MLP columns ``[intermediate_start, intermediate_end)`` and
    vocabulary rows ``[vocab_start, vocab_end)`` of a padded shard of ``vocab_shard``
    rows (every rank's shard has that many rows; the ones past the vocabulary are zero)."""

    rank: int
    size: int
    head_start: int
    head_end: int
    kv_head_start: int
    kv_head_end: int
    intermediate_start: int
    intermediate_end: int
    vocab_start: int
    vocab_end: int
    vocab_shard: int

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_head_end - self.kv_head_start

    @property
    def intermediate_size(self) -> int:
        return self.intermediate_end - self.intermediate_start


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """ValueError naming the numbers unless ``size`` ranks can split the model: it must
    divide the attention heads, and the KV heads must split evenly over the ranks or
    the ranks over the KV heads (then each KV head is replicated on size/KV ranks)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if size > heads:
        raise ValueError(
            f"tensor_parallel_size {size} exceeds the model's {heads} attention heads "
            "(every rank needs at least one head)"
        )
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if kv_heads >= size and kv_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {kv_heads} KV heads")
    if kv_heads < size and size % kv_heads:
        raise ValueError(
            f"the model's {kv_heads} KV heads cannot be replicated evenly over "
            f"tensor_parallel_size {size} ranks ({size} is not a multiple of {kv_heads})"
        )


def split_evenly(total: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank`` when ``total`` items split over ``size`` ranks as
    equally as can be (the first ranks take one more when it does not divide)."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_layout(config: ModelConfig, rank: int, size: int) -> TensorParallelLayout:
    """Rank ``rank``'s share of the model (``check_tensor_parallel_size`` first)."""
    check_tensor_parallel_size(config, size)
    heads_per_rank = config.num_heads // size
    kv_heads = config.num_kv_heads
    if kv_heads >= size:
        kv_per_rank = kv_heads // size
        kv_start = rank * kv_per_rank
    else:  # replicated: ranks [k * size/kv, (k+1) * size/kv) share KV head k
        kv_per_rank = 1
        kv_start = rank // (size // kv_heads)
    intermediate = int(config.hf_config.intermediate_size)
    intermediate_start, intermediate_end = split_evenly(intermediate, rank, size)
    vocab_shard = -(-config.vocab_size // size)
    vocab_start = min(rank * vocab_shard, config.vocab_size)
    return TensorParallelLayout(
        rank=rank,
        size=size,
        head_start=rank * heads_per_rank,
        head_end=(rank + 1) * heads_per_rank,
        kv_head_start=kv_start,
        kv_head_end=kv_start + kv_per_rank,
        intermediate_start=intermediate_start,
        intermediate_end=intermediate_end,
        vocab_start=vocab_start,
        vocab_end=min(vocab_start + vocab_shard, config.vocab_size),
        vocab_shard=vocab_shard,
    )


def rank_model_config(config: ModelConfig, layout: TensorParallelLayout) -> ModelConfig:
    """The config a rank's layers and KV tensor are built with: its heads, KV heads and
    MLP width (the hidden size, head size, vocabulary and layers stay the model's)."""
    hf_config = copy.deepcopy(config.hf_config)
    hf_config.intermediate_size = layout.intermediate_size
    return dataclasses.replace(
        config, hf_config=hf_config, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads
    )


def rank_offload_config(config: OffloadConfig, layout: TensorParallelLayout) -> OffloadConfig:
    """A rank's offload settings: its share (1/N) of the CPU and disk byte caps (its
    chunks hold its KV heads only), its own disk folder (a disk tier locks its folder),
    and loads read synchronously: background fetches are planned by rank 0's scheduler
    side with its own keys, which the other ranks cannot use."""
    disk_path = config.disk_path
    if disk_path is not None:
        disk_path = str(Path(disk_path) / f"tp{layout.size}-rank{layout.rank}")
    return dataclasses.replace(
        config,
        cpu_bytes=config.cpu_bytes // layout.size if config.cpu_bytes else 0,
        disk_bytes=max(1, config.disk_bytes // layout.size),
        disk_path=disk_path,
        async_loads=False,
    )
