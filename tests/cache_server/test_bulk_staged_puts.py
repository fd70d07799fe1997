"""Staged Puts (#16): a client on the server's host writes a single Put's value into a
shared-memory staging area instead of the socket. Against the real server process: the path
is taken and reported, what is stored is the server's own verified copy, bad values and bad
requests are refused with nothing stored and the connection in step, limits, tenants and
the memory cap hold, and a client that stalls is cut and its area freed."""

from __future__ import annotations

import os
import socket
import time

import psutil
import pytest
import torch

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from protos import bulk_wire as wire
from protos import kvstash_pb2
from storage_backends import create_backend
from storage_backends.base import BackendError
from storage_backends.bulk_channel import RING_AREA_BYTES, BulkClient
from storage_backends.bulk_errors import BulkStatusError, BulkUnavailable
from storage_backends.bulk_exchanges import MAX_STAGED_SEGMENT_BYTES, staged_segment_bytes
from storage_backends.chunk import ChunkFormatError, KVChunk
from storage_backends.grpc_backend import GrpcBackend
from storage_backends.staging_area import StagingArea
from tests.cache_server.helpers import Stubs
from tests.waiting import wait_until

MIB = 1 << 20
TOKEN = "tenant-a-token-0123456789"


@pytest.fixture(scope="module")
def server():
    """Memory-only, 256 MiB (areas up to 32 MiB: an eighth of it), 2 s per request beyond the bytes."""
    process = CacheServerProcess("--memory-gb", "0.25", "--request-timeout-s", "2").start()
    yield process
    process.close()


def client_for(
    advertised: kvstash_pb2.BulkEndpointResponse, protocol_version: int | None = None
) -> BulkClient:
    """A bulk client of the advertised endpoint (its Unix socket), speaking its protocol
    version or an older one."""
    return BulkClient(
        "127.0.0.1",
        advertised.port,
        token=None,
        timeout_s=10,
        unix_path=advertised.unix_path,
        protocol_version=protocol_version or advertised.protocol_version,
    )


def endpoint(stubs: Stubs) -> kvstash_pb2.BulkEndpointResponse:
    return stubs.kv.GetBulkEndpoint(kvstash_pb2.BulkEndpointRequest(), timeout=10, metadata=stubs.metadata)


def transports(stubs: Stubs) -> dict[str, kvstash_pb2.TransportStats]:
    reply = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)
    return {path.name: path for path in reply.transports}


def num_puts(paths: dict[str, kvstash_pb2.TransportStats], name: str) -> int:
    return paths[name].num_puts if name in paths else 0


def memory_tier(stubs: Stubs) -> kvstash_pb2.TierStats:
    reply = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)
    return next(tier for tier in reply.tiers if tier.name == "memory")


class RawUnixConnection:
    """One hand-driven bulk connection over the server's Unix socket (HELLO answered)."""

    def __init__(self, stubs: Stubs, token: str = "") -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(endpoint(stubs).unix_path)
        self.sock.sendall(wire.HELLO.pack(wire.MAGIC, len(token)) + token.encode())
        assert wire.read_reply(self.sock).status == wire.STATUS_OK

    def ask_area(self, num_bytes: int) -> tuple[wire.Reply, StagingArea | None]:
        self.sock.sendall(wire.REQUEST.pack(wire.OP_STAGING_AREA, 0, num_bytes))
        reply, fd = wire.read_reply_with_fd(self.sock)
        #: which shared file the server handed over (None: none)
        self.area_inode = os.fstat(fd).st_ino if fd is not None else None
        return reply, (StagingArea.from_fd(fd, reply.value_len) if fd is not None else None)

    def put_staged(self, key: str, num_bytes: int, progress: list[int] | None = None) -> wire.Reply:
        """The request and its progress frames (default: one frame, the whole value), then the reply."""
        counts = [num_bytes] if progress is None else progress
        frames = b"".join(wire.PROGRESS.pack(count) for count in counts)
        self.sock.sendall(wire.REQUEST.pack(wire.OP_PUT_STAGED, len(key.encode()), num_bytes) + key.encode())
        self.sock.sendall(frames)
        return wire.read_reply(self.sock)

    def close(self) -> None:
        self.sock.close()


