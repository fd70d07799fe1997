"""create_backend URL handling, size parsing, and CPU-tier specifics (slots, pinned memory)."""

from __future__ import annotations

import pytest
import torch

from storage_backends import SCHEME_TO_FACTORY, create_backend
from storage_backends.cpu_backend import CPUBackend
from storage_backends.disk_backend import DiskBackend
from storage_backends.redis_backend import RedisBackend
from storage_backends.urls import parse_size
from tests.storage_backends.helpers import make_chunk


def test_schemes_pick_their_backend(tmp_path, redis_url: str) -> None:
    assert isinstance(create_backend("cpu://?capacity=1MiB"), CPUBackend)
    assert isinstance(create_backend(f"file://{tmp_path}?capacity=1MiB"), DiskBackend)
    backend = create_backend(redis_url)
    assert isinstance(backend, RedisBackend) and not backend.is_cluster
    backend.close()
    for scheme in ("cpu", "file", "redis", "rediss", "redis+cluster"):
        assert scheme in SCHEME_TO_FACTORY


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://bucket", "unknown storage URL scheme s3://"),
        ("no-scheme-at-all", r"unknown storage URL scheme \(none\)"),
        ("cpu://", "needs a byte cap"),
        ("cpu://?capacity=10&slot_bytes=4096", "holds no slot"),
        ("cpu://?capacity=lots", "cannot read 'lots' as a byte size"),
        ("cpu://?capacity=1MiB&colour=red", "unknown parameter 'colour'"),
        ("cpu://?capacity=1MiB&capacity=2MiB", "given twice"),
        ("cpu://somehost?capacity=1MiB", "takes no host or path"),
        ("file:///tmp/x", "needs a byte cap"),
        ("file://?capacity=1MiB", "needs a directory"),
        ("file:///tmp/x?capacity=1MiB&codec=zip", "unknown codec"),
        ("file:///tmp/x?capacity=1MiB&fsync=maybe", "not a boolean"),
    ],
)
def test_bad_urls_name_the_problem(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create_backend(url)


def test_sizes_accept_units() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5 GiB") == 3 << 29
    assert parse_size("2GB") == 2_000_000_000
    with pytest.raises(ValueError, match="must be positive"):
        parse_size("0")


def test_cpu_chunks_span_slots_and_free_them() -> None:
    backend = CPUBackend(capacity_bytes=10 * 1024, slot_bytes=1024)
    big = make_chunk(1, num_tokens=24)  # 3 KiB (128 B per token): three slots
    small = make_chunk(2, num_tokens=1)  # 128 B: one slot
    backend.put("ns:big", big)
    backend.put("ns:small", small)
    assert backend.stats()["bytes_used"] == 4 * 1024
    assert backend.get("ns:big").equal(big) and backend.get("ns:small").equal(small)
    assert backend.delete("ns:big")
    assert backend.stats()["bytes_used"] == 1024
    for i in range(9):  # every slot reusable: no fragmentation
        backend.put(f"ns:{i}", make_chunk(10 + i, num_tokens=4))
    assert backend.stats()["evictions"] == 0 and backend.stats()["bytes_used"] == 10 * 1024


def test_pin_memory_is_only_used_with_cuda() -> None:
    backend = CPUBackend(capacity_bytes=1 << 20, pin_memory=True)
    assert backend.stats()["pinned_memory"] == torch.cuda.is_available()


@pytest.mark.gpu
def test_cpu_tier_holds_pinned_memory_and_takes_cuda_tensors() -> None:
    backend = create_backend("cpu://?capacity=8MiB&slot_bytes=1MiB&pin_memory=1")
    assert backend.stats()["pinned_memory"] is True
    chunk = make_chunk(1, num_tokens=256, num_kv_heads=4, head_dim=128)  # 1 MiB
    from storage_backends import KVChunk

    backend.put("ns:gpu", KVChunk(chunk.tensor.cuda()))
    assert backend.get("ns:gpu").equal(chunk)
