"""Real Redis servers for tests: pytest fixtures over the processes of
``benchmarks.support.redis_process`` (a standalone ``redis-server`` and a 3-master Redis Cluster).

When ``redis-server`` is not installed the fixtures skip, except under CI
(``CI=true``), where a missing server is a failure: CI must not silently skip.

Fixtures (imported into ``tests/conftest.py``):

- ``redis_server``: one session-wide standalone server (``.url`` is ``redis://127.0.0.1:PORT/0``).
- ``redis_url``: function-scoped; flushes ``redis_server`` and returns its URL.
- ``redis_cluster``: one session-wide 3-master cluster (``.url`` is ``redis+cluster://127.0.0.1:PORT``).
- ``redis_cluster_url``: function-scoped; flushes every cluster node and returns the URL.
- ``restartable_redis``: a private standalone server per test, for ``stop()`` / ``restart()`` tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmarks.support.redis_process import (
    RedisClusterProcess,
    RedisServerMissing,
    RedisServerProcess,
    find_redis_server,
)


def require_redis_server() -> str:
    """Return the path of ``redis-server``; skip the test (fail it under CI) when it is missing."""
    try:
        return find_redis_server()
    except RedisServerMissing as missing:
        message = str(missing)
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; CI must not skip Redis tests")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServerProcess]:
    """One standalone redis-server for the whole session (see ``redis_url`` for a flushed one)."""
    require_redis_server()
    server = RedisServerProcess().start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisServerProcess) -> str:
    """The session server's URL, with every key flushed before the test."""
    if redis_server.process is None:  # a test stopped it: bring it back
        redis_server.start()
    redis_server.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterProcess]:
    """One 3-master Redis Cluster for the whole session."""
    require_redis_server()
    cluster = RedisClusterProcess().start()
    yield cluster
    cluster.close()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisClusterProcess) -> str:
    """The session cluster's URL, with every node flushed before the test."""
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture
def restartable_redis() -> Iterator[RedisServerProcess]:
    """A private standalone server that the test may ``stop()`` and ``restart()``."""
    require_redis_server()
    server = RedisServerProcess().start()
    yield server
    server.close()
