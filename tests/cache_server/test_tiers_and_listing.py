"""The cache server's tiered store under issue #17 item 7's findings, mostly against the real
server process: the memory cap counts keys and per-entry overhead, Contains is linear when keys
alternate between memory and disk, ListKeys pages by cursor and fits the message limit, a refused
Put stores nothing, and a Redis that goes down below the server is skipped by every call."""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc
import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import alternating_tiers_server, make_value, put_all
from benchmarks.support.redis_process import RedisServerProcess
from cache_server.config import GIB, ServerConfig
from cache_server.memory_tier import ENTRY_OVERHEAD_BYTES, entry_size
from cache_server.store import TieredStore
from protos import kvstash_pb2
from storage_backends import create_backend
from storage_backends.chunk import ChunkFormatError
from storage_backends.grpc_channel import MAX_MESSAGE_BYTES
from tests.cache_server.helpers import Stubs, run_kvstash
from tests.redis_fixtures import require_redis_server

MIB = 1 << 20
KEY_BYTES = 1024


def long_key(index: int, prefix: str = "ns/") -> str:
    return f"{prefix}{index:06d}/".ljust(KEY_BYTES, "k")


def tier_stats(stubs: Stubs, name: str) -> kvstash_pb2.TierStats:
    stats = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=30)
    return next(tier for tier in stats.tiers if tier.name == name)


def list_all(stubs: Stubs, prefix: str = "", page_size: int = 0) -> tuple[list[tuple[str, str]], int]:
    """Every (key, tier) under ``prefix`` by following the cursor, and the number of pages."""
    listed, token, num_pages = [], "", 0
    while True:
        page = stubs.admin.ListKeys(
            kvstash_pb2.ListKeysRequest(prefix=prefix, page_size=page_size, page_token=token), timeout=30
        )
        num_pages += 1
        listed.extend((entry.key, entry.tier) for entry in page.entries)
        token = page.next_page_token
        if not token:
            return listed, num_pages


# ---- memory accounting ---------------------------------------------------------------------------
def test_the_memory_cap_counts_keys_and_per_entry_overhead() -> None:
    """59,000 tiny values under 1 KiB keys grew RSS by 134 MiB while the tier reported 4.5 MiB."""
    capacity = 4 * MIB
    server = CacheServerProcess("--memory-gb", repr(capacity / GIB)).start()
    try:
        keys = [long_key(i) for i in range(3000)]
        value = make_value(0, num_bytes=64, key=keys[0])
        put_all(server.url, keys, 0, num_threads=1)  # one at a time: no uploads in flight at the end
        with Stubs(server.address) as stubs:
            memory = tier_stats(stubs, "memory")
        per_entry = entry_size(keys[0], len(value))
        assert per_entry == len(value) + KEY_BYTES + ENTRY_OVERHEAD_BYTES
        # Only as many entries as their full cost fits stay; the tier reports that cost.
        assert memory.num_keys == capacity // per_entry
        assert memory.bytes_used == memory.num_keys * per_entry <= capacity
    finally:
        server.close()


# ---- Contains ------------------------------------------------------------------------------------
def test_contains_counts_keys_that_alternate_between_memory_and_disk(tmp_path) -> None:
    keys = [f"ns/{i:05d}" for i in range(200)]
    server = alternating_tiers_server(str(tmp_path), keys, 1)
    try:
        with Stubs(server.address) as stubs:
            listed, _ = list_all(stubs, "ns/")
            assert listed == [(key, "memory" if i % 2 == 0 else "disk") for i, key in enumerate(keys)]

            def contains(query: list[str]) -> int:
                return stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=query), timeout=30).num_hits

            assert contains(keys) == len(keys)
            assert contains([*keys[:77], "ns/absent", *keys[77:]]) == 77
            assert contains(["ns/absent", *keys]) == 0
            assert contains(keys[1::2]) == len(keys) // 2  # disk only
            # Deleting a disk-only key ends the prefix there, wherever the others live.
            stubs.kv.Delete(kvstash_pb2.DeleteRequest(key=keys[151]), timeout=30)
            assert contains(keys) == 151
    finally:
        server.close()


