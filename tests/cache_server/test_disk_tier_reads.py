"""A Get served from the cache server's disk tier: verified once, kept uncopied, corrupt is a miss.

The in-process tests build the server's real :class:`TieredStore` (real memory tier,
real disk tier on files in ``tmp_path``) and count checksum passes with the tiers'
own ``verified`` counters; the last test runs a real server process across a restart.
"""

from __future__ import annotations

import json
import os

import grpc
import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from cache_server.config import GIB, ServerConfig
from cache_server.memory_tier import entry_size, num_bytes_held
from cache_server.store import TieredStore
from protos import kvstash_pb2
from storage_backends.disk_backend import key_to_filename
from tests.cache_server.helpers import Stubs, run_kvstash, status_of

#: one value below the disk tier's aligned-payload size (64 KiB), one above (O_DIRECT path)
SIZES = (4096, 3 << 20)


def restarted_store(disk_path: str, key_to_value: dict[str, bytes]) -> TieredStore:
    """A store whose disk tier holds ``key_to_value`` and whose memory tier is empty (a restart)."""
    config = ServerConfig(memory_bytes=64 << 20, disk_path=disk_path, disk_bytes=1 * GIB)
    store = TieredStore(config)
    try:
        for key, value in key_to_value.items():
            store.put_verified(key, value)
    finally:
        store.close()
    return TieredStore(config)


def tier(store: TieredStore, name: str) -> dict:
    return next(stats for stats in store.stats() if stats["name"] == name)


@pytest.mark.parametrize("num_bytes", SIZES)
def test_a_disk_hit_is_verified_once_and_kept_in_memory_uncopied(tmp_path, num_bytes: int) -> None:
    key = "ns/disk-hit"
    value = make_value(1, num_bytes, key=key)
    store = restarted_store(str(tmp_path), {key: value})
    try:
        found = store.get(key)
        assert found is not None and found.tier == "disk"
        assert bytes(found.data) == value
        # One checksum pass: the disk read's. The promotion re-verifying would count in memory.
        assert tier(store, "disk")["verified"] == 1
        assert tier(store, "memory")["verified"] == 0
        # The memory tier keeps the very buffer the disk read filled (read-only: nobody changes it).
        kept = store.memory.get_encoded(key)
        assert kept is found.data
        assert memoryview(kept).readonly
        # ...and counts all of it against its cap: the read buffer, block padding included.
        assert num_bytes_held(kept) >= len(value)
        assert tier(store, "memory")["bytes_used"] == entry_size(key, num_bytes_held(kept))
        # The next Get is a memory hit: no tier verifies again.
        again = store.get(key)
        assert again.tier == "memory" and again.data is found.data
        assert tier(store, "disk")["verified"] == 1
        assert tier(store, "memory")["verified"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("num_bytes", SIZES)
@pytest.mark.parametrize("damage", ["flipped payload byte", "truncated", "flipped header byte"])
def test_a_damaged_disk_file_is_a_miss_and_is_not_promoted(tmp_path, num_bytes: int, damage: str) -> None:
    key, other = "ns/damaged", "ns/intact"
    store = restarted_store(
        str(tmp_path), {key: make_value(2, num_bytes, key=key), other: make_value(3, num_bytes, key=other)}
    )
    path = tmp_path / key_to_filename(key)
    size = path.stat().st_size
    with open(path, "r+b") as file:
        if damage == "truncated":
            file.truncate(size - 1)
        else:
            offset = size - 1 if damage == "flipped payload byte" else size - num_bytes - 8
            file.seek(offset)
            byte = file.read(1)
            file.seek(offset)
            file.write(bytes([byte[0] ^ 0x01]))
    try:
        assert store.get(key) is None
        assert tier(store, "disk")["corrupt"] == 1
        assert store.memory.contains([key]) == 0
        assert not os.path.exists(path)  # dropped: the next read is a plain miss
        assert store.get(key) is None
        assert bytes(store.get(other).data) == make_value(3, num_bytes, key=other)
    finally:
        store.close()


def test_a_value_larger_than_the_memory_tier_is_served_from_disk_unpromoted(tmp_path) -> None:
    """Written under a larger --memory-gb: the Get serves it; it stays on disk only."""
    key = "ns/large"
    value = make_value(4, 3 << 20, key=key)
    restarted_store(str(tmp_path), {key: value}).close()
    store = TieredStore(ServerConfig(memory_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 * GIB))
    try:
        found = store.get(key)
        assert found is not None and found.tier == "disk" and bytes(found.data) == value
        assert store.memory.contains([key]) == 0
    finally:
        store.close()


def test_a_restarted_server_serves_disk_values_over_both_paths_and_misses_a_corrupt_one(tmp_path) -> None:
    keys = [f"ns/{i}" for i in range(3)]
    values = {key: make_value(10 + i, 3 << 20, key=key) for i, key in enumerate(keys)}
    args = ("--memory-gb", "0.25", "--disk-path", str(tmp_path), "--disk-gb", "1")
    server = CacheServerProcess(*args).start()
    try:
        with Stubs(server.address) as stubs:
            for key, value in values.items():
                stubs.put(key, value)
        server.stop()
        path = tmp_path / key_to_filename(keys[2])
        with open(path, "r+b") as file:
            file.seek(-1, os.SEEK_END)
            last = file.read(1)
            file.seek(-1, os.SEEK_END)
            file.write(bytes([last[0] ^ 0x80]))
        server.start()
        from storage_backends import create_backend

        bulk = create_backend(f"{server.url}?timeout=60")
        try:
            assert bytes(bulk.get_encoded(keys[0])) == values[keys[0]]  # bulk channel, from disk
            assert bulk.transport != "grpc"
        finally:
            bulk.close()
        with Stubs(server.address) as stubs:
            assert stubs.get(keys[1]) == values[keys[1]]  # gRPC stream, from disk
            assert stubs.get(keys[0]) == values[keys[0]]  # now from memory
            assert status_of(lambda: stubs.get(keys[2])) == grpc.StatusCode.NOT_FOUND
            stats = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=30)
        by_name = {tier_stats.name: tier_stats for tier_stats in stats.tiers}
        assert by_name["disk"].corrupt == 1
        assert by_name["disk"].hits == 2
        assert by_name["memory"].num_keys == 2
    finally:
        server.close()


