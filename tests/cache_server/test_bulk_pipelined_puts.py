"""Streamed, pipelined Puts over the bulk channel (#16): several values in flight on one
connection without waiting for each reply, each key's outcome reported, refusals storing nothing."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
import torch

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from protos import bulk_wire as wire
from protos import kvstash_pb2
from storage_backends.bulk_channel import BulkClient
from storage_backends.bulk_errors import BulkStatusError, BulkUnavailable
from storage_backends.chunk import ChunkFormatError, KVChunk
from storage_backends.grpc_backend import GrpcBackend
from tests.cache_server.helpers import Stubs

MIB = 1 << 20


@pytest.fixture(scope="module")
def server():
    """A memory-only server (256 MiB) with a 40 MiB value limit."""
    process = CacheServerProcess("--memory-gb", "0.25", "--max-value-mb", "40").start()
    yield process
    process.close()


def bulk_port(stubs: Stubs) -> int:
    endpoint = stubs.kv.GetBulkEndpoint(kvstash_pb2.BulkEndpointRequest(), timeout=10)
    assert endpoint.protocol_version >= 2  # 3 added staged Puts
    return endpoint.port


def stored_keys(stubs: Stubs) -> list[str]:
    return sorted(
        entry.key for entry in stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries
    )


class ReplyGate:
    """A TCP proxy to the bulk port that holds every byte the server sends (after the HELLO
    answer) until the client has sent ``num_bytes`` past its HELLO, or ``timeout_s`` passed.
    ``opened_by_client`` says which: True only when the client sent that much without
    having read a single reply, i.e. it did not wait for replies between values."""

    def __init__(self, target_port: int, num_bytes: int, timeout_s: float = 10.0) -> None:
        self._target_port = target_port
        self._num_bytes = num_bytes
        self._timeout_s = timeout_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._enough = threading.Event()
        self.opened_by_client: bool | None = None
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept_one, daemon=True).start()

    def _accept_one(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self._target_port))
        self._sockets += [client, upstream]
        hello = client.recv(wire.HELLO.size)  # no token
        upstream.sendall(hello)
        client.sendall(_reply(upstream))
        threading.Thread(target=self._client_to_server, args=(client, upstream), daemon=True).start()
        self.opened_by_client = self._enough.wait(self._timeout_s)
        self._pipe(upstream, client)

    def _client_to_server(self, client: socket.socket, upstream: socket.socket) -> None:
        num_forwarded = 0
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 16):
                upstream.sendall(data)
                num_forwarded += len(data)
                if num_forwarded >= self._num_bytes:
                    self._enough.set()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def _reply(sock: socket.socket) -> bytes:
    """One raw reply (header and message) read from ``sock``."""
    head = bytearray(wire.REPLY.size)
    wire.recv_exactly(sock, memoryview(head))
    message = bytearray(wire.REPLY.unpack(head)[1])
    wire.recv_exactly(sock, memoryview(message))
    return bytes(head + message)


def test_puts_on_one_connection_do_not_wait_for_each_reply(server, stubs) -> None:
    keys = [f"ns/pipelined/{i}" for i in range(4)]
    values = [make_value(10 + i, 256 * 1024, key=key) for i, key in enumerate(keys)]
    # Every value and request header must reach the server before any reply is let through.
    gate = ReplyGate(
        bulk_port(stubs), sum(len(v) for v in values) + sum(wire.REQUEST.size + len(k) for k in keys)
    )
    client = BulkClient("127.0.0.1", gate.port, token=None, timeout_s=30, max_connections=1)
    try:
        outcomes = client.put_many([(key, (value,)) for key, value in zip(keys, values, strict=True)])
    finally:
        client.close()
        gate.close()
    assert gate.opened_by_client, "the client waited for a reply before sending the next value"
    assert outcomes == [len(value) for value in values]
    for key, value in zip(keys, values, strict=True):
        assert stubs.get(key) == value


def test_each_key_gets_its_own_outcome_and_a_refused_put_stores_nothing(server, stubs) -> None:
    corrupt = bytearray(make_value(3, 3 * MIB, key="ns/corrupt"))
    corrupt[-1] ^= 0xFF
    items = [
        ("ns/first", make_value(1, 2 * MIB, key="ns/first"), None),
        ("k" * 1025, make_value(2, key="k" * 1025), "exceeds the limit of 1024 bytes"),
        ("ns/corrupt", bytes(corrupt), "checksum mismatch"),
        ("ns/huge", b"x" * (41 * MIB), "exceeds the limit"),  # refused before a byte is read: drained
        ("ns/junk", b"x" * (5 * MIB), "not a kvstash chunk"),  # refused at its header: drained
        ("ns/misfiled", make_value(4, key="ns/other"), "another key"),
        ("ns/last", make_value(5, 3 * MIB, key="ns/last"), None),
    ]
    client = BulkClient(
        "127.0.0.1", bulk_port(stubs), token=None, timeout_s=30, max_connections=1, put_window=3
    )
    try:
        outcomes = client.put_many([(key, (value,)) for key, value, _ in items])
        # All of it went over one connection, which is still in step (pooled, and it works).
        assert len(client._idle) == 1
        assert client.put_many([("ns/after", (make_value(6, key="ns/after"),))]) == [
            len(make_value(6, key="ns/after"))
        ]
    finally:
        client.close()
    for (key, value, message), outcome in zip(items, outcomes, strict=True):
        if message is None:
            assert outcome == len(value), key
        else:
            assert isinstance(outcome, BulkStatusError), (key, outcome)
            assert outcome.code == wire.STATUS_INVALID_ARGUMENT and message in outcome.message, (key, outcome)
    assert stored_keys(stubs) == ["ns/after", "ns/first", "ns/last"]
    assert stubs.get("ns/last") == items[-1][1]


def test_a_parts_callable_that_raises_fails_only_its_own_key(server, stubs) -> None:
    def broken() -> tuple[bytes, ...]:
        raise ValueError("cannot serialize this one")

    good = make_value(7, key="ns/good")
    client = BulkClient("127.0.0.1", bulk_port(stubs), token=None, timeout_s=30)
    try:
        outcomes = client.put_many([("ns/broken", broken), ("ns/good", lambda: (good,))])
    finally:
        client.close()
    assert isinstance(outcomes[0], ValueError) and outcomes[1] == len(good)
    assert stored_keys(stubs) == ["ns/good"]


def test_a_connection_that_fails_mid_pipeline_reports_the_unanswered_keys_as_unavailable(
    server, stubs
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def hello_then_hang_up() -> None:
        conn, _ = listener.accept()
        conn.recv(wire.HELLO.size)
        conn.sendall(wire.encode_reply(wire.STATUS_OK, "instance"))
        conn.recv(1 << 16)
        conn.close()

    threading.Thread(target=hello_then_hang_up, daemon=True).start()
    client = BulkClient("127.0.0.1", listener.getsockname()[1], token=None, timeout_s=10)
    try:
        values = [make_value(i, MIB, key=f"ns/{i}") for i in range(3)]
        outcomes = client.put_many([(f"ns/{i}", (value,)) for i, value in enumerate(values)])
    finally:
        client.close()
        listener.close()
    assert all(isinstance(outcome, BulkUnavailable) for outcome in outcomes), outcomes


def test_the_grpc_tier_pipelines_put_many_and_raises_the_refusal(server, stubs) -> None:
    backend = GrpcBackend(server.address, bulk_connections=2)
    chunks = [(f"ns/chunk/{i}", KVChunk(torch.full((2, 2, 64, 2, 8), float(i)))) for i in range(6)]
    try:
        backend.put_many(chunks)
        for key, chunk in chunks:
            assert backend.get(key).equal(chunk)
        with pytest.raises(ChunkFormatError, match="refused the value for 'ns/bad'"):
            backend.put_encoded_many([("ns/ok", make_value(8, key="ns/ok")), ("ns/bad", b"not a chunk")])
        with pytest.raises(ValueError, match="empty value"):
            backend.put_encoded_many([("ns/empty", b""), ("ns/never", make_value(9, key="ns/never"))])
        stats = backend.stats()
        assert stats["bulk_failures"] == 0 and stats["grpc_calls"] == 0
    finally:
        backend.close()
    keys = stored_keys(stubs)
    assert "ns/ok" in keys and "ns/bad" not in keys and "ns/never" not in keys
