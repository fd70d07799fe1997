"""The cache server's bulk data channel: the client side.

gRPC moves a value through HTTP/2 framing, a copy into a Python ``bytes`` per
message and a few asyncio callbacks per piece; for values of megabytes that
costs more than the bytes themselves (docs/benchmarks.md). So the server also
listens on a plain TCP port (``kvstash cache-server --bulk-port``) that moves
Put and Get values as raw bytes, received with ``recv_into`` straight into the
buffer that will hold them. Control stays on gRPC: the client learns the port
from the ``GetBulkEndpoint`` RPC and falls back to gRPC whenever the bulk
channel is off or broken.

The server also listens on a Unix domain socket (its path comes with the TCP
port in ``GetBulkEndpoint``, with the server's host identity); a client on the
same host (``storage_backends.host_identity``) uses it instead of TCP: the same
protocol, without the TCP/IP stack.

The wire format (frames, op and status codes, protocol versions) is in
``protos/bulk_wire.py``, which the server (``cache_server/bulk_server.py``) imports too.

:class:`BulkClient` holds a small pool of connections to one endpoint (TCP or
Unix socket): at most ``max_connections`` in use at once, each reused by the
next caller; concurrent callers (``get_many``/``put_many``) spread over them
and wait for one when all are busy. Values are sent straight from the caller's
memory (``sendmsg`` of memoryviews: request header, chunk header and tensor
bytes leave in one call, never joined). Thread-safe. Transport failures (refused, reset, closed, timed out,
garbled) raise :class:`BulkUnavailable`; the gRPC tier then retries the call
over gRPC. A reply with an error status raises :class:`BulkStatusError`
(both in ``storage_backends/bulk_errors.py``). What one request sends and reads on a
connection the pool handed out is in ``storage_backends/bulk_exchanges.py``.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from protos.bulk_wire import (
    HELLO,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_TOKEN_BYTES,
    OP_PUT_STREAMED,
    OP_STAGING_AREA,
    PROTOCOL_VERSION,
    REQUEST,
    STATUS_NOT_FOUND,
    STATUS_OK,
    STATUS_RESOURCE_EXHAUSTED,
    TRANSPORT_TCP,
    TRANSPORT_UNIX,
    read_reply,
    read_reply_with_fd,
    send_buffers,
    timeval,
    tune_unix_socket,
)
from storage_backends.bulk_errors import BulkStatusError, BulkUnavailable
from storage_backends.bulk_exchanges import (
    InStepError,
    ValueParts,
    get_chunk_into,
    get_value,
    put_asking_first,
    put_single,
    settle_put,
)
from storage_backends.receive_buffers import ReceiveBufferPool
from storage_backends.staging_area import AREA_GRANULE_BYTES, StagingArea, area_size_for, staging_supported

if TYPE_CHECKING:
    from storage_backends.chunk import KVChunk
    from storage_backends.chunk_receiver import Destination

logger = logging.getLogger(__name__)

#: versions a client speaks to (a version-1 server gets ask-first Puts, one at a time per connection)
SUPPORTED_PROTOCOL_VERSIONS = (1, 2, 3, 4)
#: largest Get value a client accepts; a larger announced length means a garbled stream
DEFAULT_MAX_VALUE_BYTES = 1 << 30
#: connections one client keeps in use at once by default (values of MiBs: a few fill the link)
DEFAULT_MAX_CONNECTIONS = 4
#: streamed Puts one connection sends before it waits for the oldest one's reply (each reply is
#: at most a few KiB, so this many always fit in the socket's buffer: the server never blocks on them)
DEFAULT_PUT_WINDOW = 8

#: the area a client asks for to send larger values through as a ring (protocol 4; at most the
#: largest area the server grants, at least RING_MIN_AREA_BYTES). Small on purpose: a ring that
#: stays in the CPU's caches is written and copied out faster than a whole area of the value
#: in memory (a 32 MiB Put through a 4 MiB ring 6,454 MB/s against 4,601 through a 33 MiB area
#: on the 2-core VM), costs its first Put 2-3 ms to set up instead of ~21, and each connection
#: holds 4 MiB instead of up to the server's ``--max-staging-mb`` (docs/benchmarks.md)
RING_AREA_BYTES, RING_MIN_AREA_BYTES = 4 << 20, 1 << 20

#: the parts, or a callable that makes them (called once, just before the value is sent)
PartsSource = ValueParts | Callable[[], ValueParts]
#: one streamed Put's outcome: bytes stored, or the error for that key (BulkStatusError: the
#: server refused it and stored nothing; BulkUnavailable: the connection failed before its reply)
PutOutcome = int | Exception


class BulkClient:
    """Connections to one server's bulk port (or its Unix socket, ``unix_path``); ``put``, ``get``
    and ``get_into`` as the gRPC tier needs them."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None,
        timeout_s: float,
        connect_timeout_s: float | None = None,
        tls_context: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        unix_path: str | None = None,
        server_instance_id: str | None = None,
        protocol_version: int = PROTOCOL_VERSION,
        put_window: int = DEFAULT_PUT_WINDOW,
    ) -> None:
        if max_connections <= 0 or put_window <= 0:
            raise ValueError(
                f"bulk connections and put window must be positive, got {max_connections} and {put_window}"
            )
        if protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
            raise ValueError(
                f"bulk protocol version {protocol_version} is not one of {SUPPORTED_PROTOCOL_VERSIONS}"
            )
        if unix_path is not None and tls_context is not None:
            raise ValueError("the bulk channel's Unix socket does not speak TLS")
        self.host = host
        self.port = port
        self.unix_path = unix_path
        #: when set, a connection whose HELLO answer is not this id is another server's (refused)
        self.server_instance_id = server_instance_id
        #: "unix" or "tcp": how this client reaches the server
        self.transport = TRANSPORT_UNIX if unix_path is not None else TRANSPORT_TCP
        self.max_connections = max_connections
        #: the server's protocol version (1: no streamed Puts)
        self.protocol_version = protocol_version
        #: streamed Puts in flight per connection before the client waits for a reply
        self.put_window = put_window
        self.timeout_s = timeout_s
        self.connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self._token = (token or "").encode()
        if len(self._token) > MAX_TOKEN_BYTES:
            raise ValueError(f"auth token longer than {MAX_TOKEN_BYTES} bytes")
        self._tls_context = tls_context
        # one permit per connection in use: callers beyond max_connections wait for one
        self._permits = threading.BoundedSemaphore(max_connections)
        #: buffers of new values of 32 MiB and more (``get``, and ``get_chunk`` into a
        #: ``chunk_receiver.pooled_tensor``), reused once their callers dropped them
        self.receive_buffers = ReceiveBufferPool()
        self.max_value_bytes = max_value_bytes
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        #: each connection's staging area (protocol 3 on the Unix socket), dropped with it
        self._staging_areas: weakref.WeakKeyDictionary[socket.socket, StagingArea] = (
            weakref.WeakKeyDictionary()
        )
        #: smallest area the server refused as over its limit: values needing one as large are
        #: streamed, or (protocol 4) sent through a smaller area as a ring
        self._refused_area_bytes: int | None = None
        #: the largest area the server grants, as its refusal said (protocol 4; None: unknown)
        self._largest_area_bytes: int | None = None
        #: Puts that went through a staging area (counted for stats and tests)
        self.num_staged_puts = 0
        self._said_staging = False  # the INFO line about staging areas is logged once

    # ---- connections -----------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """Where this client connects, for messages: ``HOST:PORT`` or the socket path."""
        return self.unix_path if self.unix_path is not None else f"{self.host}:{self.port}"

    def _open_socket(self) -> socket.socket:
        if self.unix_path is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
            # Requests and replies are small messages answered at once: no Nagle delay.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tune_unix_socket(sock)
        try:
            sock.settimeout(self.connect_timeout_s)
            sock.connect(self.unix_path)
        except BaseException:
            sock.close()
            raise
        return sock

    def _set_timeout(self, sock: socket.socket) -> None:
        """Give ``sock`` the client's ``timeout_s`` for each send and receive. A Unix socket or
        a plain TCP one blocks and the kernel times out each call (SO_RCVTIMEO, SO_SNDTIMEO):
        Python polls before every call on a socket with a timeout, a second system call each
        (~8 per 2 MiB staged Put, docs/benchmarks.md), and a receive with ``MSG_WAITALL``
        (``recv_exactly(wait_all=True)``: a Get's value in one call) needs a blocking socket
        (over loopback TCP 32 chunks of 32 MiB came at 4.14 GB/s instead of 3.75, 2.07 instead
        of 1.81 beside a thread holding the GIL half the time). A call that times out raises
        BlockingIOError, which :func:`_as_timeout` turns back into the TimeoutError a Python
        timeout raises. A TLS socket keeps a Python timeout (its reads must not fail midway)."""
        if self._tls_context is not None:
            sock.settimeout(self.timeout_s)
            return
        sock.settimeout(None)
        limit = timeval(self.timeout_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)

    def _connect(self) -> socket.socket:
        sock = self._open_socket()
        try:
            self._set_timeout(sock)
            if self._tls_context is not None:
                sock = self._tls_context.wrap_socket(sock, server_hostname=self.host)
            sock.sendall(HELLO.pack(MAGIC, len(self._token)) + self._token)
            reply = read_reply(sock)
        except BlockingIOError as error:
            sock.close()
            raise _as_timeout(error) from None
        except BaseException:
            sock.close()
            raise
        if reply.status != STATUS_OK:
            sock.close()
            raise BulkStatusError(reply.status, reply.message)
        if self.server_instance_id is not None and reply.message != self.server_instance_id:
            sock.close()
            raise ConnectionError(f"{self.endpoint} belongs to another server than the one advertised")
        return sock

    def _take(self) -> tuple[socket.socket, bool]:
        """A connection and whether it was pooled (idle since an earlier call)."""
        with self._lock:
            if self._closed:
                raise BulkUnavailable("bulk client is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_connections:
                self._idle.append(sock)
                return
        sock.close()

    def _call(self, operation, key: str, *args):
        """Run ``operation(self, sock, key_bytes, *args)`` on a pooled connection. A connection
        that failed is closed (it may be mid-message); an error status leaves it in step and
        pooled. A pooled connection may have been closed by the server while idle (or by a
        restart), so a failure other than a timeout on one is retried on a new connection
        (Put and Get are idempotent)."""
        encoded_key = key.encode()
        if len(encoded_key) > MAX_KEY_BYTES:
            raise ValueError(f"key of {len(encoded_key)} bytes is too long for the bulk channel")
        if not self._permits.acquire(timeout=self.timeout_s):
            raise BulkUnavailable(f"no free bulk connection to {self.endpoint} within {self.timeout_s:g} s")
        try:
            return self._call_with_permit(operation, encoded_key, *args)
        finally:
            self._permits.release()

    def _call_with_permit(self, operation, encoded_key: bytes, *args):
        while True:
            try:
                sock, pooled = self._take()
            except OSError as error:
                raise BulkUnavailable(f"cannot connect to {self.endpoint}: {error}") from None
            try:  # the socket keeps the timeouts _connect gave it (_set_timeout)
                result = operation(self, sock, encoded_key, *args)
            except BulkStatusError:
                self._give_back(sock)
                raise
            except InStepError as refused:
                self._give_back(sock)
                raise refused.error from None
            except OSError as error:  # ssl.SSLError and ConnectionError are OSErrors
                sock.close()
                error = _as_timeout(error)
                if pooled and not isinstance(error, TimeoutError):
                    self._close_idle()  # they are as old as this one
                    continue
                raise BulkUnavailable(f"bulk transfer with {self.endpoint} failed: {error}") from None
            except BaseException:
                sock.close()
                raise
            self._give_back(sock)
            return result

    def check(self) -> None:
        """Open one connection (HELLO answered) and pool it; BulkUnavailable when that fails,
        BulkStatusError when the server refuses (token). Used to try a Unix socket before using it."""
        if not self._permits.acquire(timeout=self.timeout_s):
            raise BulkUnavailable(f"no free bulk connection to {self.endpoint} within {self.timeout_s:g} s")
        try:
            try:
                sock = self._connect()
            except OSError as error:
                raise BulkUnavailable(f"cannot connect to {self.endpoint}: {error}") from None
            self._give_back(sock)
        finally:
            self._permits.release()

    # ---- operations ------------------------------------------------------------
    def put(self, key: str, *parts: bytes | memoryview) -> int:
        """Store the value made of ``parts`` back to back (one buffer, or a chunk's header and its
        tensor's memory, sent without joining them); returns the number of bytes the server stored."""
        return self._call(put_asking_first, key, parts)

    def put_many(self, items: Sequence[tuple[str, PartsSource]]) -> list[PutOutcome]:
        """Streamed Puts of ``items`` (key, value parts) on one connection, pipelined: each value
        is sent from the caller's buffers as soon as the previous one has left, with up to
        ``put_window`` Puts unanswered; the replies are read as the window requires.

        Returns one outcome per item, in order: the number of bytes the server stored; the
        BulkStatusError it answered for that key (nothing stored, the connection stays in
        step); an exception the item's parts callable raised (nothing sent for it); or
        BulkUnavailable when the connection failed before the item's reply came (it may or
        may not be stored: Puts are idempotent, retry it elsewhere). ValueError before
        anything is sent for a key too long for the wire. A version-1 server gets ask-first
        Puts, one after the other. Called by the gRPC tier's Put paths, from any thread.
        """
        keys = [key.encode() for key, _ in items]
        for encoded_key in keys:
            if len(encoded_key) > MAX_KEY_BYTES:
                raise ValueError(f"key of {len(encoded_key)} bytes is too long for the bulk channel")
        outcomes: list[PutOutcome | None] = [None] * len(items)
        parts = _PartsCache(items)
        if len(items) == 1 and self.stages_puts:
            return [self._put_one(items[0][0], parts)]
        if self.protocol_version < 2:
            for index, (key, _) in enumerate(items):
                try:
                    outcomes[index] = self.put(key, *parts.get(index))
                except (BulkStatusError, BulkUnavailable, ValueError) as error:
                    outcomes[index] = error
            return outcomes
        if items and not self._permits.acquire(timeout=self.timeout_s):
            busy = BulkUnavailable(f"no free bulk connection to {self.endpoint} within {self.timeout_s:g} s")
            return [busy] * len(items)
        try:
            while any(outcome is None for outcome in outcomes):
                if not self._put_streamed_once(keys, parts, outcomes):
                    break
        finally:
            if items:
                self._permits.release()
        return outcomes

    @property
    def stages_puts(self) -> bool:
        """True when single Puts may go through a shared-memory staging area (Unix socket,
        protocol version 3 or later, a system with sealed shared files)."""
        return self.transport == TRANSPORT_UNIX and self.protocol_version >= 3 and staging_supported()

    def _put_one(self, key: str, parts: _PartsCache) -> PutOutcome:
        """One Put, staged when its value fits an area the server grants, else streamed; its
        outcome as :meth:`put_many` reports it."""
        try:
            buffers = parts.get(0)
        except Exception as error:  # noqa: BLE001 - reported as the item's outcome
            return error
        try:
            return self._call(put_single, key, buffers)
        except (BulkStatusError, BulkUnavailable) as error:
            return error

    def staging_area_for(self, sock: socket.socket, num_bytes: int) -> StagingArea | None:
        """The connection's staging area for a value of ``num_bytes``: one that holds it, asked
        for (or grown) when needed; or, for a value larger than any area the server grants
        (protocol 4), an area to pass it through as a ring (smaller than the value); None when
        neither can be had (the value is then streamed). Runs on the thread that holds
        ``sock``; OSError when the connection fails."""
        with self._lock:
            area = self._staging_areas.get(sock)
            refused_bytes = self._refused_area_bytes
        if area is not None and num_bytes <= area.size:
            return area
        if num_bytes == 0:
            return None  # streamed, and refused there as an empty value
        wanted = area_size_for(num_bytes)
        ring_bytes = self._ring_area_bytes()
        if ring_bytes is not None and wanted > ring_bytes:  # passed through a ring
            wanted = ring_bytes
            if area is not None and area.size >= wanted:
                return area
        if refused_bytes is not None and wanted >= refused_bytes:
            return None  # an area this large was refused for good: streamed
        area = self._ask_area(sock, wanted)
        new_ring_bytes = self._ring_area_bytes()
        if area is None and new_ring_bytes is not None and new_ring_bytes < wanted:
            # refused as too large: a ring of the largest the server grants then (each retry
            # asks for less, so this ends)
            return self.staging_area_for(sock, num_bytes)
        return area

    def _ring_area_bytes(self) -> int | None:
        """The area to ask for to pass larger values through as a ring: ``RING_AREA_BYTES``, or
        the largest area the server grants when a refusal said it is smaller; None when the
        server has no rings (protocol 3) or grants less than ``RING_MIN_AREA_BYTES``."""
        with self._lock:
            largest = self._largest_area_bytes
        if self.protocol_version < 4:
            return None
        size = min(RING_AREA_BYTES, largest or RING_AREA_BYTES) // AREA_GRANULE_BYTES * AREA_GRANULE_BYTES
        return size if size >= RING_MIN_AREA_BYTES else None

    def _ask_area(self, sock: socket.socket, wanted: int) -> StagingArea | None:
        """Ask the server for an area of ``wanted`` bytes (it replaces the connection's);
        None when refused (over its limit: remembered, with the largest it grants)."""
        sock.sendall(REQUEST.pack(OP_STAGING_AREA, 0, wanted))
        reply, fd = read_reply_with_fd(sock)
        with self._lock:
            self._staging_areas.pop(sock, None)  # the server dropped the old area either way
        if reply.status != STATUS_OK:
            if fd is not None:
                os.close(fd)
            if reply.status != STATUS_RESOURCE_EXHAUSTED:  # over the server's limit: for good
                with self._lock:
                    self._refused_area_bytes = min(wanted, self._refused_area_bytes or wanted)
                    if self.protocol_version >= 4 and 0 < reply.value_len < wanted:
                        self._largest_area_bytes = reply.value_len
            logger.debug("bulk %s: no staging area of %d bytes (%s)", self.endpoint, wanted, reply.message)
            return None
        if fd is None or not wanted <= reply.value_len <= self.max_value_bytes:
            if fd is not None:
                os.close(fd)
            raise ConnectionError(f"garbled staging area reply ({reply.value_len} bytes, descriptor {fd})")
        try:  # a kept area of an earlier connection may be larger than asked
            area = StagingArea.from_fd(fd, reply.value_len)
        except ValueError as error:
            raise ConnectionError(f"unusable staging area: {error}") from None
        with self._lock:
            self._staging_areas[sock] = area
            first, self._said_staging = not self._said_staging, True
        if first:
            logger.info("bulk %s: single Puts go through shared-memory staging areas", self.endpoint)
        return area

    def _put_streamed_once(self, keys: list[bytes], parts: _PartsCache, outcomes: list) -> bool:
        """Send every item without an outcome on one connection; True when it should be tried
        again (a pooled connection that was found closed before any reply came)."""
        try:
            sock, pooled = self._take()
        except OSError as error:
            _fail_unsettled(outcomes, BulkUnavailable(f"cannot connect to {self.endpoint}: {error}"))
            return False
        pending: deque[int] = deque()
        num_replies = 0
        try:
            for index in [i for i, outcome in enumerate(outcomes) if outcome is None]:
                try:
                    buffers = parts.get(index)
                except Exception as error:  # noqa: BLE001 - reported for its key, the others go on
                    outcomes[index] = error
                    continue
                if len(pending) >= self.put_window:
                    settle_put(sock, pending.popleft(), outcomes)
                    num_replies += 1
                size = sum(memoryview(buffer).nbytes for buffer in buffers)
                request = REQUEST.pack(OP_PUT_STREAMED, len(keys[index]), size) + keys[index]
                pending.append(index)
                send_buffers(sock, request, *buffers)
            while pending:
                settle_put(sock, pending.popleft(), outcomes)
                num_replies += 1
        except OSError as error:  # ssl.SSLError and ConnectionError are OSErrors
            sock.close()
            error = _as_timeout(error)
            if pooled and num_replies == 0 and not isinstance(error, TimeoutError):
                self._close_idle()  # closed while idle (a restart): they are as old as this one
                return True
            _fail_unsettled(outcomes, BulkUnavailable(f"bulk transfer with {self.endpoint} failed: {error}"))
            return False
        except BaseException:
            sock.close()
            raise
        self._give_back(sock)
        return False

    def get(self, key: str) -> memoryview | None:
        """The value of ``key`` (a new buffer the caller owns, ``receive_buffers``) or None when
        the server does not hold it (not verified here)."""
        try:
            return self._call(get_value, key)
        except BulkStatusError as error:
            if error.code == STATUS_NOT_FOUND:
                return None
            raise

    def get_chunk(self, key: str, destination: Destination) -> KVChunk | None:
        """Read ``key``'s chunk straight into ``destination(header)`` (a tensor: the caller's buffer
        or a new one; see ``storage_backends.chunk_receiver``), verifying it as it lands; None when
        the server does not hold it. ChunkFormatError for a corrupt value, ValueError from
        ``destination`` (the connection stays usable after both)."""
        try:
            return self._call(get_chunk_into, key, destination)
        except BulkStatusError as error:
            if error.code == STATUS_NOT_FOUND:
                return None
            raise

    def count_staged_put(self) -> None:
        """One more Put went through a staging area (``num_staged_puts``)."""
        with self._lock:
            self.num_staged_puts += 1

    def _close_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._close_idle()
        self.receive_buffers.clear()


class _PartsCache:
    """Each item's parts, made once when first needed (a retry on a new connection reuses them)."""

    def __init__(self, items: Sequence[tuple[str, PartsSource]]) -> None:
        self._sources = [source for _, source in items]
        self._made: dict[int, ValueParts] = {}

    def get(self, index: int) -> ValueParts:
        if index not in self._made:
            source = self._sources[index]
            self._made[index] = tuple(source() if callable(source) else source)
        return self._made[index]


def _as_timeout(error: OSError) -> OSError:
    """A blocking socket's call that its kernel timeout ended (EAGAIN) as a TimeoutError."""
    if isinstance(error, BlockingIOError):
        return TimeoutError(f"timed out ({error})")
    return error


def _fail_unsettled(outcomes: list, error: BulkUnavailable) -> None:
    for index, outcome in enumerate(outcomes):
        if outcome is None:
            outcomes[index] = error
