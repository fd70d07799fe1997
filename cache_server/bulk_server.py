"""The bulk data channel's server side: Put and Get values over plain TCP (or TLS).

The wire format is in ``protos/bulk_wire.py`` (which the client imports too), the
reasons for a second port in ``storage_backends/bulk_channel.py``. This side is a
``socketserver`` listener with one thread per connection: a Put's value goes from the
socket with ``recv_into`` straight into the buffer the memory tier keeps
(:class:`~cache_server.value_assembly.ValueAssembler`, checksummed as it arrives; a
connection's state and reads are in ``cache_server/bulk_connection.py``), and
``recv``/``send`` release the GIL, so connections move bytes in
parallel with each other and with the gRPC event loop.

Every request goes through the same checks as the gRPC handlers (it calls the
same :class:`~cache_server.service.KVCacheService` methods): key and value
limits, concurrent-stream slots, the memory-tier cap, header and checksum
verification before storing. The bearer token is checked once per connection
(constant-time compare) and names the connection's tenant; each Put and Get is
then checked against that tenant's key prefixes (PERMISSION_DENIED otherwise, as
over gRPC). With a TLS certificate every connection is TLS.
A bad request gets an error reply with the gRPC-style status and message the
gRPC path would give; a garbled or dropped connection is closed and never
reaches the store. Nothing a client sends can stop the server.

Slow clients: every phase of a connection has a whole deadline, not a per-``recv``
timeout that a trickle of bytes keeps resetting. The TLS handshake and hello get
``Limits.request_timeout_s`` in all; a request gets as much for its header and
key, and ``Limits.transfer_deadline_s(value size)`` from its first byte for the
whole request with its value (a minimum data rate). One watchdog thread
(:meth:`BulkServer._cut_late_connections`) shuts the socket of a connection past
its deadline; its thread then frees the stream slot and the reserved memory.

The same protocol is served on a Unix domain socket as well (``unix_path``),
for clients on this host: no TCP/IP stack, no TLS (the kernel carries the bytes
within the machine); the token is checked as on TCP, and so are the deadlines.
A Get is sent from the stored buffer itself: reply header and value leave in
one ``sendmsg`` of two memoryviews (no copy, no join). A Unix-socket connection
may also ask for a shared-memory staging area (``storage_backends.staging_area``,
at most ``Limits.max_staging_bytes``, reserved against the memory tier's cap
while in use; when the connection ends it is kept for the same tenant's next
connection, ``cache_server.staging_pool``); its staged Puts leave the value there and send only
the request, and the server copies the value out into the buffer it keeps,
checksumming it on the way, with every check a streamed Put gets.

Built and started by :class:`cache_server.server.CacheServer`, stopped by it
(:meth:`BulkServer.stop`: no new connections, requests in flight get the grace
period to finish, idle connections are closed).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable

import grpc

from cache_server.bulk_connection import (
    BulkConnection,
    ProtocolError,
    StagedProgress,
    decode_key,
    discard_value,
    receive_bytes,
    receive_value,
)
from cache_server.ports import PortInUseError
from cache_server.service import KVCacheService, RequestError, short_key, status_for
from cache_server.staging_pool import HeldArea, StagingAreaPool
from cache_server.tenants import TenantRegistry
from cache_server.value_assembly import ValueAssembler
from protos import bulk_wire as wire
from storage_backends.staging_area import create_sealed_area, staging_supported

logger = logging.getLogger(__name__)

#: seconds a connection may sit idle between requests before the server closes it (an
#: authenticated client's pooled connection; unauthenticated ones get the hello deadline)
IDLE_TIMEOUT_S = 300.0
#: how often the watchdog looks for connections past their deadline
DEADLINE_POLL_S = 0.1
#: how often stop() looks for connections that went idle
STOP_POLL_S = 0.05
#: the memory tier's name for the room a staging area holds (never a stored key)
STAGING_RESERVATION_KEY = "<bulk staging area>"


class _Listener(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    # socketserver's default backlog of 5 drops the SYNs of a burst of new clients while the
    # accept thread waits for a core, and each dropped SYN costs its client a 1 s retransmit.
    request_queue_size = socket.SOMAXCONN

    def __init__(self, address: tuple[str, int], bulk: BulkServer) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.bulk = bulk
        super().__init__(address, _Handler)


class _UnixListener(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = socket.SOMAXCONN

    def __init__(self, path: str, bulk: BulkServer) -> None:
        self.bulk = bulk
        super().__init__(path, _Handler)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        transport = wire.TRANSPORT_UNIX if self.request.family == socket.AF_UNIX else wire.TRANSPORT_TCP
        self.server.bulk.serve_connection(self.request, transport)


class BulkServer:
    """The bulk port of one cache server. ``start()`` once, ``stop()`` once (idempotent)."""

    def __init__(
        self,
        service: KVCacheService,
        host: str,
        port: int,
        *,
        tenants: TenantRegistry | None,
        tls_context: ssl.SSLContext | None,
        max_connections: int,
        unix_path: str | None = None,
    ) -> None:
        self._service = service
        #: None: an open server (every HELLO is accepted, as an admin)
        self._tenants = tenants
        self._limits = service.limits
        #: random id of this server, answered to every HELLO and advertised in GetBulkEndpoint
        self.instance_id = secrets.token_hex(16)
        self._tls_context = tls_context
        self._max_connections = max_connections
        try:
            self._listener = _Listener((host, port), self)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError("the bulk port", host, port) from None
            raise
        self.port: int = self._listener.server_address[1]
        #: the Unix socket's path (None: no Unix socket)
        self.unix_path = unix_path
        self._unix_listener: _UnixListener | None = None
        if unix_path is not None:
            try:
                _remove_stale_socket(unix_path)
                self._unix_listener = _UnixListener(unix_path, self)
            except BaseException:
                self._listener.server_close()
                raise
        self._connections: set[BulkConnection] = set()
        #: areas of ended connections, for the next connection of the same tenant
        self._staging_pool = StagingAreaPool(self.largest_staging_area)
        self._lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def _listeners(self) -> list[socketserver.BaseServer]:
        return [self._listener] + ([self._unix_listener] if self._unix_listener is not None else [])

    def start(self) -> None:
        for listener in self._listeners():
            thread = threading.Thread(target=listener.serve_forever, name="kvstash-bulk-accept", daemon=True)
            thread.start()
            self._threads.append(thread)
        threading.Thread(
            target=self._cut_late_connections, name="kvstash-bulk-deadlines", daemon=True
        ).start()

    def _cut_late_connections(self) -> None:
        """Watchdog (its own thread, until stop): shut every connection past its deadline."""
        while not self._stopped.wait(DEADLINE_POLL_S):
            now = time.monotonic()
            with self._lock:
                late = [c for c in self._connections if c.deadline is not None and now > c.deadline]
                for connection in late:
                    connection.deadline = None  # cut once
                    _shut(connection.sock)
            if late:
                self._service.counters.add(num_rejected=len(late))
                logger.info("cut %d bulk connection(s) past their deadline (too slow)", len(late))

    def stop(self, grace_s: float) -> None:
        """Stop accepting, give busy connections ``grace_s`` seconds, then close every connection."""
        if self._stopping:
            return
        self._stopping = True
        self._stopped.set()
        for listener in self._listeners():
            if self._threads:
                listener.shutdown()
            listener.server_close()
        if self.unix_path is not None:
            with contextlib.suppress(OSError):  # already gone
                os.unlink(self.unix_path)
        deadline = time.monotonic() + grace_s
        try:
            while True:
                with self._lock:
                    if not self._connections:
                        return
                    force = time.monotonic() > deadline
                    for connection in self._connections:
                        if force or not connection.busy:
                            _shut(connection.sock)
                    if force:
                        return
                time.sleep(STOP_POLL_S)
        finally:
            self._staging_pool.close()

    # ---- one connection ------------------------------------------------------------
    def serve_connection(self, sock: socket.socket, transport: str) -> None:
        """Serve one client until it disconnects, breaks the protocol or the server stops.
        Runs on the connection's own thread; never raises."""
        connection = BulkConnection(sock, transport)
        with self._lock:
            self._connections.add(connection)
            num_connections = len(self._connections)
        try:
            if num_connections > self._max_connections:
                # Checked before the handshake, so connections that never say hello cannot
                # hold more threads than the limit either. The client falls back to gRPC.
                self._service.counters.add(num_rejected=1)
                logger.info(
                    "bulk connection refused: %d open (limit %d)", num_connections - 1, self._max_connections
                )
                return
            if transport == wire.TRANSPORT_TCP:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                wire.tune_unix_socket(sock)
            # The handshake and hello together get one deadline, however the bytes trickle in.
            connection.deadline = time.monotonic() + self._limits.request_timeout_s
            sock.settimeout(self._limits.request_timeout_s)
            if self._tls_context is not None and transport == wire.TRANSPORT_TCP:
                sock = connection.sock = self._tls_context.wrap_socket(sock, server_side=True)
            if self._accept_hello(connection):
                connection.deadline = None
                self._serve_requests(connection)
        except (OSError, ProtocolError) as error:
            # A client that went away or broke the format: its connection ends, nothing else.
            logger.debug("bulk connection closed: %s", error)
        except Exception:  # noqa: BLE001 - one connection's bug must not take down the server
            logger.exception("unexpected error on a bulk connection")
        finally:
            with self._lock:
                self._connections.discard(connection)
            self._release_staging(connection)
            connection.sock.close()

    def _accept_hello(self, connection: BulkConnection) -> bool:
        sock = connection.sock
        magic, token_len = wire.HELLO.unpack(receive_bytes(sock, wire.HELLO.size))
        if magic != wire.MAGIC:
            sock.sendall(wire.encode_reply(wire.STATUS_INVALID_ARGUMENT, "not a kvstash bulk client"))
            return False
        if token_len > wire.MAX_TOKEN_BYTES:
            sock.sendall(wire.encode_reply(wire.STATUS_UNAUTHENTICATED, "missing or wrong bearer token"))
            return False
        token = receive_bytes(sock, token_len)
        if self._tenants is not None:
            # Constant-time comparisons: response timing must not reveal a token.
            tenant = self._tenants.tenant_for_token(token)
            if tenant is None:
                self._service.counters.add(num_rejected=1)
                sock.sendall(wire.encode_reply(wire.STATUS_UNAUTHENTICATED, "missing or wrong bearer token"))
                return False
            connection.tenant = tenant
        sock.sendall(wire.encode_reply(wire.STATUS_OK, self.instance_id))
        return True

    def _serve_requests(self, connection: BulkConnection) -> None:
        sock = connection.sock
        # Within a request the watchdog enforces the deadline (it shuts the socket), so the
        # socket blocks: Python polls before every recv and send of a socket with a timeout,
        # a second system call each (~15 per 2 MiB staged Put, docs/benchmarks.md). A plain
        # socket blocks for good and the kernel times out the wait for the next request
        # (SO_RCVTIMEO: a recv that waits longer fails), so no system call switches modes
        # per request; a TLS socket switches with settimeout (its reads must not fail midway).
        kernel_idle_timeout = not isinstance(sock, ssl.SSLSocket)
        if kernel_idle_timeout:
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wire.timeval(IDLE_TIMEOUT_S))
        while not self._stopping:
            if not kernel_idle_timeout:
                sock.settimeout(IDLE_TIMEOUT_S)
            first = sock.recv(1)
            if not first:
                return  # the client closed between requests: the normal end
            if not kernel_idle_timeout:
                sock.settimeout(None)
            connection.busy = True
            started = time.monotonic()
            connection.deadline = started + self._limits.request_timeout_s
            op, key_len, value_len = wire.REQUEST.unpack(first + receive_bytes(sock, wire.REQUEST.size - 1))
            key_bytes = receive_bytes(sock, key_len)
            if op in (wire.OP_PUT, wire.OP_PUT_STREAMED, wire.OP_PUT_STAGED):
                connection.deadline = started + self._limits.transfer_deadline_s(value_len)
                if op == wire.OP_PUT:
                    self._put(connection, key_bytes, value_len)
                elif op == wire.OP_PUT_STREAMED:
                    self._put_streamed(connection, key_bytes, value_len)
                else:
                    self._put_staged(connection, key_bytes, value_len)
            elif op == wire.OP_GET and value_len == 0:
                self._get(connection, key_bytes, started)
            elif op == wire.OP_STAGING_AREA:
                self._give_staging_area(connection, key_bytes, value_len)
            else:
                # What follows the header cannot be trusted, so the connection ends here.
                sock.sendall(
                    wire.encode_reply(wire.STATUS_INVALID_ARGUMENT, f"malformed bulk request (op {op})")
                )
                raise ProtocolError(f"op {op} with a value of {value_len} bytes")
            connection.busy = False
            connection.deadline = None

    def _put_key(self, connection: BulkConnection, key_bytes: bytes) -> str:
        """The Put's key, checked and allowed for the connection's tenant (RequestError if not)."""
        service = self._service
        return service.check_access(connection.tenant, service.check_key(decode_key(key_bytes)), "put")

    def _receive_and_store(
        self, key: str, value_len: int, receive: Callable[[ValueAssembler], memoryview]
    ) -> None:
        """Reserve the value's memory, take the value through ``receive`` (which fills the
        assembler: from the socket, or from a staging area), verify and store it. The
        reservation is released whatever happens (a no-op once stored). Called by the three
        kinds of Put inside their stream slot."""
        service = self._service
        reservation = service.store.memory.reserve(key, value_len)
        try:
            data = receive(ValueAssembler(value_len, key))
            service.store.put_verified(key, data, reservation)
        finally:
            reservation.release()

    def _put(self, connection: BulkConnection, key_bytes: bytes, value_len: int) -> None:
        """Answer "send it" or an error before any value byte moves; then receive, verify and store."""
        service, sock = self._service, connection.sock

        def receive(assembler: ValueAssembler) -> memoryview:
            sock.sendall(wire.encode_reply(wire.STATUS_OK))
            return receive_value(sock, assembler)

        try:
            with service.stream_slot():
                key = self._put_key(connection, key_bytes)
                self._receive_and_store(key, service.check_size(value_len), receive)
        except (OSError, ProtocolError):
            raise
        except Exception as error:  # noqa: BLE001 - every refusal becomes a reply, never a crash
            self._refuse(sock, error)
            return
        service.counters.count_put(connection.transport, value_len)
        sock.sendall(wire.encode_reply(wire.STATUS_OK, value_len=value_len))

    def _put_streamed(self, connection: BulkConnection, key_bytes: bytes, value_len: int) -> None:
        """The value follows the request without a "send it": receive, verify and store it, then
        answer once. A refusal before the value was read (key, access, size, memory cap, stream
        slots) reads and drops the whole announced value first, so the connection stays in step
        for the Puts the client has already sent behind it; nothing is stored."""
        service, sock = self._service, connection.sock
        value_consumed = False

        def receive(assembler: ValueAssembler) -> memoryview:
            nonlocal value_consumed
            # Past this point the value is read whatever happens (a refused one is drained).
            value_consumed = True
            return receive_value(sock, assembler)

        try:
            with service.stream_slot():
                key = self._put_key(connection, key_bytes)
                self._receive_and_store(key, service.check_size(value_len), receive)
        except (OSError, ProtocolError):
            raise
        except Exception as error:  # noqa: BLE001 - every refusal becomes a reply, never a crash
            if not value_consumed:
                discard_value(sock, value_len)
            self._refuse(sock, error)
            return
        service.counters.count_put(connection.transport, value_len)
        sock.sendall(wire.encode_reply(wire.STATUS_OK, value_len=value_len))

    @property
    def largest_staging_area(self) -> int:
        """``Limits.max_staging_bytes``, and at most an eighth of the memory tier: areas are
        reserved in it, so on a small tier they must leave room for the values."""
        return min(self._limits.max_staging_bytes, self._service.store.memory_capacity_bytes // 8)

    def _release_staging(self, connection: BulkConnection) -> None:
        """The connection no longer uses its staging area: kept for its tenant's next one."""
        if connection.staging is not None:
            self._staging_pool.keep(connection.tenant.name, connection.staging)
            connection.staging = None

    def _give_staging_area(self, connection: BulkConnection, key_bytes: bytes, num_bytes: int) -> None:
        """Replace the connection's staging area with one of at least ``num_bytes``: a kept area
        of the same tenant (``cache_server.staging_pool``) or a new sealed one, its room
        reserved in the memory tier; its size and descriptor go with the OK reply. Refused (in
        step: nothing follows the request) on TCP, over :attr:`largest_staging_area`, or when
        the memory tier has no room; the connection then keeps no area."""
        sock = connection.sock
        try:
            self._release_staging(connection)
            if connection.transport != wire.TRANSPORT_UNIX or not staging_supported():
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "staging areas are only offered on the Unix socket"
                )
            largest = self.largest_staging_area
            if key_bytes or not 0 < num_bytes <= largest:
                # the reply's value length names the largest area (protocol 4): the client then
                # asks for one it can use as a ring
                self._service.counters.count_failure(grpc.StatusCode.INVALID_ARGUMENT)
                message = f"a staging area takes no key and 1 to {largest} bytes, not {num_bytes}"
                sock.sendall(wire.encode_reply(wire.STATUS_INVALID_ARGUMENT, message, value_len=largest))
                return
            held = self._staging_pool.take(connection.tenant.name, num_bytes)
            if held is None:
                held = self._new_staging_area(num_bytes)
            else:
                try:
                    held.reservation = self._service.store.memory.reserve(
                        STAGING_RESERVATION_KEY, held.area.size
                    )
                except Exception:
                    self._staging_pool.keep(connection.tenant.name, held)
                    raise
            connection.staging = held
        except Exception as error:  # noqa: BLE001 - every refusal becomes a reply, never a crash
            self._refuse(sock, error)
            return
        reply = wire.encode_reply(wire.STATUS_OK, value_len=held.area.size)
        num_sent = socket.send_fds(sock, [reply], [held.fd])
        if num_sent < len(reply):
            sock.sendall(reply[num_sent:])

    def _new_staging_area(self, num_bytes: int) -> HeldArea:
        reservation = self._service.store.memory.reserve(STAGING_RESERVATION_KEY, num_bytes)
        try:
            fd, area = create_sealed_area(num_bytes)
        except OSError as error:
            reservation.release()
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot create a staging area: {error}"
            ) from None
        return HeldArea(fd, area, reservation)

    def _put_staged(self, connection: BulkConnection, key_bytes: bytes, value_len: int) -> None:
        """Store the value the client writes into its staging area: the checks of a streamed Put,
        then each segment the client's progress frames announce is copied into a new buffer and
        checksummed while the client writes the next (the client can still write to the area,
        so only the copy is verified and kept), then one reply. A refusal reads the remaining
        progress frames first, so the connection stays in step.

        A value larger than the area (protocol 4) goes through it as a ring: byte ``i`` at
        ``i % size``; after each quarter of the area copied out the server sends an
        acknowledgement (an OK reply whose value length is the number of bytes copied, always
        less than the value's), and the client writes over a part only once it is acknowledged.
        A refusal is then answered first and the progress frames read after it: the client,
        which may be waiting for an acknowledgement, reads the refusal and sends its last frame."""
        service, sock = self._service, connection.sock
        progress = StagedProgress(sock, value_len)
        area = connection.staging.area if connection.staging is not None else None
        ring = area is not None and value_len > area.size
        acknowledged = [0]

        def acknowledge(num_copied: int) -> None:
            if num_copied < value_len and num_copied - acknowledged[0] >= area.size // 4:
                sock.sendall(wire.encode_reply(wire.STATUS_OK, value_len=num_copied))
                acknowledged[0] = num_copied

        try:
            with service.stream_slot():
                key = self._put_key(connection, key_bytes)
                service.check_size(value_len)
                if area is None:
                    raise RequestError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"a staged value of {value_len} bytes needs a staging area (this connection has none)",
                    )

                def receive(assembler: ValueAssembler) -> memoryview:
                    with area.view() as source:
                        return assembler.fill_from(
                            source[: min(value_len, area.size)],
                            progress.wait_beyond,
                            acknowledge if ring else None,
                        )

                self._receive_and_store(key, value_len, receive)
        except (OSError, ProtocolError):
            raise
        except Exception as error:  # noqa: BLE001 - every refusal becomes a reply, never a crash
            if ring:
                self._refuse(sock, error)
                progress.drain()
            else:
                progress.drain()
                self._refuse(sock, error)
            return
        service.counters.count_put(wire.TRANSPORT_SHM, value_len)
        sock.sendall(wire.encode_reply(wire.STATUS_OK, value_len=value_len))

    def _get(self, connection: BulkConnection, key_bytes: bytes, started: float) -> None:
        service, sock = self._service, connection.sock
        try:
            with service.stream_slot():
                key = service.check_access(connection.tenant, service.check_key(decode_key(key_bytes)), "get")
                service.counters.add(num_gets=1)
                stored = service.store.get(key)
                if stored is None:
                    raise RequestError(grpc.StatusCode.NOT_FOUND, f"key not found: {short_key(key)}")
                # A reader that stalls is cut like a writer that does.
                connection.deadline = started + self._limits.transfer_deadline_s(len(stored.data))
                wire.send_buffers(
                    sock, wire.encode_reply(wire.STATUS_OK, value_len=len(stored.data)), stored.data
                )
        except (OSError, ProtocolError):
            raise
        except Exception as error:  # noqa: BLE001 - every refusal becomes a reply, never a crash
            self._refuse(sock, error)
            return
        service.counters.count_get_hit(connection.transport, len(stored.data))

    def _refuse(self, sock: socket.socket, error: Exception) -> None:
        code, message = status_for(error)
        self._service.counters.count_failure(code)
        sock.sendall(wire.encode_reply(code.value[0], message))


def _remove_stale_socket(path: str) -> None:
    """Remove a Unix socket left at ``path`` by a server that is gone; refuse one that answers."""
    if not os.path.exists(path):
        return
    import stat

    if not stat.S_ISSOCK(os.stat(path).st_mode):
        raise ValueError(f"bulk socket path {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a leftover of a killed server
            return
    raise ValueError(f"bulk socket {path} is in use by another process")


def _shut(sock: socket.socket) -> None:
    """Wake a thread blocked on ``sock`` (the base-class shutdown also works on TLS sockets)."""
    with contextlib.suppress(OSError):  # already closed by its own thread
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