@pytest.mark.parametrize("flag", ["--disk-direct-io", "--no-disk-direct-io"])
def test_the_disk_io_flag_picks_direct_or_buffered_io_and_stats_count_verified_reads(tmp_path, flag) -> None:
    """A real server: ``--no-disk-direct-io`` makes its disk tier use buffered I/O (on ext4,
    which accepts O_DIRECT, the default takes the direct path), and either way a value read
    back from disk after a restart is verified once, which ``Stats`` and ``kvstash admin
    stats`` show in the disk tier's ``verified``."""
    key = "ns/flagged"
    value = make_value(21, 3 << 20, key=key)
    args = ("--memory-gb", "0.25", "--disk-path", str(tmp_path), "--disk-gb", "1", flag)
    server = CacheServerProcess(*args).start()
    try:
        with Stubs(server.address) as stubs:
            stubs.put(key, value)
        server.stop()
        server.start()  # the memory tier is empty: the next Get reads the disk tier
        expected = "disk (direct I/O)" if flag == "--disk-direct-io" else "disk (buffered I/O)"
        assert f"tiers: memory, {expected}" in server.log()
        with Stubs(server.address) as stubs:
            assert stubs.get(key) == value  # from disk
            assert stubs.get(key) == value  # from memory: no second checksum pass
            stats = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=30)
        by_name = {tier_stats.name: tier_stats for tier_stats in stats.tiers}
        assert by_name["disk"].verified == 1 and by_name["disk"].hits == 1
        assert by_name["memory"].verified == 0
        shown = run_kvstash("admin", "--server", server.address, "stats", "--json")
        assert shown.returncode == 0, shown.stderr
        tiers = {tier["name"]: tier for tier in json.loads(shown.stdout)["tiers"]}
        assert tiers["disk"]["verified"] == 1
        table = run_kvstash("admin", "--server", server.address, "stats")
        assert "verified" in table.stdout
    finally:
        server.close()


def test_buffered_disk_io_is_taken_where_direct_io_would_work(tmp_path) -> None:
    direct = TieredStore(ServerConfig(memory_bytes=1 << 20, disk_path=str(tmp_path / "a"), disk_bytes=GIB))
    buffered = TieredStore(
        ServerConfig(
            memory_bytes=1 << 20, disk_path=str(tmp_path / "b"), disk_bytes=GIB, disk_direct_io=False
        )
    )
    try:
        assert tier(direct, "disk")["direct_io"] is True  # ext4 accepts O_DIRECT
        assert tier(buffered, "disk")["direct_io"] is False
        assert tier(buffered, "disk")["capacity_bytes"] == GIB
    finally:
        direct.close()
        buffered.close()
