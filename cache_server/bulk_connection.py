"""One bulk connection on the cache server: its state, and the reads its requests make.

:class:`BulkConnection` is what ``cache_server.bulk_server.BulkServer`` knows of each client
connection (transport, tenant, deadline, staging area); the functions read a request's key,
a Put's value (straight into a :class:`~cache_server.value_assembly.ValueAssembler`) or the
rest of a refused value, and :class:`StagedProgress` reads a staged Put's progress frames
(``protos.bulk_wire.PROGRESS``). A client that breaks the wire format gets a
:class:`ProtocolError` (the server closes its connection); one that closes early, a
ConnectionError.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import grpc

from cache_server.service import RequestError
from cache_server.staging_pool import HeldArea
from cache_server.tenants import OPEN_ACCESS, Tenant
from cache_server.value_assembly import ValueAssembler
from protos import bulk_wire as wire
from storage_backends.chunk import ChunkFormatError

#: most bytes asked of one recv_into (the checksum then runs over them while they are in cache)
RECV_BYTES = 1 << 20


class ProtocolError(Exception):
    """The client broke the wire format; the connection is answered (when possible) and closed."""


@dataclass(eq=False)  # identity hashing: kept in a set
class BulkConnection:
    """One client connection to the bulk port or socket, as its server thread and the
    server's watchdog and ``stop`` see it (they share it under the server's lock)."""

    sock: socket.socket
    #: "tcp" or "unix" (per-path counters)
    transport: str
    #: True while a request is being served (stop() lets it finish within the grace period)
    busy: bool = False
    #: whose token the HELLO carried (set once the HELLO is accepted)
    tenant: Tenant = OPEN_ACCESS
    #: time.monotonic() by which the current phase (hello, request) must end; None while idle
    deadline: float | None = None
    #: the shared-memory staging area this connection's client writes values into (Unix
    #: only), with its descriptor and reserved room
    staging: HeldArea | None = None


class StagedProgress:
    """The progress frames of one staged Put (``bulk_wire.PROGRESS``): how many bytes of
    its value the client has written to the staging area so far. Counts must grow and end at
    exactly the value's length; anything else is a ProtocolError (the connection is closed)."""

    #: most bytes asked of one recv (frames that piled up while the server copied)
    READ_BYTES = 64 * wire.PROGRESS.size

    def __init__(self, sock: socket.socket, value_len: int) -> None:
        self._sock = sock
        self._value_len = value_len
        #: the newest count the client announced
        self.num_written = 0
        self._partial = bytearray()

    def wait_beyond(self, num_bytes: int) -> int:
        """Block until more than ``num_bytes`` are announced; the newest count."""
        while self.num_written <= num_bytes:
            if self.num_written == self._value_len:
                raise ProtocolError(f"asked for more than the {self._value_len} bytes of a staged value")
            self._read()
        return self.num_written

    def drain(self) -> None:
        """Read the frames still to come, up to the last one (the value's length)."""
        while self.num_written < self._value_len:
            self._read()

    def _read(self) -> None:
        data = self._sock.recv(self.READ_BYTES)
        if not data:
            raise ConnectionError(f"client closed after announcing {self.num_written} staged bytes")
        self._partial += data
        num_whole = len(self._partial) - len(self._partial) % wire.PROGRESS.size
        for (count,) in wire.PROGRESS.iter_unpack(self._partial[:num_whole]):
            if not self.num_written < count <= self._value_len:
                raise ProtocolError(f"staged progress {count} after {self.num_written} of {self._value_len}")
            self.num_written = count
        del self._partial[:num_whole]
        if self.num_written == self._value_len and self._partial:
            raise ProtocolError("bytes after a staged value's last progress frame")


def decode_key(key_bytes: bytes) -> str:
    try:
        return key_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "key is not valid UTF-8") from None


def receive_bytes(sock: socket.socket, num_bytes: int) -> bytes:
    """Exactly ``num_bytes`` (small: headers, keys, tokens); ConnectionError when the client closes first."""
    buffer = bytearray(num_bytes)
    wire.recv_exactly(sock, memoryview(buffer))
    return bytes(buffer)


def receive_value(sock: socket.socket, assembler: ValueAssembler) -> memoryview:
    """The verified value, received straight into the assembler's buffer. A header or checksum
    that does not verify raises ChunkFormatError after the whole announced value has been read
    (so the connection stays in step); a closed connection raises ConnectionError."""
    value_len = assembler.total_size
    while assembler.num_received < value_len:
        num_bytes = sock.recv_into(assembler.next_space(RECV_BYTES))
        if num_bytes == 0:
            raise ConnectionError(f"client closed after {assembler.num_received} of {value_len} bytes")
        try:
            assembler.advance(num_bytes)
        except ChunkFormatError:
            discard_value(sock, value_len - assembler.num_received)
            raise
    return assembler.finish()


def discard_value(sock: socket.socket, num_bytes: int) -> None:
    """Read and drop ``num_bytes`` (the rest of a refused value)."""
    scratch = memoryview(bytearray(min(num_bytes, RECV_BYTES)))
    while num_bytes > 0:
        received = sock.recv_into(scratch[: min(num_bytes, len(scratch))])
        if received == 0:
            raise ConnectionError("client closed in the middle of a refused value")
        num_bytes -= received
