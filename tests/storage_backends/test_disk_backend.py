"""Disk tier: crash safety under SIGKILL, index rebuild, corruption detection, foreign versions."""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage_backends import create_backend
from storage_backends.chunk import FORMAT_VERSION, MAGIC, encode_chunk
from storage_backends.disk_backend import (
    FILE_SUFFIX,
    RECORD_MAGIC,
    RECORD_VERSION,
    TMP_PREFIX,
    DiskBackend,
    key_to_filename,
)
from tests.storage_backends.helpers import directory_bytes, make_chunk

REPO_ROOT = Path(__file__).resolve().parents[2]
BURST_CHUNK = {"num_tokens": 256, "num_kv_heads": 4, "head_dim": 128}  # 1 MiB of bf16 per chunk

NUM_BURST_SEEDS = 4
NUM_KILLS = 3
WRITER = f"""
import sys
from storage_backends.disk_backend import DiskBackend
from tests.storage_backends.helpers import aligned_copy, make_chunk

root, capacity, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
backend = DiskBackend(root, capacity)  # fsync (the default): writes take long enough to be interrupted
# made once: the loop only writes; page-aligned like CPU-tier slots, so written with O_DIRECT
chunks = [aligned_copy(make_chunk(seed, **{BURST_CHUNK!r})) for seed in range({NUM_BURST_SEEDS})]
print("ready", flush=True)
index = first
while True:
    batch = [(f"burst:{{i}}", chunks[i % {NUM_BURST_SEEDS}]) for i in range(index, index + 2)]
    backend.put_many(batch)  # two files in flight on the backend's I/O threads
    index += 2
"""


