"""The Redis fixtures start real servers: a standalone one that survives a restart and a 3-master cluster."""

from __future__ import annotations

import pytest
import redis
from redis.cluster import RedisCluster

from benchmarks.support.redis_process import RedisClusterProcess, RedisServerProcess
from tests.redis_fixtures import require_redis_server


def test_redis_url_is_flushed_between_tests(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("left-behind", b"x")  # the next test's flush must remove it


def test_redis_url_is_flushed_between_tests_again(redis_url: str) -> None:
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_restartable_redis_comes_back_on_the_same_port(restartable_redis: RedisServerProcess) -> None:
    port = restartable_redis.port
    client = redis.Redis.from_url(restartable_redis.url, socket_timeout=2)
    client.set("k", b"v")
    restartable_redis.stop()
    try:
        client.ping()
        raise AssertionError("a stopped server answered PING")
    except redis.ConnectionError:
        pass
    restartable_redis.restart()
    assert restartable_redis.port == port
    assert client.ping() is True
    assert client.get("k") is None  # nothing is persisted across restarts


def test_cluster_has_three_masters_and_is_ok(redis_cluster: RedisClusterProcess) -> None:
    assert redis_cluster.url.startswith("redis+cluster://127.0.0.1:")
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    masters = [node for node in client.get_nodes() if node.server_type == "primary"]
    assert len(masters) == 3
    assert client.cluster_info()["cluster_state"] == "ok"
    client.close()


def test_missing_redis_server_skips_locally_and_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no redis-server on PATH
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="redis-server/redis-cli not found"):
        require_redis_server()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must not skip"):
        require_redis_server()
