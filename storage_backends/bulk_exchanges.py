"""The bulk channel's client: one request's exchange on a connection the client holds.

Each function here sends one request on ``sock`` (a connection :class:`BulkClient` took from
its pool for the call) and reads what the server answers, as ``protos/bulk_wire.py`` lays it
out: an ask-first Put (protocol 1), a single Put that goes through the connection's staging
area when it has (or gets) one, whole or as a ring, else streamed, a Get into a new buffer,
a Get straight into a chunk's tensor, and the reply of one pipelined Put. They raise
BulkStatusError for an error reply (the connection stays in step), :class:`InStepError` for
a value refused after the stream stayed in step, and OSError when the connection failed
(:meth:`BulkClient._call` closes it then); the pool and its retries are in
``storage_backends/bulk_channel.py``, which imports this module; this one knows the client
only as :class:`ExchangeClient` (what the exchanges use of it), so the import goes one way.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from protos.bulk_wire import (
    OP_GET,
    OP_PUT,
    OP_PUT_STAGED,
    OP_PUT_STREAMED,
    PROGRESS,
    REQUEST,
    STATUS_OK,
    Reply,
    read_reply,
    recv_exactly,
    send_buffers,
)
from storage_backends.bulk_errors import BulkStatusError

if TYPE_CHECKING:
    from storage_backends.chunk import KVChunk
    from storage_backends.chunk_receiver import Destination
    from storage_backends.receive_buffers import ReceiveBufferPool
    from storage_backends.staging_area import StagingArea

#: a value's buffers back to back (e.g. a chunk's header and its tensor's memory)
ValueParts = tuple[bytes | bytearray | memoryview, ...]


class ExchangeClient(Protocol):
    """What an exchange uses of the client that lent it the connection (``BulkClient``)."""

    #: the largest value a reply may announce (a larger one is a garbled stream)
    max_value_bytes: int
    #: where a Get's new buffer comes from
    receive_buffers: ReceiveBufferPool

    def staging_area_for(self, sock: socket.socket, num_bytes: int) -> StagingArea | None:
        """The connection's staging area for a value of ``num_bytes``, None to stream it."""

    def count_staged_put(self) -> None:
        """One Put went through a staging area."""


#: a staged Put's value is written in about 8 segments (the server copies one while the
#: client writes the next), none smaller or larger than these (a progress frame each: a send
#: and often a wake-up of the server; 512 KiB rather than 256 took 10% less CPU in all for a
#: 2 MiB Put, docs/benchmarks.md)
MIN_STAGED_SEGMENT_BYTES, MAX_STAGED_SEGMENT_BYTES = 512 << 10, 4 << 20
#: most segments a staged Put's value is cut into (a progress frame each)
MAX_STAGED_SEGMENTS = 8
#: segments are whole multiples of this (but the last), so that no copy starts mid-page
STAGED_SEGMENT_GRANULE_BYTES = 64 << 10


