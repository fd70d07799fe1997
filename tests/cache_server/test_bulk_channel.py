"""The bulk data channel against the real server process: discovery, round trips, refusals,
garbled and dropped connections, the token, TLS, concurrency, fallback to gRPC and shutdown."""

from __future__ import annotations

import random
import signal
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from protos import bulk_wire as wire
from protos import kvstash_pb2
from storage_backends import BackendError, create_backend
from storage_backends.bulk_channel import BulkClient
from storage_backends.bulk_errors import BulkStatusError, BulkUnavailable
from storage_backends.chunk import ChunkFormatError
from storage_backends.grpc_backend import GrpcBackend
from tests.cache_server.helpers import Stubs
from tests.cache_server.server_process import free_port_for_tests, run_cache_server_briefly
from tests.cache_server.test_auth_tls import tls_files  # noqa: F401 - the module-scoped certificate fixture

MIB = 1 << 20
TOKEN = "bulk-s3cret"


@pytest.fixture(scope="module")
def server():
    """A memory-only server (256 MiB) with a small value limit, so oversize values are cheap to try."""
    process = CacheServerProcess("--memory-gb", "0.25", "--max-value-mb", "40").start()
    yield process
    process.close()


def bulk_port(stubs: Stubs) -> int:
    return stubs.kv.GetBulkEndpoint(
        kvstash_pb2.BulkEndpointRequest(), timeout=10, metadata=stubs.metadata
    ).port


def server_stats(stubs: Stubs) -> kvstash_pb2.StatsResponse:
    return stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10, metadata=stubs.metadata)


