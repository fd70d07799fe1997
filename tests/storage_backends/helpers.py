"""Helpers shared by the storage tests: backend kinds, deterministic chunks, on-disk byte counts."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from storage_backends import KVChunk, StorageBackend

#: tiers with a byte cap that kvstash enforces (eviction order, pins, cap checks apply)
CAPPED_KINDS = ("cpu", "disk", "disk-lz4")
ALL_KINDS = (*CAPPED_KINDS, "redis", "redis-cluster", "grpc")

BackendFactory = Callable[..., StorageBackend]


def make_chunk(
    seed: int,
    num_tokens: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 8,
) -> KVChunk:
    """A chunk whose bytes are random bit patterns (NaNs, infinities and -0.0 included)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_tokens, num_kv_heads, head_dim)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = num_layers * 2 * num_tokens * num_kv_heads * head_dim
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return KVChunk(raw.view(dtype).reshape(shape))


def directory_bytes(path: str) -> int:
    """Bytes of every file in ``path`` (temporary files included): what the disk tier really occupies."""
    with os.scandir(path) as scan:
        return sum(entry.stat().st_size for entry in scan if entry.is_file())