def write_value(area: StagingArea, value: bytes) -> None:
    area.write([value], len(value), lambda num_bytes: None)


def test_a_single_put_on_the_same_host_goes_through_a_staging_area(server, stubs) -> None:
    value = make_value(1, 3 * MIB, key="ns/staged")
    backend = create_backend(server.url)
    try:
        backend.put_encoded("ns/staged", value)
        assert bytes(backend.get_encoded("ns/staged")) == value
        chunk = KVChunk(torch.arange(1 << 21).to(torch.float16).view(1, 2, 1 << 20, 1, 1))
        backend.put("ns/chunk", chunk)  # a chunk: its header and tensor memory, written in place
        assert torch.equal(backend.get("ns/chunk").tensor, chunk.tensor)
        assert backend.stats()["unix_calls"] == 4
        # the area (4 MiB: the 3 MiB value and its header, rounded up; the 4 MiB chunk with its
        # header went through it as a ring rather than growing it) is reserved on top of the
        # two values
        used_while_open = memory_tier(stubs).bytes_used
        assert used_while_open >= len(value) + 4 * MIB + 4 * MIB
    finally:
        backend.close()
    # its room is released once the connection ended (the area is kept, unreserved, for the
    # tenant's next connection: test below)
    assert wait_until(lambda: used_while_open - memory_tier(stubs).bytes_used >= 4 * MIB, 10)
    paths = transports(stubs)
    assert paths["shm"].num_puts == 2 and paths["shm"].bytes_received > len(value)
    assert paths["unix"].num_puts == 0 and paths["unix"].num_gets == 2


def test_the_stored_value_is_the_servers_own_copy(stubs) -> None:
    """Scribbling on the area after the reply changes nothing stored (the server kept no view
    of the client's memory), and the area is reused by the next Put."""
    connection = RawUnixConnection(stubs)
    try:
        reply, area = connection.ask_area(2 * MIB)
        # (an area kept from an earlier test's connection may be larger than asked)
        assert reply.status == wire.STATUS_OK and area is not None and area.size >= 2 * MIB
        first = make_value(2, MIB, key="ns/first")
        write_value(area, first)
        assert connection.put_staged("ns/first", len(first)).status == wire.STATUS_OK
        write_value(area, bytes(len(first)))  # zeros over the first value
        second = make_value(3, MIB + 5, key="ns/second")
        write_value(area, second)
        assert connection.put_staged("ns/second", len(second)).status == wire.STATUS_OK
        assert stubs.get("ns/first") == first and stubs.get("ns/second") == second
    finally:
        connection.close()


def test_bad_staged_values_and_requests_are_refused_and_store_nothing(stubs) -> None:
    connection = RawUnixConnection(stubs)
    try:
        # a staged Put before any area: refused, its progress frame read, the connection in step
        reply = connection.put_staged("ns/no-area", 1000)
        assert reply.status == wire.STATUS_INVALID_ARGUMENT and "staging area" in reply.message
        reply, area = connection.ask_area(MIB)
        assert reply.status == wire.STATUS_OK
        value = make_value(4, 200_000, key="ns/v")
        corrupt = bytearray(value)
        corrupt[-1] ^= 0xFF
        write_value(area, bytes(corrupt))
        reply = connection.put_staged("ns/v", len(value), progress=[65536, 131072, len(value)])
        assert reply.status == wire.STATUS_INVALID_ARGUMENT and "checksum" in reply.message
        write_value(area, value)
        reply = connection.put_staged("ns/other-key", len(value))  # written for "ns/v"
        assert reply.status == wire.STATUS_INVALID_ARGUMENT and "another key" in reply.message
        reply = connection.put_staged("ns/v", MIB + 1)  # a ring Put (more than the area), of no valid chunk
        assert reply.status == wire.STATUS_INVALID_ARGUMENT
        reply = connection.put_staged("ns/v", 0, progress=[])  # nothing written, no frames
        assert reply.status == wire.STATUS_INVALID_ARGUMENT
        # areas: over the server's limit, or with a key, are refused; the old area is dropped
        assert connection.ask_area(64 * MIB)[0].status == wire.STATUS_INVALID_ARGUMENT
        assert connection.put_staged("ns/v", len(value)).status == wire.STATUS_INVALID_ARGUMENT
        connection.sock.sendall(wire.REQUEST.pack(wire.OP_STAGING_AREA, 1, MIB) + b"k")
        assert wire.read_reply(connection.sock).status == wire.STATUS_INVALID_ARGUMENT
        # still in step: a good staged Put goes through
        reply, area = connection.ask_area(MIB)
        write_value(area, value)
        assert connection.put_staged("ns/v", len(value)).status == wire.STATUS_OK
    finally:
        connection.close()
    keys = [entry.key for entry in stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries]
    assert keys == ["ns/v"] and stubs.get("ns/v") == value


