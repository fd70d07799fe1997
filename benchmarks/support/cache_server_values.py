"""Stored values for a real cache server, for tests and benchmarks: valid serialized
chunks bound to their key, and servers filled with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.support.cache_server_process import CacheServerProcess
from cache_server.config import GIB
from cache_server.memory_tier import entry_size
from storage_backends import create_backend
from storage_backends.chunk import KVChunk, encode_chunk


def make_value(seed: int, num_bytes: int = 4096, *, key: str) -> bytes:
    """A valid serialized chunk of about ``num_bytes`` random bytes (uint8 [1, 2, T, 1, 1]), for ``key``."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = max(1, num_bytes // 2)
    return encode_chunk(
        KVChunk(torch.randint(0, 256, (1, 2, num_tokens, 1, 1), dtype=torch.uint8, generator=generator)),
        key=key,
    )


def put_all(url: str, keys: Sequence[str], seed: int, num_bytes: int = 64, num_threads: int = 8) -> None:
    """Put a value of ``num_bytes`` made for each key (values bind their key), all of one length,
    through a real grpc tier. Tests and the cache-server benchmarks fill servers with it."""
    backend = create_backend(url)
    try:
        with ThreadPoolExecutor(num_threads) as pool:
            list(pool.map(lambda key: backend.put_encoded(key, make_value(seed, num_bytes, key=key)), keys))
    finally:
        backend.close()


def alternating_tiers_server(disk_path: str, keys: Sequence[str], seed: int) -> CacheServerProcess:
    """A started server whose memory tier holds the even-numbered ``keys`` and whose disk tier
    holds them all: the memory cap fits half; the odd ones are put first and evicted from
    memory by the even ones. The caller stops it."""
    per_entry = entry_size(keys[0], len(make_value(seed, 64, key=keys[0])))
    memory_bytes = (len(keys) // 2) * per_entry + per_entry // 2
    server = CacheServerProcess(
        "--memory-gb", repr(memory_bytes / GIB), "--disk-path", disk_path, "--disk-gb", "1"
    ).start()
    put_all(server.url, keys[1::2], seed, num_threads=1)
    put_all(server.url, keys[0::2], seed, num_threads=1)
    return server
