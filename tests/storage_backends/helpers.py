"""Helpers shared by the storage tests: backend kinds, deterministic chunks, on-disk byte counts."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import torch
from zlib_ng.zlib_ng import crc32

from storage_backends import KVChunk, StorageBackend
from storage_backends.chunk import key_hash

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
    """Bytes of the chunk files in ``path``, temporary files included: what the disk tier's cap
    covers (the small index and lock files are outside it)."""
    with os.scandir(path) as scan:
        return sum(
            entry.stat().st_size
            for entry in scan
            if entry.is_file() and (entry.name.endswith(".kvc") or entry.name.startswith(".tmp-"))
        )


_FIXED = struct.Struct("<4sHHBBBBQQ16s")
_CHECKSUM_AT = _FIXED.size  # 44
_PREFIX = _CHECKSUM_AT + 4  # 48
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.uint8: 6}


def forge_chunk(
    shape: tuple[int, ...],
    layout: bytes,
    payload: bytes,
    *,
    raw_len: int,
    dtype: torch.dtype = torch.uint8,
    codec_code: int = 0,
    key: str,
) -> bytes:
    """A chunk with exactly these header fields and a correct CRC-32 (what a hostile client sends)."""
    tail = b"".join(struct.pack("<Q", size) for size in shape) + layout
    fixed = _FIXED.pack(
        b"KVSC",
        2,
        _PREFIX + len(tail),
        _DTYPE_CODES[dtype],
        codec_code,
        len(shape),
        len(layout),
        len(payload),
        raw_len,
        key_hash(key),
    )
    return fixed + struct.pack("<I", crc32(payload, crc32(tail, crc32(fixed)))) + tail + payload


def aligned_copy(chunk: KVChunk, offset_bytes: int = 0) -> KVChunk:
    """``chunk`` copied into memory that starts ``offset_bytes`` past a 4 KiB boundary, like a
    pinned CPU-tier slot (offset 0): the disk tier then writes and reads it with O_DIRECT."""
    storage = torch.empty(chunk.nbytes + 2 * 4096, dtype=torch.uint8)
    start = -storage.data_ptr() % 4096 + offset_bytes
    tensor = storage[start : start + chunk.nbytes].view(chunk.dtype).view(chunk.tensor.shape)
    tensor.copy_(chunk.tensor)
    return KVChunk(tensor, chunk.layout)