def staged_segment_bytes(value_len: int) -> int:
    """How many bytes a client writes to its staging area between two progress frames: about
    an eighth of the value, between the bounds above, and cut so that the last segment is
    never a sliver (a 2 MiB chunk with its header, 93 bytes past 2 MiB, took a fifth progress
    frame, send and wake-up for those 93 bytes, docs/benchmarks.md)."""
    num_segments = max(
        1,
        min(MAX_STAGED_SEGMENTS, value_len // MIN_STAGED_SEGMENT_BYTES),
        -(-value_len // MAX_STAGED_SEGMENT_BYTES),
    )
    granule = STAGED_SEGMENT_GRANULE_BYTES
    return -(-value_len // num_segments // granule) * granule if value_len > granule else value_len


def settle_put(sock: socket.socket, index: int, outcomes: list) -> None:
    """Read the next reply: the outcome of the Put at ``index`` (replies come in request order)."""
    reply = read_reply(sock)
    outcomes[index] = (
        reply.value_len if reply.status == STATUS_OK else BulkStatusError(reply.status, reply.message)
    )


def put_asking_first(
    client: ExchangeClient, sock: socket.socket, key: bytes, parts: tuple[bytes | memoryview, ...]
) -> int:
    """An ask-first Put (``OP_PUT``): the request, the server's "send it", the value, its reply;
    the number of bytes stored."""
    views = [memoryview(part).cast("B") for part in parts]
    sock.sendall(REQUEST.pack(OP_PUT, len(key), sum(len(view) for view in views)) + key)
    reply = read_reply(sock)
    if reply.status != STATUS_OK:
        raise BulkStatusError(reply.status, reply.message)
    send_buffers(sock, *views)
    reply = read_reply(sock)
    if reply.status != STATUS_OK:
        raise BulkStatusError(reply.status, reply.message)
    return reply.value_len


def put_single(client: ExchangeClient, sock: socket.socket, key: bytes, parts: ValueParts) -> int:
    """A staged Put when the connection has (or gets) a staging area for the value (one that
    holds it, or, protocol 4, a ring), else a streamed one; the number of bytes stored."""
    size = sum(memoryview(part).nbytes for part in parts)
    area = client.staging_area_for(sock, size)
    if area is None:
        send_buffers(sock, REQUEST.pack(OP_PUT_STREAMED, len(key), size) + key, *parts)
        reply = read_reply(sock)
    else:
        unsent_request = [REQUEST.pack(OP_PUT_STAGED, len(key), size) + key]
        announced = [0]

        def announce(num_bytes: int) -> None:
            sock.sendall(b"".join(unsent_request) + PROGRESS.pack(num_bytes))
            unsent_request.clear()
            announced[0] = num_bytes

        if size > staged_segment_bytes(size):
            # A value of several segments: the request leaves before the first byte is
            # written, so the server's thread wakes up (20 to 50 us on the 2-core VM) and takes
            # its buffer while the first segment is written. A value of one segment sends it with
            # its only progress frame: one send, one wake-up (docs/benchmarks.md).
            sock.sendall(unsent_request.pop())
        if size <= area.size:
            area.write(parts, staged_segment_bytes(size), announce)
            reply = read_reply(sock)
        else:
            reply = _write_ring(sock, area, parts, size, announce, announced)
    if reply.status != STATUS_OK:
        raise BulkStatusError(reply.status, reply.message)
    if area is not None:
        client.count_staged_put()
    return reply.value_len


class _RingRefused(Exception):
    """The server answered a ring Put (with its refusal) before the client had written it all."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.message)
        self.reply = reply


def _write_ring(
    sock: socket.socket,
    area: StagingArea,
    parts: ValueParts,
    size: int,
    announce: Callable[[int], None],
    announced: list[int],
) -> Reply:
    """Write a value larger than ``area`` through it as a ring (protocol 4): a quarter of the
    area at a time, overwriting a part only once the server acknowledged copying it out; the
    server's final reply. A refusal that comes while the client waits ends the writing: the
    last progress frame (the whole value) is sent so that the server, which reads the frames
    after refusing, stays in step."""
    num_copied = [0]

    def next_reply() -> Reply:
        reply = read_reply(sock)
        if reply.status == STATUS_OK and reply.value_len < size:
            if reply.value_len <= num_copied[0]:
                raise ConnectionError(f"garbled acknowledgement of {reply.value_len} bytes")
            num_copied[0] = reply.value_len
            return None
        return reply

    def wait_for_room(num_bytes: int) -> None:
        while num_copied[0] < num_bytes:
            reply = next_reply()
            if reply is not None:
                raise _RingRefused(reply)

    try:
        area.write(parts, area.size // 4, announce, wait_for_room)
    except _RingRefused as refused:
        if refused.reply.status == STATUS_OK:
            raise ConnectionError("a ring Put was answered before it was written") from None
        if announced[0] < size:
            announce(size)
        return refused.reply
    while True:
        reply = next_reply()
        if reply is not None:
            return reply


def get_value(client: ExchangeClient, sock: socket.socket, key: bytes) -> memoryview:
    """A Get into a new buffer from the client's ``receive_buffers`` (the caller owns it)."""
    sock.sendall(REQUEST.pack(OP_GET, len(key), 0) + key)
    reply = read_reply(sock)
    if reply.status != STATUS_OK:
        raise BulkStatusError(reply.status, reply.message)
    if reply.value_len > client.max_value_bytes:
        raise ConnectionError(f"garbled bulk reply: a value of {reply.value_len} bytes")
    value = client.receive_buffers.take(reply.value_len)
    recv_exactly(sock, value, wait_all=True)
    return value


def get_chunk_into(
    client: ExchangeClient, sock: socket.socket, key: bytes, destination: Destination
) -> KVChunk:
    """A Get straight into ``destination(header)``, verified as it lands
    (``storage_backends.chunk_receiver``); a refused value raises :class:`InStepError`."""
    from storage_backends.chunk_receiver import receive_chunk

    sock.sendall(REQUEST.pack(OP_GET, len(key), 0) + key)
    reply = read_reply(sock)
    if reply.status != STATUS_OK:
        raise BulkStatusError(reply.status, reply.message)
    if reply.value_len > client.max_value_bytes:
        raise ConnectionError(f"garbled bulk reply: a value of {reply.value_len} bytes")
    try:
        return receive_chunk(
            lambda view: recv_exactly(sock, view, wait_all=True), reply.value_len, destination, key.decode()
        )
    except ValueError as error:  # ChunkFormatError too: the stream is in step, the connection reusable
        raise InStepError(error) from None


class InStepError(Exception):
    """A refusal of the value that left the connection in step (carries the original ``error``)."""

    def __init__(self, error: ValueError) -> None:
        super().__init__(str(error))
        self.error = error
