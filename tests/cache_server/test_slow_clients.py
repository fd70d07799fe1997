"""Clients that try to hold the cache server's slots or memory (issue #17, item 7), against the
real server process: slow-loris hellos and request bodies on the bulk channel, a gRPC Put stream
that goes silent, uploads that announce more than the memory cap can hold."""

from __future__ import annotations

import socket
import threading

import grpc
import psutil
import pytest
from click.testing import CliRunner

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from engine.cli import main
from protos import bulk_wire as wire
from protos import kvstash_pb2, kvstash_pb2_grpc
from storage_backends import create_backend
from tests.cache_server.helpers import Stubs
from tests.waiting import wait_until

MIB = 1 << 20
#: the servers below cut a request after 2 s plus its bytes at 1 MiB/s
REQUEST_TIMEOUT_S = 2.0
NUM_BULK_CONNECTIONS = 8
NUM_STREAMS = 4


@pytest.fixture(scope="module")
def server():
    process = CacheServerProcess(
        "--memory-gb",
        "0.25",
        "--max-bulk-connections",
        str(NUM_BULK_CONNECTIONS),
        "--max-concurrent-streams",
        str(NUM_STREAMS),
        "--request-timeout-s",
        str(REQUEST_TIMEOUT_S),
        "--min-rate-mib-s",
        "1",
    ).start()
    yield process
    process.close()


def stats(stubs: Stubs) -> kvstash_pb2.StatsResponse:
    return stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)


def memory_stats(stubs: Stubs) -> kvstash_pb2.TierStats:
    return next(tier for tier in stats(stubs).tiers if tier.name == "memory")


def bulk_port(stubs: Stubs) -> int:
    return stubs.kv.GetBulkEndpoint(kvstash_pb2.BulkEndpointRequest(), timeout=10).port


