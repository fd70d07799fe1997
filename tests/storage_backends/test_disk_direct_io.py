"""Disk tier reads and writes: block-aligned payloads read with O_DIRECT straight into the
caller's buffer, the buffered fallback (unaligned buffers, filesystems that refuse O_DIRECT), several
files in flight."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from storage_backends import create_backend, disk_io
from storage_backends.chunk import KVChunk, encode_chunk
from storage_backends.disk_backend import DiskBackend, key_to_filename
from storage_backends.disk_io import BLOCK, address_of, probe_direct_io
from storage_backends.disk_record import ALIGN_MIN_PAYLOAD

# 2 layers x 2 x 33 tokens x 4 heads x 128 dims of bf16 = 132 KiB + 0 bytes: whole blocks.
LARGE = {"num_layers": 2, "num_tokens": 33, "num_kv_heads": 4, "head_dim": 128}
# 2 x 2 x 37 x 4 x 65 bf16 = 76,960 bytes: above ALIGN_MIN_PAYLOAD, ends in a partial block.
LARGE_WITH_TAIL = {"num_layers": 2, "num_tokens": 37, "num_kv_heads": 4, "head_dim": 65}


def aligned_tensor(numel: int, dtype: torch.dtype = torch.bfloat16, offset_bytes: int = 0) -> torch.Tensor:
    """A tensor whose memory starts ``offset_bytes`` past a 4 KiB boundary (pinned slots start on one)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    storage = torch.empty(numel * itemsize + 2 * BLOCK, dtype=torch.uint8)
    start = -storage.data_ptr() % BLOCK + offset_bytes
    return storage[start : start + numel * itemsize].view(dtype)


def random_chunk(seed: int, shape: dict, offset_bytes: int = 0) -> KVChunk:
    numel = shape["num_layers"] * 2 * shape["num_tokens"] * shape["num_kv_heads"] * shape["head_dim"]
    tensor = aligned_tensor(numel, offset_bytes=offset_bytes)
    generator = torch.Generator().manual_seed(seed)
    tensor.view(torch.uint8).copy_(
        torch.randint(0, 256, (numel * 2,), dtype=torch.uint8, generator=generator)
    )
    dims = (shape["num_layers"], 2, shape["num_tokens"], shape["num_kv_heads"], shape["head_dim"])
    return KVChunk(tensor.view(dims))


def payload_offset_of(path: Path) -> int:
    return struct.unpack_from("<I", path.read_bytes(), 12)[0]


@pytest.mark.parametrize("shape", [LARGE, LARGE_WITH_TAIL], ids=["whole-blocks", "partial-last-block"])
@pytest.mark.parametrize("buffer_offset", [0, 64], ids=["aligned-buffer", "unaligned-buffer"])
def test_large_payload_is_block_aligned_and_read_into_the_callers_buffer(
    tmp_path: Path, shape: dict, buffer_offset: int
) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 24)
    assert backend.direct_io, "ext4 under /tmp accepts O_DIRECT: the direct path must be taken"
    chunk = random_chunk(1, shape, offset_bytes=buffer_offset)
    assert chunk.nbytes >= ALIGN_MIN_PAYLOAD
    backend.put("ns:big", chunk)
    path = tmp_path / key_to_filename("ns:big")
    assert payload_offset_of(path) % BLOCK == 0
    assert path.stat().st_size == payload_offset_of(path) + chunk.nbytes  # the padded tail was cut off

    out = aligned_tensor(chunk.tensor.numel() + 100, offset_bytes=buffer_offset)
    out.fill_(7.0)
    got = backend.get_into("ns:big", out)
    assert got is not None and got.equal(chunk)
    assert got.tensor.data_ptr() == out.data_ptr()
    assert bool((out[chunk.tensor.numel() :] == 7.0).all())
    assert backend.get("ns:big").equal(chunk)
    backend.close()


def test_address_of_is_the_first_bytes_address_for_any_contiguous_buffer() -> None:
    """``disk_io.address_of`` (the buffer protocol through ctypes, no numpy) on the buffers the
    disk tier meets: bytearrays and mmaps (the server's), tensors' bytes (the engine's) and
    read-only bytes (a Put's value), slices of each; 0 when empty; non-contiguous refused."""
    for writable in (bytearray(3 * BLOCK), mmap.mmap(-1, 3 * BLOCK)):
        base = ctypes.addressof(ctypes.c_char.from_buffer(writable))
        view = memoryview(writable)
        assert address_of(view) == base
        assert address_of(view[BLOCK + 5 :]) == base + BLOCK + 5
        assert address_of(view[BLOCK:].toreadonly()) == base + BLOCK
        del view
    tensor = torch.arange(1000, dtype=torch.int32)
    assert address_of(memoryview(tensor.numpy())[10:]) == tensor.data_ptr() + 40
    data = bytes(range(100))
    assert address_of(memoryview(data)[7:]) - address_of(memoryview(data)) == 7
    assert address_of(memoryview(data)[5:5]) == 0
    with pytest.raises(BufferError):
        address_of(memoryview(bytearray(8))[::2])


