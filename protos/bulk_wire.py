"""The cache server's bulk data channel: its wire format, and the frame helpers both sides use.

The client (``storage_backends.bulk_channel``) and the server (``cache_server.bulk_server``)
both import this module and nothing else of each other: the layouts, op and status codes,
protocol version and transports, and the few socket helpers that read and write frames
(exact reads, unjoined sends, replies). Standard library only (no grpc, torch or numpy), as
everything under ``protos/``. Why there is a second channel beside gRPC, and the client's
pooling, are in ``storage_backends/bulk_channel.py``; the server's side in
``cache_server/bulk_server.py``.

Wire format (integers little-endian; status codes are gRPC's numbers):

- on connect, client → server: ``HELLO`` = magic ``b"KVB1"``, u16 token length,
  token bytes (empty without auth); server → client: a reply (below; its
  message is the server's instance id, as in ``GetBulkEndpoint``). A wrong
  token gets UNAUTHENTICATED and the connection is closed; so is, at once, a
  connection beyond the server's ``--max-bulk-connections``.
- request: u8 op (``OP_PUT``, ``OP_GET``), u16 key length, u64 value length
  (0 for Get), key bytes (UTF-8).
- reply: u8 status, u32 message length, u64 value length, message bytes
  (UTF-8), then the value's bytes when a Get succeeds.
- Put (``OP_PUT``): the server checks key, size, limits and memory cap and answers OK ("send
  it") or an error before any value byte moves; then the client sends the value
  and the server answers once more after verifying header and checksum and
  storing it (or INVALID_ARGUMENT; it reads the whole announced value either
  way, so the connection stays usable).
- Streamed Put (``OP_PUT_STREAMED``, protocol version 2): the value follows the
  request at once and the server answers once, after storing it or refusing it.
  A refusal (any check above) reads and drops the announced value first, so the
  connection stays in step and a refused Put stores nothing. Since nothing waits
  for a "send it", a client sends the next Puts before the replies of the earlier
  ones come (``storage_backends.bulk_channel.BulkClient.put_many``: up to ``put_window``
  unanswered Puts per connection); replies come in request order, one per Put.
- Staging area (``OP_STAGING_AREA``, protocol version 3, Unix socket only): the request
  carries no key and, as its value length, the size wanted (no value bytes follow); the
  server answers OK with the area's size (at least that asked; an area kept from an earlier
  connection of the same tenant may be larger) and, as ancillary data (``SCM_RIGHTS``), the
  descriptor of a sealed shared-memory file of that size (``storage_backends.staging_area``),
  which replaces the connection's previous area; or an error (over its size limit, no room;
  from version 4 the refusal of an area over the limit carries the largest it grants as its
  value length).
- Staged Put (``OP_PUT_STAGED``, version 3): the client sends the request, then writes the
  value at the start of the connection's staging area a segment at a time, sending after
  each segment a progress frame (u64: bytes written so far, growing; the last one is the
  value length; an empty value, which is refused, has none). The server copies each
  announced segment out while the client writes the next (no value bytes cross the
  socket), verifies and stores the value and answers once; a refusal reads the remaining
  progress frames first, so the connection stays in step. A single Put from a client on
  the same host goes this way (``BulkClient.put_many`` with one item) when its value
  fits an area the server grants.
- Ring Put (version 4): a staged Put of a value larger than the connection's area. Byte ``i``
  goes to ``i % size``; the client writes a quarter of the area per segment and overwrites
  a part only after the server acknowledged copying it out: after each quarter copied the
  server sends an acknowledgement, an OK reply whose value length (always less than the
  value's) counts the bytes copied. A refusal is answered at once and the progress frames
  are read after it; the client, which may be waiting for an acknowledgement, then sends
  its last frame (the value's length). A single Put whose value needs an area larger than
  ``bulk_channel.RING_AREA_BYTES`` (4 MiB), or than the largest area the server grants, goes
  this way through an area of at most ``RING_AREA_BYTES``; with a version-3 server it is
  written whole into an area that holds it, or streamed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import struct
from typing import NamedTuple

#: the version the server advertises: 2 added OP_PUT_STREAMED, 3 the staging area (OP_STAGING_AREA,
#: OP_PUT_STAGED), 4 staged Puts of values larger than the area (a ring with acknowledgements)
PROTOCOL_VERSION = 4
MAGIC = b"KVB1"
OP_PUT, OP_GET, OP_PUT_STREAMED, OP_STAGING_AREA, OP_PUT_STAGED = 1, 2, 3, 4, 5
# Status codes: the numbers of grpc.StatusCode (this module does not import grpc).
STATUS_OK = 0
STATUS_INVALID_ARGUMENT = 3
STATUS_NOT_FOUND = 5
STATUS_PERMISSION_DENIED = 7
STATUS_RESOURCE_EXHAUSTED = 8
STATUS_INTERNAL = 13
STATUS_UNAVAILABLE = 14
STATUS_UNAUTHENTICATED = 16
STATUS_NAMES = {
    STATUS_OK: "OK",
    STATUS_INVALID_ARGUMENT: "INVALID_ARGUMENT",
    STATUS_NOT_FOUND: "NOT_FOUND",
    STATUS_PERMISSION_DENIED: "PERMISSION_DENIED",
    STATUS_RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    STATUS_INTERNAL: "INTERNAL",
    STATUS_UNAVAILABLE: "UNAVAILABLE",
    STATUS_UNAUTHENTICATED: "UNAUTHENTICATED",
}

HELLO = struct.Struct("<4sH")  # magic, token length
PROGRESS = struct.Struct("<Q")  # a staged Put's bytes written so far
REQUEST = struct.Struct("<BHQ")  # op, key length, value length
REPLY = struct.Struct("<BIQ")  # status, message length, value length
#: longest reply message either side sends or accepts
MAX_MESSAGE_BYTES = 4096
#: longest token the server reads from a HELLO
MAX_TOKEN_BYTES = 4096
#: longest key the wire format can carry (the server's own limit is lower)
MAX_KEY_BYTES = 0xFFFF
TRANSPORT_TCP, TRANSPORT_UNIX = "tcp", "unix"
#: the path the server's stats name for staged Puts (their values crossed shared memory)
TRANSPORT_SHM = "shm"


#: send and receive buffer asked for on Unix sockets (the kernel doubles it, capped by
#: net.core.wmem_max/rmem_max): the default ~200 KiB makes sender and receiver wake each other
#: every ~200 KiB; with 1 MiB a socket pair carried 15-25% more on the 2-core VM (docs/benchmarks.md).
#: TCP keeps the kernel's autotuning (setting a size turns it off).
UNIX_SOCKET_BUFFER_BYTES = 1 << 20


def tune_unix_socket(sock: socket.socket) -> None:
    """Larger buffers on a Unix stream socket (either side); best effort."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, UNIX_SOCKET_BUFFER_BYTES)