def _start_writer(root: Path, capacity: int, first: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), str(capacity), str(first)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def _wait_for_a_write_in_flight(root: Path, timeout_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(name.startswith(TMP_PREFIX) for name in os.listdir(root)):
            return


def test_sigkill_mid_burst_never_leaves_a_partial_or_corrupt_chunk(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    capacity = 6 * (1 << 20)  # five 1 MiB chunk files fit
    rng = random.Random(0)
    first = 0
    num_kills_mid_write = 0  # kills that left a temporary file behind (reported, timing-dependent)
    for _ in range(NUM_KILLS):
        writer = _start_writer(root, capacity, first)
        assert writer.stdout.readline() == "ready\n", "writer did not start"
        time.sleep(rng.uniform(0.05, 0.2))  # well into the burst
        _wait_for_a_write_in_flight(root)  # then strike while a file is being written, if we catch one
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        num_kills_mid_write += any(name.startswith(TMP_PREFIX) for name in os.listdir(root))
        first += 1000

        # Restart right after the kill: the kernel released the dead writer's folder lock; the
        # index file (if the writer got to write one) is stale and only a hint.
        backend = DiskBackend(str(root), capacity)
        assert backend.direct_io
        assert not [name for name in os.listdir(root) if name.startswith(TMP_PREFIX)]
        assert directory_bytes(str(root)) <= capacity
        keys = backend.keys("burst:")
        assert keys, "no chunk survived"
        assert backend.stats()["num_keys"] == len(keys)
        for key in keys:
            expected = make_chunk(int(key.split(":")[1]) % NUM_BURST_SEEDS, **BURST_CHUNK)
            loaded = backend.get(key)
            assert loaded is not None and loaded.equal(expected), key
        assert backend.stats()["corrupt"] == 0
        backend.close()
        from_index = DiskBackend(str(root), capacity)  # a clean restart: every file from the index
        assert from_index.stats()["num_files_scanned_at_start"] == 0
        assert sorted(from_index.keys("burst:")) == sorted(keys)
        from_index.close()
    print(f"{num_kills_mid_write} of {NUM_KILLS} kills landed in the middle of a file write")


@pytest.mark.parametrize("where", ["record key", "chunk header", "payload start", "last byte"])
def test_flipping_one_byte_makes_the_chunk_a_counted_miss(tmp_path: Path, where: str) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 20)
    backend.put("ns:victim", make_chunk(1))
    backend.put("ns:other", make_chunk(2))
    path = tmp_path / key_to_filename("ns:victim")
    data = bytearray(path.read_bytes())
    chunk_start = data.index(MAGIC)
    offset = {
        "record key": 9,
        "chunk header": chunk_start + 8,
        "payload start": len(data) - make_chunk(1).nbytes,
        "last byte": len(data) - 1,
    }[where]
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    assert backend.contains(["ns:victim"]) == 1  # the index cannot know yet
    assert backend.get("ns:victim") is None
    assert backend.stats()["corrupt"] == 1
    assert not path.exists() and backend.contains(["ns:victim"]) == 0
    assert backend.get("ns:other").equal(make_chunk(2))  # neighbours are untouched


def test_get_encoded_also_verifies_the_checksum(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 20)
    backend.put("ns:a", make_chunk(1))
    path = tmp_path / key_to_filename("ns:a")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert backend.get_encoded("ns:a") is None
    assert backend.stats()["corrupt"] == 1


def test_restart_removes_debris_and_ignores_other_versions(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 20)
    for name in ("good", "torn", "v2-chunk", "v2-record", "renamed"):
        backend.put(f"ns:{name}", make_chunk(len(name)))
    backend.close()

    torn = tmp_path / key_to_filename("ns:torn")
    torn.write_bytes(torn.read_bytes()[:-100])  # a torn write after a power loss
    (tmp_path / f"{TMP_PREFIX}leftover").write_bytes(b"half a file")
    v2_chunk = tmp_path / key_to_filename("ns:v2-chunk")
    data = bytearray(v2_chunk.read_bytes())
    struct.pack_into("<H", data, data.index(MAGIC) + 4, FORMAT_VERSION + 1)  # a newer chunk format
    v2_chunk.write_bytes(bytes(data))
    v2_record = tmp_path / key_to_filename("ns:v2-record")
    data = bytearray(v2_record.read_bytes())
    struct.pack_into("<H", data, len(RECORD_MAGIC), RECORD_VERSION + 1)  # a newer disk record
    v2_record.write_bytes(bytes(data))
    renamed = tmp_path / key_to_filename("ns:renamed")
    renamed.rename(tmp_path / key_to_filename("ns:elsewhere"))  # a key that is not its file's

    restarted = DiskBackend(str(tmp_path), 1 << 20)
    assert restarted.keys("") == ["ns:good"]
    assert restarted.get("ns:good").equal(make_chunk(len("good")))
    stats = restarted.stats()
    assert stats["num_ignored_files"] == 2 and stats["corrupt"] == 2
    assert sorted(name for name in os.listdir(tmp_path) if name.endswith(FILE_SUFFIX)) == sorted(
        key_to_filename(key) for key in ("ns:good", "ns:v2-chunk", "ns:v2-record")
    )  # torn, renamed and temporary files are gone; other versions are left alone
    assert stats["bytes_used"] == (tmp_path / key_to_filename("ns:good")).stat().st_size


def test_rebuilt_index_keeps_recency_and_a_smaller_cap_is_enforced(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 20)
    for age, name in enumerate("abcd"):
        backend.put(f"ns:{name}", make_chunk(age))
        os.utime(tmp_path / key_to_filename(f"ns:{name}"), (1_000_000 + age, 1_000_000 + age))
    file_bytes = (tmp_path / key_to_filename("ns:a")).stat().st_size
    backend.close()
    restarted = DiskBackend(str(tmp_path), 3 * file_bytes)  # the cap shrank: the oldest file goes
    assert sorted(restarted.keys("")) == ["ns:b", "ns:c", "ns:d"]
    assert directory_bytes(str(tmp_path)) <= 3 * file_bytes
    restarted.put("ns:e", make_chunk(9))  # the next oldest, b, is evicted
    assert sorted(restarted.keys("")) == ["ns:c", "ns:d", "ns:e"]


def test_fsync_and_lz4_options_from_the_url(tmp_path: Path) -> None:
    backend = create_backend(f"file://{tmp_path}?capacity=1MiB&fsync=1&codec=lz4")
    assert isinstance(backend, DiskBackend) and backend.fsync and backend.codec == "lz4"
    chunk = make_chunk(1)
    chunk.tensor.zero_()
    backend.put("ns:zeros", chunk)
    assert (tmp_path / key_to_filename("ns:zeros")).stat().st_size < chunk.nbytes // 4
    assert backend.get("ns:zeros").equal(chunk)


def test_encoded_bytes_from_another_tier_are_stored_as_they_are(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 20)
    encoded = encode_chunk(make_chunk(3), "lz4", key="ns:a")
    backend.put_encoded("ns:a", encoded)
    assert backend.get_encoded("ns:a") == encoded