class Trickler:
    """Connections that each send ``prefix`` and then one byte of ``filler`` every ``interval_s``
    (each byte well inside any per-recv timeout), until the server closes them or ``stop``."""

    def __init__(self, port: int, num_connections: int, prefix: bytes, interval_s: float = 0.5) -> None:
        self.sockets = []
        for _ in range(num_connections):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if prefix:
                sock.sendall(prefix)
            self.sockets.append(sock)
        self.num_closed_by_server = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._trickle, args=(s, interval_s)) for s in self.sockets]
        for thread in self._threads:
            thread.start()

    def _trickle(self, sock: socket.socket, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                sock.sendall(b"\0")
            except OSError:
                self.num_closed_by_server += 1
                return

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for sock in self.sockets:
            sock.close()


def test_slow_hellos_are_cut_and_their_connection_slots_come_back(server, stubs) -> None:
    """Today's 10 s per-recv hello timeout let every connection slot be held by a byte every 3 s."""
    port = bulk_port(stubs)
    # A hello announcing a 200-byte token, then one token byte every 0.5 s: never silent for
    # long, never finished (it would take 100 s).
    tricklers = Trickler(port, NUM_BULK_CONNECTIONS, wire.HELLO.pack(wire.MAGIC, 200))
    try:
        assert wait_until(
            lambda: tricklers.num_closed_by_server == NUM_BULK_CONNECTIONS, 6 * REQUEST_TIMEOUT_S
        )
        # Every slot is free again: an honest client goes over the bulk channel, not the gRPC fallback.
        backend = create_backend(server.url)
        try:
            backend.put_encoded("ns/honest", make_value(1, key="ns/honest"))
            assert bytes(backend.get_encoded("ns/honest")) == make_value(1, key="ns/honest")
            assert backend.stats()["bulk_failures"] == 0 and backend.stats()["bulk_calls"] >= 2
        finally:
            backend.close()
    finally:
        tricklers.stop()


def test_slow_bulk_put_bodies_are_cut_while_an_honest_client_keeps_working(server, stubs) -> None:
    port = bulk_port(stubs)
    value_len = 4 * MIB  # deadline: 2 s + 4 s at 1 MiB/s; the trickle would take weeks
    key = b"ns/slow"
    hello = wire.HELLO.pack(wire.MAGIC, 0)
    request = wire.REQUEST.pack(wire.OP_PUT, len(key), value_len) + key
    tricklers = Trickler(port, NUM_STREAMS, hello + request)
    try:
        # The slow Puts hold every stream slot for a while...
        assert wait_until(lambda: stats(stubs).num_active_streams == NUM_STREAMS, 10)
        # ...and then the server cuts them and their slots and reserved memory come back.
        assert wait_until(lambda: tricklers.num_closed_by_server == NUM_STREAMS, 6 + 4 * REQUEST_TIMEOUT_S)
        assert wait_until(lambda: stats(stubs).num_active_streams == 0, 5)
        assert memory_stats(stubs).bytes_used == 0  # nothing stored, nothing reserved any more
        stubs.put("ns/honest", make_value(2, key="ns/honest"))
        assert stubs.get("ns/honest") == make_value(2, key="ns/honest")
        with pytest.raises(grpc.RpcError) as missing:
            stubs.get("ns/slow")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        tricklers.stop()


def test_a_bulk_get_that_is_never_read_is_cut(server, stubs) -> None:
    value = make_value(3, 16 * MIB, key="ns/big")  # far more than the socket buffers hold
    stubs.put("ns/big", value)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.settimeout(10)
    sock.connect(("127.0.0.1", bulk_port(stubs)))
    try:
        sock.sendall(wire.HELLO.pack(wire.MAGIC, 0))
        assert wire.read_reply(sock).status == wire.STATUS_OK
        sock.sendall(wire.REQUEST.pack(wire.OP_GET, len(b"ns/big"), 0) + b"ns/big")
        assert wait_until(lambda: stats(stubs).num_active_streams == 1, 10)
        # Never read: the server's send stalls until the Get's deadline (2 s + 16 s) cuts it.
        assert wait_until(lambda: stats(stubs).num_active_streams == 0, 18 + 4 * REQUEST_TIMEOUT_S)
    finally:
        sock.close()


def test_a_grpc_put_that_goes_silent_is_cut_and_frees_its_stream_slot(server, stubs) -> None:
    """Today a Put stream that stops after its first message holds its slot forever."""
    value = make_value(4, 2 * MIB, key="ns/silent")
    silence = threading.Event()

    def first_message_then_silence():
        yield kvstash_pb2.PutRequest(key="ns/silent", total_size=len(value), data=value[:MIB])
        silence.wait(120)

    errors = []

    def put() -> None:
        try:
            stubs.kv.Put(first_message_then_silence(), timeout=120)
        except grpc.RpcError as error:
            errors.append(error)

    threads = [threading.Thread(target=put) for _ in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    try:
        assert wait_until(lambda: len(errors) == NUM_STREAMS, 3 + 4 * REQUEST_TIMEOUT_S)
        assert {error.code() for error in errors} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert "too slow" in errors[0].details()
        assert stats(stubs).num_active_streams == 0 and memory_stats(stubs).bytes_used == 0
        stubs.put("ns/honest", make_value(5, key="ns/honest"))
        assert stubs.get("ns/honest") == make_value(5, key="ns/honest")
    finally:
        silence.set()
        for thread in threads:
            thread.join()


def test_grpc_gets_that_are_never_read_are_cut_and_free_their_stream_slots(server, stubs) -> None:
    """A gRPC Get stream whose client stops reading held its stream slot until the client went
    away (a whole deadline applied to the bulk channel only). A client channel without BDP
    probing keeps its stream windows at 64 KiB, so the server's writes stall at once."""
    value = make_value(9, 16 * MIB, key="ns/unread")
    stubs.put("ns/unread", value)
    reader = grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
    stub = kvstash_pb2_grpc.KVCacheStub(reader)
    calls = []
    try:
        calls += [stub.Get(kvstash_pb2.GetRequest(key="ns/unread"), timeout=120) for _ in range(NUM_STREAMS)]
        for call in calls:
            assert next(call).total_size == len(value)  # started; never read again
        assert wait_until(lambda: stats(stubs).num_active_streams == NUM_STREAMS, 10)
        with pytest.raises(grpc.RpcError) as refused:
            stubs.get("ns/unread")  # every slot held
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Each Get's deadline is 2 s + 16 MiB at 1 MiB/s from its start.
        assert wait_until(lambda: stats(stubs).num_active_streams == 0, 18 + 4 * REQUEST_TIMEOUT_S)
        assert stubs.get("ns/unread") == value  # an honest reader gets the slot and the value
    finally:
        for call in calls:
            call.cancel()
        reader.close()


def test_uploads_in_flight_count_against_the_memory_cap(server, stubs) -> None:
    """6 uploads announcing 200 MiB and stalling after 150 MiB took RSS from 321 to 1,304 MiB on a
    server capped at 0.25 GiB. Now the second announcement is refused before any byte moves."""
    value = make_value(
        8, 200 * MIB, key="ns/huge"
    )  # a valid chunk, so the server keeps the bytes that arrive
    announced = len(value)
    key = b"ns/huge"
    port = bulk_port(stubs)
    process = psutil.Process(server.process.pid)
    rss_before = process.memory_info().rss
    held, refusals = [], []
    try:
        for _ in range(6):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(sock)
            sock.sendall(wire.HELLO.pack(wire.MAGIC, 0))
            assert wire.read_reply(sock).status == wire.STATUS_OK
            sock.sendall(wire.REQUEST.pack(wire.OP_PUT, len(key), announced) + key)
            refusals.append(wire.read_reply(sock))
        statuses = [reply.status for reply in refusals]
        assert statuses[0] == wire.STATUS_OK  # "send it": the room is reserved
        assert statuses[1:] == [grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]] * 5
        assert "uploads in flight" in refusals[1].message
        memory = memory_stats(stubs)  # nothing is stored: bytes_used is the reservation
        assert announced <= memory.bytes_used <= memory.capacity_bytes
        # The same refusal over gRPC.
        with pytest.raises(grpc.RpcError) as refused:
            stubs.put("ns/other", make_value(6, 100 * MIB, key="ns/other"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The first upload sends 150 MiB and stalls (sendall returns once the server has read all
        # but the socket buffers); the server holds that much at most, not 6 x 150 MiB.
        held[0].sendall(memoryview(value)[: 150 * MIB])
        assert process.memory_info().rss - rss_before < 256 * MIB
    finally:
        for sock in held:
            sock.close()
    # Abort: the reservation is released with the connection, and the room is usable again.
    assert wait_until(lambda: memory_stats(stubs).bytes_used == 0, 10)
    assert stats(stubs).num_active_streams == 0
    after = make_value(7, 100 * MIB, key="ns/after")
    stubs.put("ns/after", after)
    assert stubs.get("ns/after") == after


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--min-rate-mib-s", "0", "limit min_rate_bytes_per_s must be positive"),
        ("--request-timeout-s", "-1", "limit request_timeout_s must be positive"),
    ],
)
def test_deadline_flags_must_be_positive(flag: str, value: str, message: str) -> None:
    result = CliRunner().invoke(main, ["cache-server", "--port", "0", flag, value])
    assert result.exit_code == 2 and message in result.output