class Reply(NamedTuple):
    """One reply's header fields and its message (a Get's value, when any, follows on the socket)."""

    status: int
    message: str
    value_len: int


def encode_reply(status: int, message: str = "", value_len: int = 0) -> bytes:
    """One reply header plus its message (the server's side; a Get's value follows separately)."""
    text = message.encode()[:MAX_MESSAGE_BYTES]
    return REPLY.pack(status, len(text), value_len) + text


def recv_exactly(sock: socket.socket, view: memoryview, *, wait_all: bool = False) -> None:
    """Fill ``view`` from ``sock``; ConnectionError when the peer closes first.

    ``wait_all`` (a client receiving a value of megabytes): on a blocking socket (kernel
    timeouts, no TLS) each ``recv_into`` asks the kernel to fill the whole rest of ``view``
    (``MSG_WAITALL``), so a 32 MiB value is one system call instead of one per socket buffer
    (~1 MiB): the receiving thread takes the GIL back once, not ~33 times. Under a busy engine
    thread each of those waits cost up to the interpreter's switch interval (5 ms), which
    halved a fetch's rate (docs/benchmarks.md, "Fetches from the cache server"). Elsewhere
    (a Python timeout, TLS) the flag is not passed and each call returns what has arrived."""
    flags = 0
    if wait_all and sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket):
        flags = socket.MSG_WAITALL
    num_received = 0
    while num_received < len(view):
        rest = view[num_received:]
        num_bytes = sock.recv_into(rest, len(rest), flags) if flags else sock.recv_into(rest)
        if num_bytes == 0:
            raise ConnectionError(f"connection closed after {num_received} of {len(view)} bytes")
        num_received += num_bytes


def send_buffers(sock: socket.socket, *buffers: bytes | memoryview) -> None:
    """Send ``buffers`` back to back without joining them: one ``sendmsg`` of memoryviews (each
    is sent from where it lies), repeated for what a short send left. TLS sockets have no
    ``sendmsg``; they send each buffer in turn."""
    if isinstance(sock, ssl.SSLSocket):
        for buffer in buffers:
            sock.sendall(buffer)
        return
    views = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
    while views:
        num_sent = sock.sendmsg(views)
        while views and num_sent >= len(views[0]):
            num_sent -= len(views.pop(0))
        if views:
            views[0] = views[0][num_sent:]


def read_reply(sock: socket.socket) -> Reply:
    """One reply header and its message; ConnectionError for a closed or garbled stream."""
    head = bytearray(REPLY.size)
    recv_exactly(sock, memoryview(head))
    return _reply_after_head(sock, head)


def read_reply_with_fd(sock: socket.socket) -> tuple[Reply, int | None]:
    """One reply and the descriptor sent with its first bytes (None when none came); the
    caller owns (closes) the descriptor. ConnectionError for a closed or garbled stream."""
    head, fds, flags, _ = socket.recv_fds(sock, REPLY.size, 1)
    fd = fds[0] if fds else None
    try:
        if not head:
            raise ConnectionError("connection closed before the reply")
        if flags & socket.MSG_CTRUNC or len(fds) > 1:
            raise ConnectionError("garbled bulk reply: unexpected descriptors")
        rest = bytearray(REPLY.size - len(head))
        recv_exactly(sock, memoryview(rest))
        return _reply_after_head(sock, head + rest), fd
    except BaseException:
        for extra in fds:
            os.close(extra)
        raise


def _reply_after_head(sock: socket.socket, head: bytes | bytearray) -> Reply:
    status, message_len, value_len = REPLY.unpack(head)
    if status not in STATUS_NAMES or message_len > MAX_MESSAGE_BYTES:
        raise ConnectionError(f"garbled bulk reply (status {status}, message of {message_len} bytes)")
    message = bytearray(message_len)
    recv_exactly(sock, memoryview(message))
    return Reply(status, message.decode(errors="replace"), value_len)


def timeval(seconds: float | None) -> bytes:
    """``seconds`` as the ``struct timeval`` of SO_RCVTIMEO / SO_SNDTIMEO (None or 0: no limit);
    both sides of the bulk channel use it."""
    micros = round((seconds or 0) * 1_000_000)
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)
