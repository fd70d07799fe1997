"""Every KVCache and Admin RPC through the generated client, against the real server process."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from cache_server.memory_tier import entry_size
from protos import kvstash_pb2
from storage_backends.grpc_codec import PIECE_BYTES
from tests.cache_server.helpers import Stubs, put_requests, rpc_error, status_of
from tests.cache_server.server_process import clear_server
from tests.storage_backends.helpers import forge_chunk

MAX_STREAMS = 2
MAX_VALUE_MB = 40


@pytest.fixture(scope="module")
def server():
    process = CacheServerProcess(
        "--memory-gb",
        "0.25",
        "--max-value-mb",
        str(MAX_VALUE_MB),
        "--max-concurrent-streams",
        str(MAX_STREAMS),
    ).start()
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.log()
    process.close()


@pytest.fixture
def stubs(server):
    clear_server(server.address)
    with Stubs(server.address) as stubs:
        yield stubs


def test_a_32_mib_value_round_trips(stubs: Stubs) -> None:
    value = make_value(1, num_bytes=32 << 20, key="ns/big")
    assert len(value) > 32 << 20
    assert stubs.put("ns/big", value).num_bytes == len(value)
    assert stubs.get("ns/big") == value
    info = stubs.admin.Info(kvstash_pb2.InfoRequest(key="ns/big"), timeout=10)
    assert info.size_bytes == len(value) and info.entry.tier == "memory"
    assert info.dtype == "uint8" and list(info.shape) == [1, 2, 16 << 20, 1, 1] and info.layout == "LKTHD"
    assert info.num_tokens == 16 << 20 and info.codec == "none"


def test_get_streams_pieces_no_larger_than_the_piece_size(stubs: Stubs) -> None:
    value = make_value(2, num_bytes=3 * PIECE_BYTES, key="ns/pieces")
    stubs.put("ns/pieces", value)
    responses = list(stubs.kv.Get(kvstash_pb2.GetRequest(key="ns/pieces"), timeout=10))
    assert len(responses) == -(-len(value) // PIECE_BYTES)
    assert all(len(response.data) <= PIECE_BYTES for response in responses)
    assert responses[0].total_size == len(value) and b"".join(r.data for r in responses) == value


def test_contains_counts_the_leading_present_keys(stubs: Stubs) -> None:
    for key in ("ns/0", "ns/1", "ns/3"):
        stubs.put(key, make_value(len(key), key=key))
    keys = ["ns/0", "ns/1", "ns/2", "ns/3"]
    assert stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=keys), timeout=10).num_hits == 2
    assert stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=["ns/2", "ns/0"]), timeout=10).num_hits == 0
    assert stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=[]), timeout=10).num_hits == 0


def test_put_replaces_and_delete_removes(stubs: Stubs) -> None:
    stubs.put("ns/k", make_value(1, key="ns/k"))
    stubs.put("ns/k", make_value(2, num_bytes=100, key="ns/k"))
    assert stubs.get("ns/k") == make_value(2, num_bytes=100, key="ns/k")
    stubs.kv.Delete(kvstash_pb2.DeleteRequest(key="ns/k"), timeout=10)
    error = rpc_error(lambda: stubs.kv.Delete(kvstash_pb2.DeleteRequest(key="ns/k"), timeout=10))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "ns/k" in error.details()
    error = rpc_error(lambda: stubs.get("ns/k"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "key not found" in error.details()


def test_stats_list_info_evict_and_clear(stubs: Stubs) -> None:
    before = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)
    keys_a = [f"model-a/{i:02d}" for i in range(5)]
    for i, key in enumerate([*keys_a, "model-b/00", "model-b/01"]):
        stubs.put(key, make_value(i, key=key))
    stubs.get("model-a/00")
    status_of(lambda: stubs.get("model-a/99"))
    stats = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)
    assert stats.num_puts - before.num_puts == 7
    assert stats.num_gets - before.num_gets == 2 and stats.num_get_hits - before.num_get_hits == 1
    assert stats.version == "kvstash.v1" and stats.uptime_s > 0
    (memory,) = stats.tiers
    assert memory.name == "memory" and memory.num_keys == 7
    # The cap counts each entry's value, key and fixed overhead.
    expected_bytes = sum(
        entry_size(key, len(make_value(i, key=key)))
        for i, key in enumerate([*keys_a, "model-b/00", "model-b/01"])
    )
    assert memory.capacity_bytes == 1 << 28 and memory.bytes_used == expected_bytes

    # Paging: two keys per page, in key order, only under the prefix.
    listed, token, num_pages = [], "", 0
    while True:
        page = stubs.admin.ListKeys(
            kvstash_pb2.ListKeysRequest(prefix="model-a/", page_size=2, page_token=token), timeout=10
        )
        listed.extend((entry.key, entry.tier) for entry in page.entries)
        num_pages += 1
        token = page.next_page_token
        if not token:
            break
    assert listed == [(key, "memory") for key in keys_a] and num_pages == 3
    bad_token = kvstash_pb2.ListKeysRequest(page_token="%%%")
    assert status_of(lambda: stubs.admin.ListKeys(bad_token, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    too_big = kvstash_pb2.ListKeysRequest(page_size=10**6)
    assert status_of(lambda: stubs.admin.ListKeys(too_big, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT

    assert stubs.admin.Info(kvstash_pb2.InfoRequest(key="model-b/00"), timeout=10).size_bytes == len(
        make_value(5, key="model-b/00")
    )
    missing = kvstash_pb2.InfoRequest(key="nope")
    assert status_of(lambda: stubs.admin.Info(missing, timeout=10)) == grpc.StatusCode.NOT_FOUND

    assert stubs.admin.Evict(kvstash_pb2.EvictRequest(key="model-a/00"), timeout=10).num_evicted == 1
    assert stubs.admin.Evict(kvstash_pb2.EvictRequest(prefix="model-a/"), timeout=10).num_evicted == 4
    both = kvstash_pb2.EvictRequest(key="x", prefix="y")
    assert status_of(lambda: stubs.admin.Evict(both, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    remaining = stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10)
    assert [entry.key for entry in remaining.entries] == ["model-b/00", "model-b/01"]
    assert stubs.admin.Clear(kvstash_pb2.ClearRequest(), timeout=10).num_evicted == 2
    assert stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=["model-b/00"]), timeout=10).num_hits == 0


def test_corrupt_truncated_or_foreign_values_are_refused_and_store_nothing(stubs: Stubs) -> None:
    value = bytearray(make_value(3, key="ns/flipped"))
    value[-1] ^= 0x01
    error = rpc_error(lambda: stubs.put("ns/flipped", bytes(value)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in error.details()
    error = rpc_error(lambda: stubs.put("ns/foreign", b"not a chunk at all" * 10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "magic" in error.details()

    def truncated():
        yield kvstash_pb2.PutRequest(key="ns/short", total_size=10_000, data=b"x" * 100)

    error = rpc_error(lambda: stubs.kv.Put(truncated(), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in error.details()
    keys = ["ns/flipped", "ns/foreign", "ns/short"]
    for key in keys:
        assert stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=[key]), timeout=10).num_hits == 0


def test_limits_give_status_codes_with_clear_messages(server, stubs: Stubs) -> None:
    long_key = "k" * 1025
    error = rpc_error(lambda: stubs.put(long_key, make_value(1, key=long_key)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "1025 bytes exceeds" in error.details()
    assert status_of(lambda: stubs.get("")) == grpc.StatusCode.INVALID_ARGUMENT

    # The size is announced in the first message, so an oversized value is refused before it is sent.
    announced = iter([kvstash_pb2.PutRequest(key="ns/huge", total_size=(MAX_VALUE_MB + 1) << 20, data=b"x")])
    error = rpc_error(lambda: stubs.kv.Put(announced, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the limit" in error.details()

    too_many = kvstash_pb2.ContainsRequest(keys=[f"k{i}" for i in range(65537)])
    error = rpc_error(lambda: stubs.kv.Contains(too_many, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "65537 keys" in error.details()

    # Hold MAX_STREAMS Put streams open; one more stream is refused, then the held ones finish.
    release = threading.Event()

    def value_for(key: str) -> bytes:
        return make_value(4, num_bytes=2 * PIECE_BYTES, key=key)

    def held_put(key: str):
        requests = put_requests(key, value_for(key))
        yield next(requests)
        release.wait(30)
        yield from requests

    futures = [stubs.kv.Put.future(held_put(f"ns/held{i}"), timeout=60) for i in range(MAX_STREAMS)]
    try:
        deadline = time.monotonic() + 30
        while stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10).num_active_streams < MAX_STREAMS:
            assert time.monotonic() < deadline, "held streams never reached the server"
            time.sleep(0.05)
        error = rpc_error(lambda: stubs.get("ns/held0"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent streams" in error.details()
    finally:
        release.set()
    assert [future.result().num_bytes for future in futures] == [len(value_for("ns/held0"))] * MAX_STREAMS
    assert stubs.get("ns/held1") == value_for("ns/held1")


def test_bad_requests_leave_the_server_serving_and_leak_nothing(server, stubs: Stubs) -> None:
    details = []
    for call in (
        lambda: stubs.put("", make_value(1, key="")),
        lambda: stubs.kv.Put(iter([]), timeout=10),
        lambda: stubs.put("ns/x", b"\x00" * 64),
        lambda: stubs.kv.Put(iter([kvstash_pb2.PutRequest(key="ns/y", data=b"abc")]), timeout=10),
    ):
        details.append(rpc_error(call).details())
    assert all(detail and "Traceback" not in detail and ".py" not in detail for detail in details), details
    health = health_pb2_grpc.HealthStub(stubs.channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    stubs.put("ns/after", make_value(9, key="ns/after"))
    assert stubs.get("ns/after") == make_value(9, key="ns/after")


def test_hostile_headers_and_misfiled_values_are_invalid_argument_and_store_nothing(stubs: Stubs) -> None:
    """Issue #17 items 2 and 4: checksummed values whose header lies, or that were serialized
    for another key, are refused at Put (before: stored, and Info later failed with INTERNAL)."""
    hostile = {
        "ns/wrapping-shape": forge_chunk(
            (1 << 32, 1 << 32, 1), b"LTH", b"", raw_len=0, key="ns/wrapping-shape"
        ),
        "ns/huge-lz4": forge_chunk(
            (1 << 40,), b"T", b"\x00" * 16, raw_len=1 << 40, codec_code=1, key="ns/huge-lz4"
        ),
        "ns/bad-layout": forge_chunk((2, 3, 4), b"LK", bytes(24), raw_len=24, key="ns/bad-layout"),
        "ns/misfiled": make_value(1, key="ns/elsewhere"),
    }
    for key, value in hostile.items():
        error = rpc_error(lambda key=key, value=value: stubs.put(key, value))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (key, error.details())
    assert stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries == []
    # A sound forged header is stored, and Info describes it.
    stubs.put("ns/sound", forge_chunk((2, 3, 4), b"LTH", bytes(24), raw_len=24, key="ns/sound"))
    info = stubs.admin.Info(kvstash_pb2.InfoRequest(key="ns/sound"), timeout=10)
    assert info.layout == "LTH" and list(info.shape) == [2, 3, 4] and info.num_tokens == 3