class CountingTier:
    """A real tier that counts the keys each lookup call is handed (the work a call costs)."""

    def __init__(self, tier) -> None:
        self._tier = tier
        self.num_keys_looked_up = 0
        self.num_keys_listed = 0

    def contains(self, keys: Sequence[str]) -> int:
        self.num_keys_looked_up += len(keys)
        return self._tier.contains(keys)

    def present(self, keys: Sequence[str]) -> list[bool]:
        self.num_keys_looked_up += len(keys)
        return self._tier.present(keys)

    def keys(self, prefix: str = "") -> list[str]:
        found = self._tier.keys(prefix)
        self.num_keys_listed += len(found)
        return found

    def keys_page(self, prefix: str, after: str | None, limit: int) -> list[str]:
        found = self._tier.keys_page(prefix, after, limit)
        self.num_keys_listed += len(found)
        return found

    def __getattr__(self, name: str):
        return getattr(self._tier, name)


@pytest.mark.parametrize("num_keys", [256, 2048])
def test_contains_and_list_keys_do_work_linear_in_keys_and_page(tmp_path, num_keys: int) -> None:
    """8x the keys took 34x the time: each step re-sent every remaining key to a tier. The lookups
    a Contains makes are now at most (tiers x keys); a ListKeys page lists at most
    (tiers x (page + 1)) keys however many are stored."""
    config = ServerConfig(memory_bytes=GIB, disk_path=str(tmp_path), disk_bytes=GIB)
    store = TieredStore(config)
    try:
        keys = [f"ns/{i:05d}" for i in range(num_keys)]
        memory, disk = store.tiers
        for i, key in enumerate(keys):
            (memory if i % 2 == 0 else disk).put_encoded(key, make_value(2, num_bytes=64, key=key))
        counted = tuple(CountingTier(tier) for tier in store.tiers)
        store.tiers = counted
        assert store.contains(keys) == num_keys
        assert sum(tier.num_keys_looked_up for tier in counted) <= len(counted) * num_keys

        page, more = store.keys_page("ns/", keys[99], 10)
        assert [key for key, _ in page] == keys[100:110] and more
        assert [tier for _, tier in page] == ["memory" if i % 2 == 0 else "disk" for i in range(100, 110)]
        assert sum(tier.num_keys_listed for tier in counted) <= len(counted) * 11
    finally:
        store.close()


# ---- ListKeys ------------------------------------------------------------------------------------
def test_list_keys_pages_fit_the_message_limit_and_admin_ls_follows_the_cursor() -> None:
    """page_size 10,000 over 1 KiB keys was RESOURCE_EXHAUSTED (the page exceeded 8 MiB)."""
    num_keys = MAX_MESSAGE_BYTES // KEY_BYTES + 500
    server = CacheServerProcess("--memory-gb", "0.25").start()
    try:
        keys = [long_key(i) for i in range(num_keys)]
        put_all(server.url, keys, 3)
        with Stubs(server.address) as stubs:
            first = stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(page_size=10000), timeout=30)
            assert 0 < len(first.entries) < num_keys and first.next_page_token
            listed, num_pages = list_all(stubs, page_size=10000)
            assert [key for key, _ in listed] == keys and num_pages == 2
            # Small pages walk the same keys in order; the cursor survives a write meanwhile.
            small, token = [], ""
            for _ in range(3):
                page = stubs.admin.ListKeys(
                    kvstash_pb2.ListKeysRequest(prefix="ns/0000", page_size=7, page_token=token), timeout=30
                )
                small.extend(entry.key for entry in page.entries)
                token = page.next_page_token
            assert small == keys[:21]
        result = run_kvstash("admin", "--server", server.address, "ls", "--limit", "0", "--json", timeout=120)
        assert result.returncode == 0, result.stderr
        assert [entry["key"] for entry in json.loads(result.stdout)["keys"]] == keys
    finally:
        server.close()