def raw_connection(port: int, token: bytes = b"") -> socket.socket:
    """A connection that has passed the HELLO (asserts the server said OK)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(wire.HELLO.pack(wire.MAGIC, len(token)) + token)
    assert wire.read_reply(sock).status == wire.STATUS_OK
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server has closed ``sock`` (reads EOF or a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_grpc_tier_moves_32_mib_values_over_the_bulk_channel(server, stubs) -> None:
    endpoint = stubs.kv.GetBulkEndpoint(kvstash_pb2.BulkEndpointRequest(), timeout=10)
    assert endpoint.port not in (0, server.port) and not endpoint.tls
    assert endpoint.protocol_version == wire.PROTOCOL_VERSION
    value = make_value(1, 32 * MIB, key="ns/big")
    backend = create_backend(server.url)
    try:
        backend.put_encoded("ns/big", value)
        assert bytes(backend.get_encoded("ns/big")) == value
        assert backend.get_encoded("ns/absent") is None
        stats = backend.stats()
        assert stats["bulk_calls"] == 3 and stats["bulk_failures"] == 0
        assert stats["puts"] == 1 and stats["hits"] == 1 and stats["misses"] == 1
    finally:
        backend.close()
    # The gRPC path reads what the bulk path stored, and the server counted the bulk calls.
    assert stubs.get("ns/big") == value
    counters = server_stats(stubs)
    assert counters.num_puts == 1 and counters.bytes_received == len(value)
    assert counters.num_gets == 3 and counters.num_get_hits == 2


def test_refusals_come_before_the_value_and_leave_the_connection_usable(server, stubs) -> None:
    client = BulkClient("127.0.0.1", bulk_port(stubs), token=None, timeout_s=30)
    try:
        cases = [
            (
                "k" * 1025,
                make_value(2, key="k" * 1025),
                wire.STATUS_INVALID_ARGUMENT,
                "exceeds the limit of 1024 bytes",
            ),
            ("", make_value(2, key=""), wire.STATUS_INVALID_ARGUMENT, "empty key"),
            ("ns/huge", b"x" * (41 * MIB), wire.STATUS_INVALID_ARGUMENT, "exceeds the limit"),
            ("ns/short", b"not a chunk", wire.STATUS_INVALID_ARGUMENT, "truncated chunk"),
            # refused at its first 64 KiB; the server still reads the rest to stay in step
            ("ns/junk", b"x" * (5 * MIB), wire.STATUS_INVALID_ARGUMENT, "not a kvstash chunk"),
        ]
        corrupt = bytearray(make_value(3, 3 * MIB, key="ns/corrupt"))
        corrupt[-1] ^= 0xFF
        cases.append(("ns/corrupt", bytes(corrupt), wire.STATUS_INVALID_ARGUMENT, "checksum mismatch"))
        for key, value, code, message in cases:
            with pytest.raises(BulkStatusError) as refused:
                client.put(key, value)
            assert refused.value.code == code and message in refused.value.message, (key, refused.value)
            # The same (pooled) connection serves the next request: the stream stayed in step.
            assert client.put("ns/ok", make_value(4, key="ns/ok")) == len(make_value(4, key="ns/ok"))
        assert client.get("ns/ok") == make_value(4, key="ns/ok")
        with pytest.raises(BulkStatusError) as bad_key:
            client.get("k" * 1025)
        assert bad_key.value.code == wire.STATUS_INVALID_ARGUMENT
    finally:
        client.close()
    listed = stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10)
    assert [entry.key for entry in listed.entries] == ["ns/ok"], "a refused value must store nothing"
    assert server_stats(stubs).num_rejected >= len(cases) + 1


def test_a_value_larger_than_the_memory_tier_is_resource_exhausted() -> None:
    small = CacheServerProcess("--memory-gb", str(2 * MIB / (1 << 30))).start()
    try:
        backend = GrpcBackend(small.address)
        with pytest.raises(BackendError, match="RESOURCE_EXHAUSTED.*larger than the memory tier"):
            backend.put_encoded("ns/k", make_value(5, 3 * MIB, key="ns/k"))
        # A corrupt value is a ValueError for the caller, as over gRPC.
        with pytest.raises(ChunkFormatError, match="refused the value"):
            backend.put_encoded("ns/k", b"garbage")
        assert backend.stats()["bulk_calls"] == 0 and backend.stats()["bulk_failures"] == 0
        backend.close()
    finally:
        small.stop()
        small.close()


def test_garbled_and_dropped_connections_never_reach_the_store_or_stop_the_server(server, stubs) -> None:
    port = bulk_port(stubs)
    # Not a kvstash client: answered and closed.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        reply = wire.read_reply(sock)
        assert reply.status == wire.STATUS_INVALID_ARGUMENT and "not a kvstash bulk client" in reply.message
        assert closed_by_server(sock)
    # An unknown op after a good HELLO: answered and closed.
    with raw_connection(port) as sock:
        sock.sendall(wire.REQUEST.pack(9, 3, 0) + b"key")
        assert wire.read_reply(sock).status == wire.STATUS_INVALID_ARGUMENT
        assert closed_by_server(sock)
    # A Put that stops half way (the client goes away): nothing is stored.
    value = make_value(6, 8 * MIB, key="ns/half")
    with raw_connection(port) as sock:
        sock.sendall(wire.REQUEST.pack(wire.OP_PUT, 7, len(value)) + b"ns/half")
        assert wire.read_reply(sock).status == wire.STATUS_OK
        sock.sendall(value[: len(value) // 2])
    # A header cut short, and random bytes after a good HELLO.
    with raw_connection(port) as sock:
        sock.sendall(b"\x01\x05")
    with raw_connection(port) as sock:
        sock.sendall(bytes(range(256)) * 4)  # op 0, a key of 513 bytes, then more junk
        reply = wire.read_reply(sock)
        assert reply.status == wire.STATUS_INVALID_ARGUMENT and "malformed bulk request" in reply.message
        assert closed_by_server(sock)
    deadline = time.monotonic() + 10
    while server_stats(stubs).num_active_streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_stats(stubs).num_active_streams == 0, "a dropped Put must give its stream slot back"
    assert stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries == []
    assert server.process.poll() is None
    backend = GrpcBackend(server.address)
    value = make_value(6, 8 * MIB, key="ns/after")
    backend.put_encoded("ns/after", value)
    assert bytes(backend.get_encoded("ns/after")) == value and backend.stats()["bulk_calls"] == 2
    backend.close()


def test_concurrent_clients_each_read_back_their_own_values(server, stubs) -> None:
    backend = GrpcBackend(server.address, concurrency=8)
    values = {f"ns/{i}": make_value(100 + i, (i % 4 + 1) * MIB, key=f"ns/{i}") for i in range(24)}

    def round_trip(key: str) -> bool:
        backend.put_encoded(key, values[key])
        return bytes(backend.get_encoded(key)) == values[key]

    try:
        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(round_trip, values))
        stats = backend.stats()
        # Every value went over the bulk channel except the few calls that raced the discovery.
        assert stats["bulk_failures"] == 0 and stats["bulk_calls"] >= 2 * len(values) - 16
    finally:
        backend.close()
    assert server_stats(stubs).num_active_streams == 0


def test_connections_over_the_limit_are_closed_and_their_clients_use_grpc() -> None:
    limited = CacheServerProcess("--memory-gb", "0.1", "--max-bulk-connections", "2").start()
    try:
        with Stubs(limited.address) as stubs:
            port = bulk_port(stubs)
            held = [raw_connection(port), socket.create_connection(("127.0.0.1", port), timeout=10)]
            with pytest.raises(BulkUnavailable):
                BulkClient("127.0.0.1", port, token=None, timeout_s=10).put(
                    "ns/k", make_value(14, key="ns/k")
                )
            backend = GrpcBackend(limited.address)
            backend.put_encoded("ns/k", make_value(14, 2 * MIB, key="ns/k"))
            assert bytes(backend.get_encoded("ns/k")) == make_value(14, 2 * MIB, key="ns/k")
            assert backend.stats()["bulk_calls"] == 0 and backend.stats()["bulk_failures"] == 1
            backend.close()
            for sock in held:
                sock.close()
            assert server_stats(stubs).num_rejected >= 2
            # Once the held connections are gone, new ones are served again.
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert BulkClient("127.0.0.1", port, token=None, timeout_s=10).get("ns/k") == make_value(
                        14, 2 * MIB, key="ns/k"
                    )
                    break
                except BulkUnavailable:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
    finally:
        limited.stop()
        limited.close()


def test_the_token_is_checked_on_connect() -> None:
    secured = CacheServerProcess("--memory-gb", "0.1", "--auth-token", TOKEN).start()
    try:
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        with Stubs(secured.address, metadata=metadata) as stubs:
            port = bulk_port(stubs)
            for token in (None, "wrong", TOKEN + "x"):
                with pytest.raises(BulkStatusError) as refused:
                    BulkClient("127.0.0.1", port, token=token, timeout_s=10).put(
                        "ns/k", make_value(7, key="ns/k")
                    )
                assert refused.value.code == wire.STATUS_UNAUTHENTICATED
                assert refused.value.message == "missing or wrong bearer token"
            with pytest.raises(BackendError, match="refused the auth token"):
                GrpcBackend(secured.address, token="wrong").put_encoded("ns/k", make_value(7, key="ns/k"))
            backend = GrpcBackend(secured.address, token=TOKEN)
            backend.put_encoded("ns/k", make_value(7, key="ns/k"))
            assert bytes(backend.get_encoded("ns/k")) == make_value(7, key="ns/k")
            assert backend.stats()["bulk_calls"] == 2
            backend.close()
            assert server_stats(stubs).num_puts == 1
    finally:
        secured.stop()
        secured.close()


def test_tls_bulk_channel(tls_files) -> None:  # noqa: F811 - the fixture imported above
    cert, key = tls_files
    secure = CacheServerProcess("--memory-gb", "0.1", "--tls-cert", cert, "--tls-key", key).start(tls_ca=cert)
    try:
        backend = create_backend(f"grpcs://{secure.address}?ca={cert}")
        value = make_value(8, 5 * MIB, key="ns/tls")
        backend.put_encoded("ns/tls", value)
        assert bytes(backend.get_encoded("ns/tls")) == value
        assert backend.stats()["bulk_calls"] == 2 and backend.stats()["bulk_failures"] == 0
        port = backend._transport.client().port
        backend.close()
        # A plaintext client on the TLS port gets nowhere, and the server keeps serving.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(wire.HELLO.pack(wire.MAGIC, 0))
            assert closed_by_server(sock)
        # A client that does not trust the certificate cannot connect.
        untrusting = BulkClient(
            "127.0.0.1", port, token=None, timeout_s=10, tls_context=ssl.create_default_context()
        )
        with pytest.raises(BulkUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            untrusting.get("ns/tls")
        again = create_backend(f"grpcs://{secure.address}?ca={cert}")
        assert bytes(again.get_encoded("ns/tls")) == value
        again.close()
    finally:
        secure.stop()
        secure.close()


def test_a_client_can_turn_the_bulk_channel_off(server, stubs) -> None:
    backend = create_backend(f"{server.url}?bulk=off")
    backend.put_encoded("ns/k", make_value(9, 2 * MIB, key="ns/k"))
    assert bytes(backend.get_encoded("ns/k")) == make_value(9, 2 * MIB, key="ns/k")
    assert backend.stats()["bulk_calls"] == 0
    backend.close()
    with pytest.raises(ValueError, match="bulk must be 'on' or 'off'"):
        create_backend(f"{server.url}?bulk=maybe")


def test_off_means_grpc_only() -> None:
    plain = CacheServerProcess("--memory-gb", "0.1", "--bulk-port", "off").start()
    try:
        backend = GrpcBackend(plain.address)
        backend.put_encoded("ns/k", make_value(9, 2 * MIB, key="ns/k"))
        assert bytes(backend.get_encoded("ns/k")) == make_value(9, 2 * MIB, key="ns/k")
        assert backend.stats()["bulk_calls"] == 0
        backend.close()
    finally:
        plain.stop()
        plain.close()


def test_server_killed_mid_transfer_is_an_error_then_a_restart_is_found_again() -> None:
    process = CacheServerProcess("--memory-gb", "0.1")
    process.start()
    backend = GrpcBackend(process.address, timeout_s=10)
    try:
        backend.put_encoded("ns/first", make_value(10, key="ns/first"))
        value = make_value(11, 64 * MIB, key="ns/big")
        failures: list[BaseException] = []

        def put_big() -> None:
            try:
                backend.put_encoded("ns/big", value)
            except BaseException as error:  # noqa: BLE001 - inspected below
                failures.append(error)

        putter = threading.Thread(target=put_big)
        putter.start()
        time.sleep(0.05)
        process.stop(signal.SIGKILL)
        putter.join(30)
        assert not putter.is_alive()
        # Either the value landed before the kill or the call failed cleanly; never a crash.
        assert not failures or isinstance(failures[0], BackendError), failures
        with pytest.raises(BackendError):
            backend.get_encoded("ns/first")
        process.start()  # same gRPC port, a new bulk port
        deadline = time.monotonic() + 30
        while True:
            try:
                backend.put_encoded("ns/again", make_value(12, key="ns/again"))
                break
            except BackendError:
                assert time.monotonic() < deadline, "the tier never reached the restarted server"
                time.sleep(0.2)
        assert bytes(backend.get_encoded("ns/again")) == make_value(12, key="ns/again")
        # After BULK_RETRY_S the tier asks for the new bulk port and uses it again.
        time.sleep(5.2)
        calls_before = backend.stats()["bulk_calls"]
        backend.put_encoded("ns/bulk-again", make_value(13, key="ns/bulk-again"))
        assert backend.stats()["bulk_calls"] == calls_before + 1
    finally:
        backend.close()
        process.close()


def test_pooled_connections_closed_by_a_restart_are_replaced_without_an_error() -> None:
    fixed_port = free_port_for_tests()
    process = CacheServerProcess("--memory-gb", "0.1", "--bulk-port", str(fixed_port))
    process.start()
    try:
        with Stubs(process.address) as stubs:
            assert bulk_port(stubs) == fixed_port
        client = BulkClient("127.0.0.1", fixed_port, token=None, timeout_s=10)
        with ThreadPoolExecutor(3) as pool:  # three pooled connections
            list(pool.map(lambda i: client.put(f"ns/{i}", make_value(i, key=f"ns/{i}")), range(3)))
        assert process.stop() == 0
        process.start()  # same ports, empty
        assert client.put("ns/again", make_value(20, key="ns/again")) == len(make_value(20, key="ns/again"))
        assert client.get("ns/again") == make_value(20, key="ns/again")
        client.close()
    finally:
        process.close()


def test_sigterm_closes_idle_bulk_connections_and_exits_cleanly() -> None:
    process = CacheServerProcess("--memory-gb", "0.1", "--grace-s", "5").start()
    try:
        with Stubs(process.address) as stubs:
            port = bulk_port(stubs)
        idle = raw_connection(port)
        started = time.monotonic()
        assert process.stop() == 0
        assert time.monotonic() - started < 4, "an idle bulk connection must not hold up shutdown"
        assert closed_by_server(idle)
        idle.close()
    finally:
        process.close()


def test_memory_cap_holds_under_bulk_puts_of_random_sizes() -> None:
    """As test_memory_cap, through the bulk channel (the server keeps freed memory for reuse)."""
    cap_bytes = 32 * MIB
    process = CacheServerProcess("--memory-gb", str(cap_bytes / (1 << 30))).start()
    try:
        server_process = psutil.Process(process.process.pid)
        backend = GrpcBackend(process.address)
        backend.put_encoded("ns/warm", make_value(0, 1024, key="ns/warm"))
        baseline_rss = server_process.memory_info().rss
        peak_rss = baseline_rss
        rng = random.Random(0)
        num_puts = 300
        for i in range(num_puts):
            value = make_value(i, rng.randint(4096, 3 * MIB), key=f"ns/{i}")
            backend.put_encoded(f"ns/{i}", value)
            if i % 50 == 49:
                assert backend.stats()["bytes_used"] <= cap_bytes
                peak_rss = max(peak_rss, server_process.memory_info().rss)
        assert bytes(backend.get_encoded(f"ns/{num_puts - 1}")) == value
        stats = backend.stats()
        assert stats["bulk_calls"] >= num_puts and stats["evictions"] > 0
        assert cap_bytes // 2 < stats["bytes_used"] <= cap_bytes
        backend.close()
        growth = peak_rss - baseline_rss
        assert growth < cap_bytes + (64 << 20), f"server RSS grew by {growth >> 20} MiB for a 32 MiB cap"
    finally:
        process.stop()
        process.close()


def test_cli_rejects_a_bad_bulk_port() -> None:
    result = run_cache_server_briefly("--bulk-port", "nine")
    assert result.returncode == 2 and "--bulk-port must be a port number" in result.stderr
