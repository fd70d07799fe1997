"""The grpc:// tier's fast paths against the real server process: the Unix socket chosen on the
same host (and TCP when the identity differs or the socket is gone), the pool of bulk
connections, ``get_into`` (the value lands in the caller's buffer; a value corrupted on the
way is a miss) and concurrent callers, plus the per-path counters of ``Stats``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from protos import kvstash_pb2
from storage_backends import create_backend
from storage_backends.bulk_channel import BulkClient
from storage_backends.chunk import ChunkFormatError, KVChunk
from storage_backends.chunk_receiver import fresh_tensor
from storage_backends.grpc_backend import GrpcBackend
from tests.cache_server.helpers import Stubs
from tests.cache_server.server_process import free_port_for_tests

MIB = 1 << 20


@pytest.fixture(scope="module")
def server():
    process = CacheServerProcess("--memory-gb", "0.25").start()
    yield process
    process.close()


def kv_chunk(seed: int, num_tokens: int = 256) -> KVChunk:
    """A bf16 chunk [layers=2, 2, tokens, heads=4, dim=64] (64 KiB per 64 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return KVChunk(torch.randn(2, 2, num_tokens, 4, 64, generator=generator).to(torch.bfloat16))


def endpoint(stubs: Stubs) -> kvstash_pb2.BulkEndpointResponse:
    return stubs.kv.GetBulkEndpoint(kvstash_pb2.BulkEndpointRequest(), timeout=10)


def transports(stubs: Stubs) -> dict[str, kvstash_pb2.TransportStats]:
    reply = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)
    return {path.name: path for path in reply.transports}


def test_a_client_on_the_same_host_uses_the_unix_socket_and_says_so(server, stubs, caplog) -> None:
    advertised = endpoint(stubs)
    assert advertised.unix_path and os.path.exists(advertised.unix_path) and advertised.host_id
    value = make_value(1, 3 * MIB, key="ns/a")
    caplog.set_level(logging.INFO, logger="storage_backends.transport_policy")
    backend = create_backend(server.url)
    try:
        backend.put_encoded("ns/a", value)
        assert bytes(backend.get_encoded("ns/a")) == value
        stats = backend.stats()
        assert stats["transport"] == "unix"
        assert stats["unix_calls"] == 2 and stats["tcp_calls"] == 0 and stats["grpc_calls"] == 0
    finally:
        backend.close()
    chosen = [record.getMessage() for record in caplog.records if "values move over" in record.getMessage()]
    assert chosen == [f"grpc tier {server.address}: values move over unix ({advertised.unix_path})"]
    paths = transports(stubs)
    # a single Put's value went through a shared-memory staging area (test_bulk_staged_puts.py)
    assert paths["shm"].num_puts == 1 and paths["unix"].num_gets == 1
    assert paths["shm"].bytes_received == len(value) == paths["unix"].bytes_sent
    assert "tcp" not in paths


def test_another_host_identity_or_local_off_uses_tcp(server, stubs) -> None:
    value = make_value(2, MIB, key="ns/t")
    for backend in (
        GrpcBackend(server.address, host_id="another-machine/another-boot"),
        GrpcBackend(server.address, host_id=""),  # identity unknown here: never "same host"
        create_backend(f"{server.url}?local=off"),
    ):
        try:
            backend.put_encoded("ns/t", value)
            assert bytes(backend.get_encoded("ns/t")) == value
            stats = backend.stats()
            assert stats["transport"] == "tcp" and stats["tcp_calls"] == 2 and stats["unix_calls"] == 0
        finally:
            backend.close()
    assert transports(stubs)["tcp"].num_puts == 3


def test_a_socket_that_is_gone_falls_back_to_tcp() -> None:
    process = CacheServerProcess("--memory-gb", "0.1").start()
    try:
        with Stubs(process.address) as stubs:
            path = endpoint(stubs).unix_path
            os.unlink(path)  # e.g. a temp cleaner removed it; the server keeps serving TCP
            backend = GrpcBackend(process.address)
            backend.put_encoded("ns/k", make_value(3, key="ns/k"))
            assert bytes(backend.get_encoded("ns/k")) == make_value(3, key="ns/k")
            assert backend.transport == "tcp" and backend.stats()["tcp_calls"] == 2
            backend.close()
            # A file at the path that is not the server's socket: connecting fails, TCP is used.
            with open(path, "w") as impostor:
                impostor.write("not a socket")
            backend = GrpcBackend(process.address)
            assert (
                bytes(backend.get_encoded("ns/k")) == make_value(3, key="ns/k") and backend.transport == "tcp"
            )
            backend.close()
            os.unlink(path)
    finally:
        process.stop()
        process.close()