def test_progress_that_goes_back_or_past_the_value_closes_the_connection(server, stubs) -> None:
    value = make_value(5, 300_000, key="ns/p")
    for progress in ([200_000, 100_000, len(value)], [len(value) + 1], [0, len(value)]):
        connection = RawUnixConnection(stubs)
        try:
            _, area = connection.ask_area(MIB)
            write_value(area, value)
            with pytest.raises(ConnectionError):
                connection.put_staged("ns/p", len(value), progress)
        finally:
            connection.close()
    assert stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries == []
    assert wait_until(lambda: memory_tier(stubs).bytes_used == 0, 10)  # nothing stored or reserved
    backend = GrpcBackend(server.address)  # the server still serves
    backend.put_encoded("ns/p", value)
    assert bytes(backend.get_encoded("ns/p")) == value
    backend.close()


def test_areas_are_only_for_the_unix_socket(stubs) -> None:
    sock = socket.create_connection(("127.0.0.1", endpoint(stubs).port), timeout=10)
    try:
        sock.sendall(wire.HELLO.pack(wire.MAGIC, 0))
        assert wire.read_reply(sock).status == wire.STATUS_OK
        sock.sendall(wire.REQUEST.pack(wire.OP_STAGING_AREA, 0, MIB))
        reply, fd = wire.read_reply_with_fd(sock)
        assert reply.status == wire.STATUS_INVALID_ARGUMENT and fd is None
        assert "Unix socket" in reply.message
    finally:
        sock.close()


def test_a_stalled_staged_put_is_cut_and_its_room_freed(stubs) -> None:
    connection = RawUnixConnection(stubs)
    try:
        _, area = connection.ask_area(2 * MIB)
        area_only = memory_tier(stubs).bytes_used
        assert area_only >= 2 * MIB
        value = make_value(6, 2 * MIB - 100, key="ns/slow")
        write_value(area, value)
        key = b"ns/slow"
        connection.sock.sendall(wire.REQUEST.pack(wire.OP_PUT_STAGED, len(key), len(value)) + key)
        connection.sock.sendall(wire.PROGRESS.pack(MIB))  # then nothing more
        # the value's room is reserved meanwhile; cut after 2 s + 2 MiB at 1 MiB/s
        assert memory_tier(stubs).bytes_used >= area_only + len(value)
        assert wait_until(lambda: connection.sock.recv(1) == b"", 15)
    finally:
        connection.close()
    # the value's and the area's room are released (the area is kept for the next connection)
    assert wait_until(lambda: memory_tier(stubs).bytes_used == 0, 10)
    assert stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries == []


def test_values_over_the_area_limit_go_through_it_as_a_ring() -> None:
    """Protocol 4: a value larger than the largest area (1 MiB here) is written through a
    1 MiB area a quarter at a time, the server acknowledging each quarter it copied out; a
    version-3 client streams it instead and remembers the refusal."""
    process = CacheServerProcess("--memory-gb", "0.1", "--max-staging-mb", "1").start()
    try:
        with Stubs(process.address) as stubs:
            backend = GrpcBackend(process.address)
            try:
                small, large = make_value(7, 500_000, key="ns/s"), make_value(8, 3 * MIB, key="ns/l")
                for _ in range(2):
                    backend.put_encoded("ns/l", large)  # refused a 4 MiB area, then a ring of 1 MiB
                backend.put_encoded("ns/s", small)  # fits the 1 MiB area
                assert bytes(backend.get_encoded("ns/l")) == large
                bulk = backend._transport.client()
                assert bulk.num_staged_puts == 3
                with pytest.raises(ChunkFormatError):  # refused in the middle of a ring: in step
                    backend.put_encoded("ns/other", make_value(9, 3 * MIB, key="ns/l"))
                backend.put_encoded("ns/l2", make_value(10, 3 * MIB, key="ns/l2"))
                assert bulk.num_staged_puts == 4
            finally:
                backend.close()
            paths = transports(stubs)
            assert paths["shm"].num_puts == 4 and num_puts(paths, "unix") == 0
            assert "ns/other" not in [
                entry.key for entry in stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries
            ]
            advertised = endpoint(stubs)
            assert advertised.protocol_version == 4
            old_client = client_for(advertised, protocol_version=3)
            try:
                for _ in range(2):  # asks once (refused), then streams
                    assert old_client.put_many([("ns/l", (large,))]) == [len(large)]
                assert old_client.num_staged_puts == 0
            finally:
                old_client.close()
            assert transports(stubs)["unix"].num_puts == 2
        # an area is at most an eighth of the memory tier (12.8 MiB here), whatever the flag
        process.close()
        process = CacheServerProcess("--memory-gb", "0.0625", "--max-staging-mb", "64").start()
        with Stubs(process.address) as stubs:
            connection = RawUnixConnection(stubs)
            try:
                assert connection.ask_area(9 * MIB)[0].status == wire.STATUS_INVALID_ARGUMENT
                assert connection.ask_area(8 * MIB)[0].status == wire.STATUS_OK
            finally:
                connection.close()
    finally:
        process.close()


def test_tenants_hold_for_staged_puts(tmp_path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"- name: a\n  token: {TOKEN}\n  prefixes: [a/]\n")
    process = CacheServerProcess("--memory-gb", "0.0625", "--tenants", str(tenants)).start()
    try:
        backend = GrpcBackend(process.address, token=TOKEN)
        try:
            with pytest.raises(BackendError, match="PERMISSION_DENIED"):
                backend.put_encoded("b/x", make_value(9, MIB, key="b/x"))
            with pytest.raises(ChunkFormatError):
                backend.put_encoded("a/x", make_value(9, MIB, key="a/other"))
            assert backend.get_encoded("a/x") is None
            value = make_value(10, MIB, key="a/x")
            backend.put_encoded("a/x", value)
            assert bytes(backend.get_encoded("a/x")) == value
            assert backend.keys() == ["a/x"]
            assert backend._transport.client().num_staged_puts == 1
        finally:
            backend.close()
        # a connection without the token never gets as far as asking for an area
        with Stubs(process.address, metadata=(("authorization", f"Bearer {TOKEN}"),)) as stubs:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(endpoint(stubs).unix_path)
            sock.sendall(wire.HELLO.pack(wire.MAGIC, 0))
            assert wire.read_reply(sock).status == wire.STATUS_UNAUTHENTICATED
            sock.close()
    finally:
        process.close()


def test_an_ended_connections_area_goes_only_to_its_tenants_next_connection(tmp_path) -> None:
    tenants = tmp_path / "tenants.yaml"
    other_token = "tenant-b-token-0123456789"
    tenants.write_text(
        f"- name: a\n  token: {TOKEN}\n  prefixes: [a/]\n- name: b\n  token: {other_token}\n  prefixes: [b/]\n"
    )
    process = CacheServerProcess("--memory-gb", "0.25", "--tenants", str(tenants)).start()
    try:
        with Stubs(process.address, metadata=(("authorization", f"Bearer {TOKEN}"),)) as stubs:
            first = RawUnixConnection(stubs, TOKEN)
            reply, area = first.ask_area(2 * MIB)
            kept_inode = first.area_inode
            write_value(area, make_value(13, MIB, key="a/1"))
            assert first.put_staged("a/1", len(make_value(13, MIB, key="a/1"))).status == wire.STATUS_OK
            first.close()
            # another tenant never gets it, whenever the server noticed the end
            other = RawUnixConnection(stubs, other_token)
            assert other.ask_area(MIB)[0].status == wire.STATUS_OK and other.area_inode != kept_inode
            other.close()
            # the same tenant's next connection gets it (once the server has seen the end)
            inodes = []
            for _ in range(50):
                again = RawUnixConnection(stubs, TOKEN)
                reply, area = again.ask_area(2 * MIB)
                inodes.append(again.area_inode)
                if again.area_inode == kept_inode:
                    value = make_value(14, MIB + 1, key="a/2")  # and it works as a new one would
                    write_value(area, value)
                    assert again.put_staged("a/2", len(value)).status == wire.STATUS_OK
                    assert stubs.get("a/2") == value
                    again.close()
                    break
                again.close()
                time.sleep(0.1)
            assert inodes[-1] == kept_inode, inodes
    finally:
        process.close()