@pytest.mark.parametrize("num_bytes", [ALIGN_MIN_PAYLOAD + 1000, 3 << 20])
def test_get_encoded_reads_the_payload_directly_into_a_block_aligned_bytearray(
    tmp_path: Path, num_bytes: int, monkeypatch
) -> None:
    """The cache server's read: the buffer ``get_encoded`` returns is an unfilled bytearray
    whose payload starts on a block boundary, so the payload is read with O_DIRECT (the
    file is never switched to buffered reads) and only its last partial block is copied."""
    backend = DiskBackend(str(tmp_path), 1 << 26)
    assert backend.direct_io
    key = "ns:enc"
    value = encode_chunk(
        KVChunk(torch.randint(0, 256, (1, 2, num_bytes // 2, 1, 1), dtype=torch.uint8)), key=key
    )
    backend.put_encoded(key, value)
    switched = []
    monkeypatch.setattr(disk_io, "set_direct", lambda fd, direct: switched.append(direct))
    got = backend.get_encoded(key)
    assert bytes(got) == value and got.readonly
    assert isinstance(got.obj, bytearray) and len(got.obj) == len(value) + BLOCK
    header_len = len(value) - (num_bytes // 2) * 2
    assert address_of(got[header_len:]) % BLOCK == 0
    assert switched == []  # never fell back to buffered reads
    backend.close()


@pytest.mark.parametrize("where", ["first payload byte", "last full block", "last byte"])
def test_a_flipped_payload_byte_of_a_direct_read_is_a_miss(tmp_path: Path, where: str) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 24)
    chunk = random_chunk(2, LARGE_WITH_TAIL)
    backend.put("ns:big", chunk)
    path = tmp_path / key_to_filename("ns:big")
    data = bytearray(path.read_bytes())
    start = payload_offset_of(path)
    offset = {
        "first payload byte": start,
        "last full block": start + (chunk.nbytes // BLOCK) * BLOCK - 1,
        "last byte": len(data) - 1,
    }[where]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    assert backend.get_into("ns:big", aligned_tensor(chunk.tensor.numel())) is None
    assert backend.stats()["corrupt"] == 1 and not path.exists()
    backend.close()


def test_a_truncated_or_grown_file_is_a_miss(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 24)
    for name in ("short", "long"):
        backend.put(f"ns:{name}", random_chunk(3, LARGE))
    short = tmp_path / key_to_filename("ns:short")
    os.truncate(short, short.stat().st_size - BLOCK)
    with open(tmp_path / key_to_filename("ns:long"), "ab") as file:
        file.write(b"x")
    out = aligned_tensor(random_chunk(3, LARGE).tensor.numel())
    assert backend.get_into("ns:short", out) is None
    assert backend.get_into("ns:long", out) is None
    assert backend.stats()["corrupt"] == 2
    backend.close()


def test_on_tmpfs_direct_io_is_used_only_where_accepted_and_reads_work_either_way(tmp_path: Path) -> None:
    """tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since: the probe decides."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm tmpfs on this machine")
    folder = Path("/dev/shm") / f"kvstash-test-{os.getpid()}-{tmp_path.name}"
    folder.mkdir()
    try:
        accepted = probe_direct_io(str(folder), ".tmp-") is None
        backend = DiskBackend(str(folder), 1 << 24)
        assert backend.direct_io is accepted and backend.stats()["direct_io"] is accepted
        chunk = random_chunk(4, LARGE_WITH_TAIL)
        backend.put_many([("ns:a", chunk), ("ns:b", random_chunk(5, LARGE))])
        assert backend.get_into("ns:a", aligned_tensor(chunk.tensor.numel())).equal(chunk)
        backend.close()
    finally:
        for path in folder.glob("*") if folder.exists() else []:
            path.unlink()
        for path in folder.glob(".*") if folder.exists() else []:
            path.unlink()
        if folder.exists():
            folder.rmdir()


def test_direct_io_can_be_turned_off_and_io_threads_set_from_the_url(tmp_path: Path) -> None:
    backend = create_backend(f"file://{tmp_path}?capacity=16MiB&direct_io=0&io_threads=3&fsync=0")
    assert isinstance(backend, DiskBackend)
    assert (backend.direct_io, backend.io_threads, backend.fsync) == (False, 3, False)
    chunk = random_chunk(6, LARGE)
    backend.put("ns:a", chunk)
    assert backend.get("ns:a").equal(chunk)
    backend.close()
    for bad in ("io_threads=0", "io_threads=many", "direct_io=maybe"):
        with pytest.raises(ValueError, match="io_threads|direct_io"):
            create_backend(f"file://{tmp_path}/other?capacity=16MiB&{bad}")


def test_get_many_into_reads_several_files_at_once_in_order(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 26, io_threads=4)
    chunks = [random_chunk(seed, LARGE_WITH_TAIL if seed % 2 else LARGE) for seed in range(12)]
    backend.put_many([(f"ns:{i}", chunk) for i, chunk in enumerate(chunks)])
    keys = [f"ns:{i}" for i in range(12)] + ["ns:absent"]
    outs = [aligned_tensor(chunk.tensor.numel()) for chunk in chunks] + [aligned_tensor(16)]
    got = backend.get_many_into(keys, outs)
    assert got[-1] is None
    for result, chunk, out in zip(got[:-1], chunks, outs, strict=False):
        assert result.equal(chunk) and result.tensor.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="get_many_into"):
        backend.get_many_into(keys, outs[:-1])
    # a buffer of the wrong dtype is the caller's error, not a corrupt file
    with pytest.raises(ValueError, match="get_into"):
        backend.get_many_into(["ns:0"], [aligned_tensor(chunks[0].tensor.numel(), torch.float16)])
    assert backend.stats()["corrupt"] == 0 and backend.contains(["ns:0"]) == 1
    backend.close()


def test_put_many_attempts_every_item_and_raises_the_first_error(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 3 * 150_000)
    chunk = random_chunk(7, LARGE)  # 132 KiB: three fit
    with pytest.raises(ValueError, match="exceeds"):
        backend.put_many(
            [("ns:a", chunk), ("ns:huge", random_chunk(8, {**LARGE, "num_tokens": 200})), ("ns:b", chunk)]
        )
    assert sorted(backend.keys("ns:")) == ["ns:a", "ns:b"]
    backend.close()


@pytest.mark.gpu
def test_get_into_a_pinned_cpu_tier_slot_then_to_the_gpu(tmp_path: Path) -> None:
    """The connector's pinned slab (page-aligned slots of 256 KiB) is filled by a direct read."""
    from connector.cpu_tier import PinnedChunkPool
    from connector.token_db import KV_LAYOUT

    shape = (2, 2, 64, 4, 128)  # 256 KiB of bf16 per slot: every slot starts on a 4 KiB boundary
    slot_shape = {"num_layers": 2, "num_tokens": 64, "num_kv_heads": 4, "head_dim": 128}
    pool = PinnedChunkPool(4 << 20, shape, torch.bfloat16, pin_memory=True, layout=KV_LAYOUT)
    backend = DiskBackend(str(tmp_path), 1 << 24)
    chunks = [random_chunk(seed, slot_shape) for seed in range(4)]
    backend.put_many([(f"ns:{i}", chunk) for i, chunk in enumerate(chunks)])
    reservations = [pool.reserve(f"ns:{i}", shape) for i in range(4)]
    slots = [reservation.buffer for reservation in reservations]
    assert all(slot.is_pinned() and slot.data_ptr() % BLOCK == 0 for slot in slots)
    got = backend.get_many_into([f"ns:{i}" for i in range(4)], slots)
    for i, (result, chunk) in enumerate(zip(got, chunks, strict=True)):
        assert result is not None and result.tensor.data_ptr() == slots[i].data_ptr()
        pool.publish(reservations[i])
        on_gpu = pool.get(f"ns:{i}").tensor.cuda(non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu().view(torch.uint8), chunk.tensor.view(torch.uint8))
    backend.close()


@pytest.fixture
def ramfs_folder(tmp_path: Path):
    """A ramfs mount (which refuses O_DIRECT), where the machine lets this test mount one (root)."""
    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_filesystem_that_refuses_o_direct_gets_buffered_io(ramfs_folder: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="storage_backends.disk_backend"):
        backend = DiskBackend(str(ramfs_folder / "kv"), 1 << 24)
    assert backend.direct_io is False and backend.stats()["direct_io"] is False
    assert any("O_DIRECT refused" in record.getMessage() for record in caplog.records)
    chunks = [random_chunk(seed, LARGE_WITH_TAIL) for seed in range(3)]  # aligned, as direct writes want
    backend.put_many([(f"ns:{i}", chunk) for i, chunk in enumerate(chunks)])
    outs = [aligned_tensor(chunk.tensor.numel()) for chunk in chunks]
    got = backend.get_many_into([f"ns:{i}" for i in range(3)], outs)
    assert all(result.equal(chunk) for result, chunk in zip(got, chunks, strict=True))
    backend.close()