# ---- refused Puts --------------------------------------------------------------------------------
def test_a_put_refused_for_the_disk_tier_stores_nothing(tmp_path) -> None:
    """A value larger than the disk tier was answered INVALID_ARGUMENT and still stored in memory."""
    disk_bytes = MIB
    server = CacheServerProcess(
        "--memory-gb", "0.25", "--disk-path", str(tmp_path), "--disk-gb", repr(disk_bytes / GIB)
    ).start()
    try:
        with Stubs(server.address) as stubs:
            with pytest.raises(grpc.RpcError) as refused:
                stubs.put("ns/too-big", make_value(4, 2 * MIB, key="ns/too-big"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "disk tier" in refused.value.details()
            # Over the bulk channel too (the backend reports the refusal as a bad value).
            backend = create_backend(server.url)
            try:
                with pytest.raises(ChunkFormatError):
                    backend.put_encoded("ns/too-big-bulk", make_value(4, 2 * MIB, key="ns/too-big-bulk"))
                assert backend.get_encoded("ns/too-big") is None
                assert backend.get_encoded("ns/too-big-bulk") is None
            finally:
                backend.close()
            assert list_all(stubs)[0] == []
            assert tier_stats(stubs, "memory").num_keys == 0
            # A value the disk can take is stored in both tiers.
            stubs.put("ns/fits", make_value(5, 64 * 1024, key="ns/fits"))
            assert list_all(stubs)[0] == [("ns/fits", "memory")]
            assert tier_stats(stubs, "disk").num_keys == 1
    finally:
        server.close()


def test_a_value_a_lower_tier_refuses_after_the_size_check_is_stored_nowhere(tmp_path) -> None:
    """The disk tier's file also holds the key and a record header, so a value of exactly the
    disk cap passes the size check and is refused by the disk tier: memory must not keep it."""
    value = make_value(6, 64 * 1024, key="ns/edge")
    store = TieredStore(ServerConfig(memory_bytes=GIB, disk_path=str(tmp_path), disk_bytes=len(value)))
    try:
        with pytest.raises(ValueError, match="disk tier"):
            store.put_verified("ns/edge", value)
        assert store.peek("ns/edge") is None and store.contains(["ns/edge"]) == 0
    finally:
        store.close()


# ---- Redis down ----------------------------------------------------------------------------------
def test_every_call_skips_a_redis_that_went_down() -> None:
    """With Redis down, Contains, Delete, Evict, Clear and ListKeys failed with UNAVAILABLE
    although the memory tier answers; Get already skipped it."""
    require_redis_server()
    redis = RedisServerProcess().start()
    server = CacheServerProcess("--memory-gb", "0.25", "--redis-url", redis.url).start()
    try:
        keys = ["ns/a/0", "ns/a/1", "ns/a/2", "ns/a/3", "ns/b/0", "ns/b/1"]
        with Stubs(server.address) as stubs:
            for i, key in enumerate(keys):
                stubs.put(key, make_value(10 + i, key=key))
            assert tier_stats(stubs, "redis").num_keys == len(keys)
            redis.stop()

            assert stubs.get(keys[0]) == make_value(10, key=keys[0])
            assert stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=keys), timeout=30).num_hits == 6
            listed, _ = list_all(stubs, "ns/", page_size=4)
            assert listed == [(key, "memory") for key in keys]
            stubs.kv.Delete(kvstash_pb2.DeleteRequest(key=keys[0]), timeout=30)
            assert stubs.admin.Evict(kvstash_pb2.EvictRequest(key=keys[1]), timeout=30).num_evicted == 1
            assert stubs.admin.Evict(kvstash_pb2.EvictRequest(prefix="ns/a/"), timeout=30).num_evicted == 2
            assert [key for key, _ in list_all(stubs, "ns/")[0]] == keys[4:]
            assert stubs.admin.Clear(kvstash_pb2.ClearRequest(), timeout=30).num_evicted == 2
            assert list_all(stubs)[0] == []
            assert stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=keys), timeout=30).num_hits == 0
            # Puts still land in memory while Redis is down.
            stubs.put("ns/later", make_value(20, key="ns/later"))
            assert stubs.get("ns/later") == make_value(20, key="ns/later")
    finally:
        server.close()
        redis.close()
