"""A cache server never shares its ports: a second one started on a taken gRPC or bulk port
exits non-zero with one line naming the port, and the first keeps every connection (gRPC's
default SO_REUSEPORT once let both listen and split clients between two caches)."""

from __future__ import annotations

import asyncio
import re
import socket
import sys

import grpc
import pytest

from benchmarks.support.cache_server_process import REPO_ROOT, CacheServerProcess, repo_env
from cache_server.ports import SERVER_OPTIONS, PortInUseError, check_port_free
from tests.ports import listening_pids, run_to_exit


def run_second_server(*args: str) -> tuple[int, list[str]]:
    """`python -m cache_server ARGS` to its exit -> (exit code, its non-empty output lines)."""
    argv = [sys.executable, "-m", "cache_server", "--host", "127.0.0.1", "--memory-gb", "0.1", *args]
    return run_to_exit(argv, REPO_ROOT, repo_env(), timeout_s=60)


@pytest.fixture(scope="module")
def first_server():
    server = CacheServerProcess("--memory-gb", "0.1", "--heap-reserve-mb", "0").start()
    yield server
    server.close()


def test_a_second_server_on_the_grpc_port_exits_with_one_line(first_server) -> None:
    code, lines = run_second_server("--port", str(first_server.port), "--bulk-port", "any")
    assert code != 0
    assert len(lines) == 1, lines
    assert f"the gRPC port 127.0.0.1:{first_server.port} is already in use" in lines[0]
    assert lines[0].startswith("Error: ")
    assert listening_pids(first_server.port) == {first_server.process.pid}
    first_server.wait_serving()


def test_a_second_server_on_the_bulk_port_exits_with_one_line(first_server) -> None:
    match = re.search(r"bulk channel port (\d+)", first_server.log())
    assert match is not None, first_server.log()
    bulk_port = int(match.group(1))
    code, lines = run_second_server("--port", "0", "--bulk-port", str(bulk_port))
    assert code != 0
    assert len(lines) == 1, lines
    assert f"the bulk port 127.0.0.1:{bulk_port} is already in use" in lines[0]
    assert listening_pids(bulk_port) == {first_server.process.pid}


def test_the_port_check_tells_taken_from_free_ports() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"the gRPC port 127.0.0.1:{port} is already in use"):
            check_port_free("the gRPC port", "127.0.0.1", port)
        check_port_free("the gRPC port", "127.0.0.1", 0)  # 0: any free port
    check_port_free("the gRPC port", "127.0.0.1", port)  # closed: free again


def test_grpc_servers_with_the_server_options_do_not_share_a_port() -> None:
    """The last guard, after the check: gRPC itself refuses to bind a port that a default
    (SO_REUSEPORT) gRPC server already listens on, once SERVER_OPTIONS turn that off."""

    async def bind_twice() -> tuple[bool, int]:
        first = grpc.aio.server()
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            try:
                grpc.aio.server(options=SERVER_OPTIONS).add_insecure_port(f"127.0.0.1:{port}")
                refused = False
            except RuntimeError:
                refused = True
            # without the options gRPC shares the port: what a second cache server used to do
            shared_port = grpc.aio.server().add_insecure_port(f"127.0.0.1:{port}")
            return refused, shared_port == port
        finally:
            await first.stop(None)

    refused, shared = asyncio.run(bind_twice())
    assert refused and shared