def test_a_client_on_another_host_never_stages(server, stubs) -> None:
    before = transports(stubs)
    backend = GrpcBackend(server.address, host_id="another-machine/another-boot")
    try:
        value = make_value(11, 2 * MIB, key="ns/remote")
        backend.put_encoded("ns/remote", value)
        assert bytes(backend.get_encoded("ns/remote")) == value
    finally:
        backend.close()
    after = transports(stubs)
    assert num_puts(after, "tcp") - num_puts(before, "tcp") == 1
    assert num_puts(after, "shm") == num_puts(before, "shm")


def test_bulk_client_put_many_of_one_item_is_staged_and_reports_refusals(stubs) -> None:
    advertised = endpoint(stubs)
    client = client_for(advertised)
    try:
        assert client.stages_puts
        value = make_value(12, MIB, key="ns/one")
        assert client.put_many([("ns/one", (value,))]) == [len(value)]
        (outcome,) = client.put_many([("ns/two", (value,))])  # written for "ns/one"
        assert isinstance(outcome, BulkStatusError) and outcome.code == wire.STATUS_INVALID_ARGUMENT
        assert client.num_staged_puts == 1
        assert client.put_many([("ns/one", (value,))]) == [len(value)]  # same connection, in step
        assert client.num_staged_puts == 2
    finally:
        client.close()
    assert os.path.exists(advertised.unix_path)


def test_a_32_mib_chunk_of_an_8b_model_is_staged_through_a_small_ring() -> None:
    """The engine stores 256-token chunks of an 8B model, 32 MiB each: such a Put goes through
    the connection's staging area as a ring of ``RING_AREA_BYTES`` (4 MiB, which stays in the
    CPU's caches; it used to ask for a whole 33 MiB area, and under the old 16 MiB
    ``--max-staging-mb`` it was streamed over the socket), and reads back equal."""
    process = CacheServerProcess("--memory-gb", "0.5").start()
    try:
        with Stubs(process.address) as stubs:
            backend = GrpcBackend(process.address)
            try:
                chunk = KVChunk(torch.rand((32, 2, 256, 8, 128), dtype=torch.bfloat16))
                assert chunk.tensor.nbytes == 32 * MIB
                backend.put("ns/8b-chunk", chunk)
                assert torch.equal(backend.get("ns/8b-chunk").tensor, chunk.tensor)
                bulk = backend._transport.client()
                assert bulk.num_staged_puts == 1
                assert [area.size for area in bulk._staging_areas.values()] == [RING_AREA_BYTES]
                assert RING_AREA_BYTES == 4 * MIB
            finally:
                backend.close()
            paths = transports(stubs)
            assert paths["shm"].num_puts == 1 and paths["shm"].bytes_received > 32 * MIB
            assert num_puts(paths, "unix") == 0
    finally:
        process.close()


