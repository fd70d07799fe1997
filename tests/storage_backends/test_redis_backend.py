"""Redis tier against real servers: cluster sharding, TTL, corrupt values, outages and reconnects."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from benchmarks.support.redis_process import RedisClusterProcess, RedisServerProcess
from storage_backends import BackendError, create_backend
from storage_backends.redis_backend import DEFAULT_KEY_PREFIX, RedisBackend
from tests.storage_backends.helpers import make_chunk

TIMEOUT_S = 1.0


def test_cluster_keys_land_on_several_nodes(
    redis_cluster: RedisClusterProcess, redis_cluster_url: str
) -> None:
    backend = create_backend(redis_cluster_url)
    chunk = make_chunk(1, num_tokens=2)
    keys = [f"ns:{i}" for i in range(30)]
    backend.put_many([(key, chunk) for key in keys])
    assert backend.contains(keys) == len(keys)
    assert all(got.equal(chunk) for got in backend.get_many(keys))
    num_keys_per_node = [redis.Redis(port=port).dbsize() for port in redis_cluster.ports]
    assert sum(num_keys_per_node) == len(keys)
    assert sum(1 for count in num_keys_per_node if count > 0) >= 2, num_keys_per_node
    assert sorted(backend.keys("ns:")) == sorted(keys)  # SCAN covered every node
    backend.close()


def test_ttl_is_set_on_every_value(redis_url: str) -> None:
    backend = create_backend(redis_url + "?ttl=120")
    backend.put_many([("ns:a", make_chunk(1)), ("ns:b", make_chunk(2))])
    client = redis.Redis.from_url(redis_url)
    for key in ("ns:a", "ns:b"):
        assert 0 < client.ttl(DEFAULT_KEY_PREFIX + key) <= 120
    backend.close()


def test_without_ttl_values_do_not_expire(redis_url: str) -> None:
    backend = create_backend(redis_url)
    backend.put("ns:a", make_chunk(1))
    assert redis.Redis.from_url(redis_url).ttl(DEFAULT_KEY_PREFIX + "ns:a") == -1
    backend.close()


def test_lz4_values_are_stored_compressed(redis_url: str) -> None:
    backend = create_backend(redis_url + "?codec=lz4")
    chunk = make_chunk(1, num_tokens=64)
    chunk.tensor.view(-1)[: chunk.tensor.numel() // 2] = 0  # half zeros: compressible
    backend.put("ns:z", chunk)
    stored = redis.Redis.from_url(redis_url).get(DEFAULT_KEY_PREFIX + "ns:z")
    assert len(stored) < chunk.nbytes * 0.75
    assert backend.get("ns:z").equal(chunk)
    backend.close()


def test_a_corrupt_value_is_a_counted_miss_and_is_removed(redis_url: str) -> None:
    backend = create_backend(redis_url)
    backend.put("ns:a", make_chunk(1))
    client = redis.Redis.from_url(redis_url)
    value = bytearray(client.get(DEFAULT_KEY_PREFIX + "ns:a"))
    value[len(value) // 2] ^= 0x01
    client.set(DEFAULT_KEY_PREFIX + "ns:a", bytes(value))
    client.set(DEFAULT_KEY_PREFIX + "ns:foreign", b"not a chunk at all")
    assert backend.get("ns:a") is None
    assert backend.get_many(["ns:foreign"]) == [None]
    assert backend.stats()["corrupt"] == 2
    assert client.exists(DEFAULT_KEY_PREFIX + "ns:a", DEFAULT_KEY_PREFIX + "ns:foreign") == 0
    backend.close()


def test_calls_fail_fast_while_redis_is_down_and_work_again_after_a_restart(
    restartable_redis: RedisServerProcess,
) -> None:
    backend = create_backend(f"{restartable_redis.url}?timeout={TIMEOUT_S}")
    chunk = make_chunk(1)
    backend.put("ns:a", chunk)
    restartable_redis.stop()
    address = f"127.0.0.1:{restartable_redis.port}"
    calls = {
        "get": lambda: backend.get("ns:a"),
        "get_many": lambda: backend.get_many(["ns:a"]),
        "contains": lambda: backend.contains(["ns:a"]),
        "put": lambda: backend.put("ns:b", chunk),
        "delete": lambda: backend.delete("ns:a"),
        "keys": lambda: backend.keys(""),
    }
    for name, call in calls.items():
        started = time.monotonic()
        with pytest.raises(BackendError, match=address):
            call()
        assert time.monotonic() - started < TIMEOUT_S + 0.5, name
    stats = backend.stats()  # never raises: gauges are unknown while Redis is down
    assert stats["reachable"] is False and stats["errors"] >= len(calls)
    restartable_redis.restart()  # same port, empty (nothing is persisted)
    assert backend.get("ns:a") is None
    backend.put("ns:a", chunk)
    assert backend.get("ns:a").equal(chunk)
    assert backend.stats()["reachable"] is True
    backend.close()


def test_a_hung_server_times_out_within_the_configured_timeout(restartable_redis: RedisServerProcess) -> None:
    backend = create_backend(f"{restartable_redis.url}?timeout={TIMEOUT_S}")
    backend.put("ns:a", make_chunk(1))
    os.kill(restartable_redis.process.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        started = time.monotonic()
        with pytest.raises(BackendError, match="Timeout"):
            backend.get("ns:a")
        elapsed = time.monotonic() - started
    finally:
        os.kill(restartable_redis.process.pid, signal.SIGCONT)
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 0.5
    assert backend.get("ns:a") is not None  # the same backend recovers
    backend.close()


def test_key_prefix_separates_tenants(redis_url: str) -> None:
    first = create_backend(redis_url + "?key_prefix=one:")
    second = create_backend(redis_url + "?key_prefix=two:")
    first.put("ns:a", make_chunk(1))
    assert second.get("ns:a") is None and second.keys("") == []
    assert first.keys("") == ["ns:a"]
    first.close()
    second.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:1?timeout=-1", "timeout must be positive"),
        ("redis://127.0.0.1:1?ttl=abc", "not a number"),
        ("redis://127.0.0.1:1?codec=zstd", "unknown codec"),
    ],
)
def test_bad_redis_urls_are_rejected_with_a_clear_message(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisBackend.from_url(url)
