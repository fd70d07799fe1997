"""A grpc:// tier whose server does not answer says so plainly, once (issue 35): a real closed
port, not a server without a bulk channel; and a real server started with ``--bulk-port off``
is still reported as one that answers without a bulk channel."""

from __future__ import annotations

import logging
import socket

import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from storage_backends.base import BackendError
from storage_backends.grpc_backend import GrpcBackend

POLICY_LOGGER = "storage_backends.transport_policy"


def policy_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == POLICY_LOGGER]


def test_an_unreachable_server_is_reported_as_unreachable_once(caplog) -> None:
    caplog.set_level(logging.INFO, logger=POLICY_LOGGER)
    # a port bound and not listening for the whole test: connecting is refused
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        backend = GrpcBackend.from_url(f"grpc://127.0.0.1:{port}?timeout=10")
        try:
            # each call asks for the bulk channel (after the creation's own ask), then fails
            for _ in range(2):
                with pytest.raises(BackendError, match="cannot reach"):
                    backend.get_encoded("ns/k")
                with pytest.raises(BackendError, match="cannot reach"):
                    backend.put_encoded("ns/k", make_value(0, 4096, key="ns/k"))
        finally:
            backend.close()
    lines = policy_lines(caplog)
    assert lines == [
        f"remote tier grpc://127.0.0.1:{port} is unreachable (connection refused); "
        "its chunks are misses until it answers"
    ]
    unreachable = next(r for r in caplog.records if r.name == POLICY_LOGGER)
    assert unreachable.levelno == logging.WARNING


def test_a_server_without_a_bulk_channel_is_not_called_unreachable(caplog) -> None:
    caplog.set_level(logging.INFO, logger=POLICY_LOGGER)
    process = CacheServerProcess("--memory-gb", "0.0625", "--bulk-port", "off").start()
    try:
        backend = GrpcBackend.from_url(process.url)
        try:
            backend.put_encoded("ns/k", make_value(0, 4096, key="ns/k"))
            assert bytes(backend.get_encoded("ns/k")) == make_value(0, 4096, key="ns/k")
        finally:
            backend.close()
    finally:
        process.close()
    assert policy_lines(caplog) == [
        f"grpc tier {process.address}: values move over grpc (the server has no bulk channel)"
    ]