@pytest.mark.parametrize("value_bytes", [2 * MIB + 93, 8 * MIB + 93, 32 * MIB + 93, 700 << 10, 5000])
def test_a_staged_value_is_announced_in_even_segments_without_a_sliver_at_the_end(value_bytes: int) -> None:
    """A chunk is a power of two plus its header: its value used to end in a segment of a few
    bytes, one more progress frame (a send, and a wake-up of the server) for 93 bytes. The
    segments are now even: at most 8 of them for values up to 32 MiB, none larger than the
    maximum, the last at least half as large as the others, and every count announced grows
    to exactly the value's length."""
    import mmap

    area = StagingArea(mmap.mmap(-1, 33 * MIB), 33 * MIB)
    value = bytes(range(256)) * (value_bytes // 256) + bytes(value_bytes % 256)
    announced: list[int] = []
    try:
        area.write([value], staged_segment_bytes(value_bytes), announced.append)
        with area.view() as written:
            assert written[:value_bytes] == value
    finally:
        area.close()
    assert announced == sorted(set(announced)) and announced[-1] == value_bytes
    segments = [end - start for start, end in zip([0, *announced], announced, strict=False)]
    assert len(segments) <= max(8, -(-value_bytes // MAX_STAGED_SEGMENT_BYTES))
    assert max(segments) <= MAX_STAGED_SEGMENT_BYTES
    assert min(segments) >= max(segments) // 2


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_client_times_out_on_a_server_that_stops_answering(transport: str) -> None:
    """Over the Unix socket and plain TCP the client's sockets block and the kernel times out
    each call (SO_RCVTIMEO) instead of Python polling before it (a Get's value is then one
    MSG_WAITALL receive): a server that stops answering (here stopped with SIGSTOP, so it
    still accepts connections) still makes a call fail as timed out, on the pooled connection
    without a second try on a new one (that would report "cannot connect"), and a new
    connection whose HELLO goes unanswered as well."""
    import signal

    process = CacheServerProcess("--memory-gb", "0.25").start()
    try:
        with Stubs(process.address) as stubs:
            client = client_for(endpoint(stubs))
        if transport == "tcp":
            client = BulkClient("127.0.0.1", client.port, token=None, timeout_s=10)
        client.timeout_s = 1.0  # new connections only; the ones opened below get it
        value = make_value(13, MIB, key="ns/before-stop")
        try:
            assert client.put_many([("ns/before-stop", (value,))]) == [len(value)]  # pooled, staged
            os.kill(process.process.pid, signal.SIGSTOP)
            try:
                # the signal is delivered asynchronously: a call sent before the server's threads
                # are stopped may still be answered
                assert wait_until(
                    lambda: psutil.Process(process.process.pid).status() == psutil.STATUS_STOPPED, 10
                )
                with pytest.raises(BulkUnavailable, match="bulk transfer with .* timed out"):
                    client.get("ns/before-stop")  # the pooled connection
                (outcome,) = client.put_many([("ns/after-stop", (value,))])  # a new one: HELLO unanswered
                assert isinstance(outcome, BulkUnavailable)
                assert "cannot connect" in str(outcome) and "timed out" in str(outcome)
            finally:
                os.kill(process.process.pid, signal.SIGCONT)
        finally:
            client.close()
    finally:
        process.close()


def test_a_server_that_grants_only_tiny_areas_is_asked_twice_then_values_are_streamed() -> None:
    """A server whose largest area (512 KiB) is smaller than a ring's smallest refuses the
    ring's area a large value asks for first, and a 2 MiB value's own area: the client
    remembers both refusals instead of asking again before every Put, and streams the values."""
    process = CacheServerProcess("--memory-gb", "0.1", "--max-staging-mb", "0.5").start()
    try:
        with Stubs(process.address) as stubs:
            client = client_for(endpoint(stubs))
            asked_bytes: list[int] = []
            ask_area = client._ask_area  # the real request, counted

            def counted_ask(sock: socket.socket, wanted: int):
                asked_bytes.append(wanted)
                return ask_area(sock, wanted)

            client._ask_area = counted_ask
            try:
                for index in range(3):
                    for size in (8 * MIB, 2 * MIB):
                        key = f"ns/{index}-{size}"
                        value = make_value(index, size, key=key)
                        assert client.put_many([(key, (value,))]) == [len(value)]
                        assert bytes(client.get(key)) == value
            finally:
                client.close()
            assert client.num_staged_puts == 0
            assert asked_bytes == [RING_AREA_BYTES, 3 * MIB]
            assert num_puts(transports(stubs), "unix") == 6
    finally:
        process.close()