def test_a_socket_of_another_server_at_the_advertised_path_is_not_used(server, stubs, tmp_path) -> None:
    other = CacheServerProcess("--memory-gb", "0.1", "--bulk-socket", str(tmp_path / "other.sock")).start()
    process = CacheServerProcess("--memory-gb", "0.1").start()
    try:
        with Stubs(process.address) as own_stubs:
            path = endpoint(own_stubs).unix_path
        os.unlink(path)
        os.symlink(tmp_path / "other.sock", path)  # the path now leads to the other server
        backend = GrpcBackend(process.address)
        backend.put_encoded("ns/mine", make_value(4, key="ns/mine"))
        assert backend.transport == "tcp" and backend.stats()["tcp_calls"] == 1
        backend.close()
        with Stubs(other.address) as other_stubs:
            assert other_stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries == []
        os.unlink(path)
    finally:
        process.stop()
        process.close()
        other.stop()
        other.close()


def test_bad_url_parameters_are_refused(server) -> None:
    for query, message in (
        ("local=maybe", "local must be 'auto' or 'off'"),
        ("bulk_connections=0", "bulk_connections must be a positive integer"),
        ("bulk_connections=many", "bulk_connections must be a positive integer"),
        ("concurrency=-1", "concurrency must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            create_backend(f"{server.url}?{query}")


def server_connections_to(process: CacheServerProcess, port: int) -> int:
    connections = psutil.Process(process.process.pid).net_connections(kind="tcp")
    return sum(1 for c in connections if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_get_many_and_put_many_spread_over_the_pool_of_bulk_connections(server, stubs) -> None:
    bulk_port = endpoint(stubs).port
    backend = create_backend(f"{server.url}?local=off&bulk_connections=3&concurrency=8")
    chunks = [(f"ns/{i}", kv_chunk(i, 128)) for i in range(24)]
    try:
        backend.put_many(chunks)
        got = backend.get_many([key for key, _ in chunks])
        assert all(
            chunk is not None and chunk.equal(original)
            for chunk, (_, original) in zip(got, chunks, strict=True)
        )
        client = backend._transport.client()
        # Eight callers at once shared three connections: all three were opened and reused, no more.
        assert client.max_connections == 3 and len(client._idle) == 3
        assert server_connections_to(server, bulk_port) == 3
        assert backend.stats()["tcp_calls"] == 48 and backend.stats()["bulk_failures"] == 0
    finally:
        backend.close()


def test_get_into_lands_the_value_in_the_callers_buffer(server, stubs) -> None:
    backend = GrpcBackend(server.address)
    original = kv_chunk(5, 256)
    try:
        backend.put("ns/kv", original)
        out = torch.empty(2 * original.tensor.numel(), dtype=torch.bfloat16)  # a larger slot
        chunk = backend.get_into("ns/kv", out)
        assert chunk is not None and chunk.equal(original)
        assert chunk.tensor.data_ptr() == out.data_ptr(), "the value must land in the caller's buffer"
        assert torch.equal(out[: original.tensor.numel()].view(original.tensor.shape), original.tensor)
        assert backend.get_into("ns/absent", out) is None
        # A buffer that cannot hold the value: a clear error, and the connection stays in step.
        with pytest.raises(ValueError, match="the buffer has 10 of torch.bfloat16"):
            backend.get_into("ns/kv", torch.empty(10, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="of torch.float32"):
            backend.get_into("ns/kv", torch.empty(out.numel(), dtype=torch.float32))
        assert backend.get_into("ns/kv", out).equal(original)
        stats = backend.stats()
        assert stats["hits"] == 2 and stats["misses"] == 1 and stats["bulk_failures"] == 0
        assert stats["unix_calls"] == 6  # the put and five reads, refused ones included
        # lz4 chunks arrive compressed and are decompressed into the buffer.
        compressed = GrpcBackend(server.address, codec="lz4")
        zeros = KVChunk(torch.zeros(2, 2, 64, 4, 64, dtype=torch.bfloat16))
        compressed.put("ns/lz4", zeros)
        out.fill_(1)
        assert compressed.get_into("ns/lz4", out).equal(zeros)
        compressed.close()
    finally:
        backend.close()


def test_get_into_over_grpc_when_the_bulk_channel_is_off(server, stubs) -> None:
    backend = create_backend(f"{server.url}?bulk=off")
    original = kv_chunk(6, 64)
    try:
        backend.put("ns/g", original)
        out = torch.empty(original.tensor.numel(), dtype=torch.bfloat16)
        assert backend.get_into("ns/g", out).equal(original)
        assert backend.get_into("ns/none", out) is None
        stats = backend.stats()
        assert stats["transport"] == "grpc" and stats["grpc_calls"] == 3 and stats["bulk_calls"] == 0
    finally:
        backend.close()
    assert transports(stubs)["grpc"].num_gets == 1


class FlippingProxy:
    """Forwards ``host:port`` → ``127.0.0.1:port`` for each port; on the ports in ``flip_ports``
    it flips one byte of the server's reply stream at ``flip_offset``, once per connection."""

    def __init__(self, host: str, ports: list[int], flip_ports: set[int], flip_offset: int) -> None:
        self.host = host
        self._flip_ports = flip_ports
        self._flip_offset = flip_offset
        self._sockets: list[socket.socket] = []
        for port in ports:
            listener = socket.create_server((host, port))
            self._sockets.append(listener)
            threading.Thread(target=self._accept, args=(listener, port), daemon=True).start()

    def _accept(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            self._sockets += [client, upstream]
            flip = self._flip_offset if port in self._flip_ports else None
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, flip), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, flip_offset: int | None) -> None:
        position = 0
        try:
            while data := source.recv(1 << 16):
                if flip_offset is not None and position <= flip_offset < position + len(data):
                    data = bytearray(data)
                    data[flip_offset - position] ^= 0x01
                position += len(data)
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def test_a_value_corrupted_on_the_way_is_a_miss_and_the_next_read_is_intact() -> None:
    bulk_port = free_port_for_tests()
    process = CacheServerProcess("--memory-gb", "0.1", "--bulk-port", str(bulk_port)).start()
    proxy = None
    try:
        # The client reaches the server through 127.0.0.2, where the proxy flips one byte of each
        # bulk connection's first value (well past the reply headers, inside the payload).
        proxy = FlippingProxy("127.0.0.2", [process.port, bulk_port], {bulk_port}, flip_offset=300_000)
        original = kv_chunk(7, 256)  # 512 KiB
        backend = GrpcBackend(f"127.0.0.2:{process.port}", local=False, bulk_connections=1)
        backend.put("ns/c", original)
        out = torch.empty(original.tensor.numel(), dtype=torch.bfloat16)
        assert backend.get_into("ns/c", out) is None
        stats = backend.stats()
        assert stats["corrupt"] == 1 and stats["hits"] == 0 and stats["bulk_failures"] == 0
        # the same connection (one in the pool) is in step: the proxy flips only its first value
        assert backend.get_into("ns/c", out).equal(original)
        assert backend.stats()["tcp_calls"] == 3
        backend.close()
        # get() receives into a new tensor the same way: the corrupt value is a miss too.
        backend = GrpcBackend(f"127.0.0.2:{process.port}", local=False, bulk_connections=1)
        assert backend.get("ns/c") is None and backend.stats()["corrupt"] == 1
        assert backend.get("ns/c").equal(original)
        backend.close()
        # The bulk client itself reports the corrupt value as ChunkFormatError.
        client = BulkClient("127.0.0.2", bulk_port, token=None, timeout_s=10)
        with pytest.raises(ChunkFormatError, match="checksum mismatch"):
            client.get_chunk("ns/c", fresh_tensor)
        client.close()
    finally:
        if proxy is not None:
            proxy.close()
        process.stop()
        process.close()


def test_concurrent_get_into_each_caller_gets_its_own_value(server, stubs) -> None:
    backend = GrpcBackend(server.address, bulk_connections=3)
    chunks = {f"ns/{i}": kv_chunk(100 + i, 64 * (i % 4 + 1)) for i in range(24)}
    backend.put_many(list(chunks.items()))
    slots = {key: torch.empty(4 * 64 * 2 * 2 * 4 * 64, dtype=torch.bfloat16) for key in chunks}

    def read(key: str) -> bool:
        chunk = backend.get_into(key, slots[key])
        return (
            chunk is not None
            and chunk.equal(chunks[key])
            and chunk.tensor.data_ptr() == slots[key].data_ptr()
        )

    try:
        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(read, list(chunks) * 2))
        assert backend.stats()["unix_calls"] == 72 and backend.stats()["bulk_failures"] == 0
    finally:
        backend.close()


def test_the_socket_path_can_be_chosen_and_a_stale_one_is_replaced(tmp_path) -> None:
    path = str(tmp_path / "kv.sock")
    first = CacheServerProcess("--memory-gb", "0.1", "--bulk-socket", path).start()
    try:
        with Stubs(first.address) as stubs:
            assert endpoint(stubs).unix_path == path
        # A second server cannot take a socket that is in use: a clear error, exit 1.
        second = CacheServerProcess("--memory-gb", "0.1", "--bulk-socket", path)
        with pytest.raises(RuntimeError, match="is in use by another process"):
            second.start()
        second.close()
        first.stop(signal.SIGKILL)  # leaves the socket file behind
        assert os.path.exists(path)
        first.start()
        backend = GrpcBackend(first.address)
        backend.put_encoded("ns/k", make_value(9, key="ns/k"))
        assert backend.transport == "unix" and bytes(backend.get_encoded("ns/k")) == make_value(9, key="ns/k")
        backend.close()
        assert first.stop() == 0
        assert not os.path.exists(path), "a clean stop removes the socket"
    finally:
        first.close()


def test_a_bulk_socket_path_that_is_not_a_socket_is_refused_at_start(tmp_path) -> None:
    from tests.cache_server.server_process import run_cache_server_briefly

    regular = tmp_path / "data.txt"
    regular.write_text("keep me")
    for path, message in ((str(regular), "exists and is not a socket"), (" ", "bulk socket path is empty")):
        result = run_cache_server_briefly("--bulk-socket", path)
        assert result.returncode != 0 and message in result.stderr, result.stderr
    assert regular.read_text() == "keep me", "a refused path must be left alone"


@pytest.mark.gpu
def test_get_into_a_pinned_slot_then_to_the_device(server, stubs) -> None:
    """The engine's path: the value lands in a pinned CPU slot, then one host→device copy."""
    backend = GrpcBackend(server.address)
    original = kv_chunk(11, 256)
    try:
        backend.put("ns/pinned", original)
        slot = torch.empty(original.tensor.numel(), dtype=torch.bfloat16, pin_memory=True)
        chunk = backend.get_into("ns/pinned", slot)
        assert chunk is not None and chunk.tensor.data_ptr() == slot.data_ptr() and chunk.tensor.is_pinned()
        on_device = chunk.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), original.tensor)
    finally:
        backend.close()


def test_a_new_tier_opens_its_bulk_channel_before_its_first_call(server, stubs) -> None:
    """The tier finds and opens the bulk channel on a thread of its own when it is created, so
    its first Put pays neither GetBulkEndpoint nor the first connection (it used to, on the
    caller's thread: 2 to 9 ms)."""
    backend = create_backend(server.url)
    try:
        deadline = time.monotonic() + 20
        while backend.transport != "unix":
            assert time.monotonic() < deadline, "no bulk channel before the first call"
            time.sleep(0.01)
        value = make_value(2, MIB, key="ns/ahead")
        backend.put_encoded("ns/ahead", value)
        assert bytes(backend.get_encoded("ns/ahead")) == value
        stats = backend.stats()
        assert stats["unix_calls"] == 2 and stats["grpc_calls"] == 0 and stats["bulk_failures"] == 0
    finally:
        backend.close()
    # A tier closed while it is still looking for its channel ends that search and keeps nothing open.
    closed_early = GrpcBackend(server.address)
    closed_early.close()
    closed_early._discovery_thread.join(timeout=20)
    assert not closed_early._discovery_thread.is_alive()
    assert closed_early.transport == "grpc"
