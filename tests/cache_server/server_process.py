"""The real cache server as a child process, for tests: the pytest fixtures over
``benchmarks.support.cache_server_process.CacheServerProcess`` and a few test-only helpers.

Fixtures (imported into ``tests/conftest.py`` so the storage conformance suite
can use them too):

- ``cache_server``: one memory-only server for the whole session.
- ``cache_server_url``: function-scoped; clears that server and returns ``grpc://127.0.0.1:PORT``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from benchmarks.support.cache_server_process import REPO_ROOT, CacheServerProcess, repo_env


def run_cache_server_briefly(*args: str) -> subprocess.CompletedProcess:
    """``python -m cache_server --port 0 ARGS`` run to its exit (bad flags: it must refuse
    them at start) -> the finished process, its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "cache_server", "--port", "0", *args],
        cwd=REPO_ROOT,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def kvstash_command(*args: str) -> list[str]:
    """The ``kvstash`` console command, run from the source tree."""
    return [sys.executable, "-m", "engine.cli", *args]


def clear_server(address: str, metadata: tuple = ()) -> None:
    from protos import kvstash_pb2, kvstash_pb2_grpc
    from storage_backends.grpc_channel import make_channel

    with make_channel(address, secure=False) as channel:
        kvstash_pb2_grpc.AdminStub(channel).Clear(kvstash_pb2.ClearRequest(), timeout=30, metadata=metadata)


@pytest.fixture(scope="session")
def cache_server() -> Iterator[CacheServerProcess]:
    """One memory-only cache server (512 MiB) for the whole session."""
    server = CacheServerProcess("--memory-gb", "0.5").start()
    yield server
    server.close()


@pytest.fixture
def cache_server_url(cache_server: CacheServerProcess) -> str:
    """The session server's ``grpc://`` URL, with every key cleared before the test."""
    clear_server(cache_server.address)
    return cache_server.url


def free_port_for_tests() -> int:
    """A loopback port that nothing listens on (bound and released a moment ago)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
