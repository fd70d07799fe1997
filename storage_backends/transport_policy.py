"""Which path a ``grpc://`` tier's values take: the bulk channel's Unix socket, its TCP port, or gRPC.

:class:`BulkTransportPolicy` asks the server for its bulk endpoint
(``GetBulkEndpoint``) when the tier is created, on a thread of its own
(:meth:`BulkTransportPolicy.prepare`; failing that, on the first Put or Get) and
builds a :class:`~storage_backends.bulk_channel.BulkClient`:

- over the server's Unix socket when the server runs on this host (its host
  identity equals ours, ``storage_backends.host_identity``), the socket file
  exists and a connection to it is answered with the server's instance id (so it
  is the advertised server's socket); the same-host fast path;
- otherwise over the bulk TCP port (TLS when the gRPC channel uses it);
- no client (values go over gRPC) when the server has no bulk channel, the
  client turned it off (``?bulk=off``) or it failed.

When a bulk call fails (refused, reset, timed out, garbled) the caller retries it
over gRPC and reports the failure here; the channel is then asked for again
``BULK_RETRY_S`` seconds later, doubling after each failure in a row up to
``BULK_MAX_RETRY_S`` (an unreachable port costs a connect each time). A restarted
server (new port, new socket) is found again that way. The path in use is logged
once at INFO each time it changes; a server that does not answer is logged once at
WARNING (``remote tier grpc://HOST:PORT is unreachable (connection refused); its chunks
are misses until it answers``), not as a path.

Thread-safe; one instance per tier, called on every Put and Get.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable

from protos import kvstash_pb2
from storage_backends.bulk_channel import SUPPORTED_PROTOCOL_VERSIONS, BulkClient
from storage_backends.bulk_errors import BulkStatusError, BulkUnavailable

#: seconds values go over gRPC after the bulk channel failed (or was off) before it is asked for again
BULK_RETRY_S = 5.0
#: the longest such wait, reached after failures in a row
BULK_MAX_RETRY_S = 300.0
#: seconds a bulk connection may take to open (a filtered port must not stall a call for the whole timeout)
BULK_CONNECT_TIMEOUT_S = 3.0
TRANSPORT_GRPC = "grpc"
#: what ``_logged_transport`` holds while the server does not answer
_UNREACHABLE = "unreachable"

logger = logging.getLogger(__name__)


class BulkTransportPolicy:
    """Discovery, the choice of path and the fallback to gRPC for one tier.

    ``ask_endpoint()`` makes the ``GetBulkEndpoint`` call (raising ``grpc.RpcError``);
    ``host`` is the server's host name for TCP; ``local`` False never uses the Unix socket
    (``?local=off``); ``host_id`` is this process's host identity ("" matches no server).
    """

    def __init__(
        self,
        *,
        address: str,
        ask_endpoint: Callable[[], kvstash_pb2.BulkEndpointResponse],
        token: str | None,
        timeout_s: float,
        secure: bool,
        ca_path: str | None,
        enabled: bool,
        local: bool,
        max_connections: int,
        host_id: str,
    ) -> None:
        self.address = address
        self._ask_endpoint = ask_endpoint
        self._token = token
        self._timeout_s = timeout_s
        self._secure = secure
        self._ca_path = ca_path
        self._enabled = enabled
        self._local = local
        self._max_connections = max_connections
        self._host_id = host_id
        self._lock = threading.Lock()
        self._discovery_lock = threading.Lock()  # held while GetBulkEndpoint and the first connect run
        self._client: BulkClient | None = None
        self._closed = False
        self._asked_at = -BULK_MAX_RETRY_S  # monotonic time of the last GetBulkEndpoint
        self._retry_s = BULK_RETRY_S  # wait after the last failure
        self._num_failures_in_row = 0
        self._logged_transport: str | None = None

    @property
    def transport(self) -> str:
        """The path values take now: "unix", "tcp" or "grpc"."""
        client = self._client
        return client.transport if client is not None else TRANSPORT_GRPC

    def client(self) -> BulkClient | None:
        """The bulk channel, asking the server for it at most once per retry period; None: use gRPC.

        Callers that arrive while another one asks wait for its answer (so a burst of first
        calls does not go over gRPC, nor open the channel twice)."""
        if self._client is not None or self._closed or not self._enabled:
            return self._client
        with self._discovery_lock:
            with self._lock:
                if self._client is not None or self._closed:
                    return self._client
                now = time.monotonic()
                if now - self._asked_at < self._retry_s:
                    return None
                self._asked_at = now
            client = self._discover()
            if client is None:
                return None
            return self._install(client)

    def prepare(self) -> None:
        """Open the bulk channel ahead of the first call: the tier runs this once, on a thread
        of its own, when it is created, so its first Put or Get does not pay ``GetBulkEndpoint``
        and the first connection (2 to 9 ms on the 2-core VM: 5 to 15% of a benchmark round of
        128 Puts of 2 MiB, docs/benchmarks.md). Calls that come meanwhile wait for it, as they
        wait for another call's discovery. When it finds no usable channel (or fails), nothing
        is remembered: the first call asks again, as it would have without this."""
        with self._discovery_lock:
            with self._lock:
                if self._client is not None or self._closed or not self._enabled:
                    return
            try:
                client = self._discover()
            except Exception as error:  # noqa: BLE001 - e.g. the tier closed its channel meanwhile
                logger.debug("bulk channel of %s not opened ahead: %s", self.address, error)
                return
            if client is not None:
                self._install(client)

    def _install(self, client: BulkClient) -> BulkClient | None:
        """Use ``client`` from now on (None, and ``client`` closed, when the tier closed meanwhile)."""
        with self._lock:
            if self._closed:
                client.close()
                return None
            self._client = client
        self._log_transport(client.transport, client.endpoint)
        return client

    def _discover(self) -> BulkClient | None:
        """The bulk channel the server offers, or None (logged once: the server is unreachable,
        or it answers but offers no usable channel, so values go over gRPC)."""
        import grpc

        try:
            endpoint = self._ask_endpoint()
        except grpc.RpcError as error:
            code = error.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._log_unreachable(code == grpc.StatusCode.DEADLINE_EXCEEDED, error.details() or "")
            else:  # e.g. an older server without GetBulkEndpoint (UNIMPLEMENTED)
                self._log_transport(TRANSPORT_GRPC, f"the server has no bulk channel: {code.name}")
            return None
        if not endpoint.port:
            self._log_transport(TRANSPORT_GRPC, "the server has no bulk channel")
            return None
        if endpoint.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS or endpoint.tls != self._secure:
            # A server with TLS on gRPC has it on the bulk port too; anything else is not used.
            self._log_transport(TRANSPORT_GRPC, "the server's bulk channel does not match this client")
            return None
        if self.same_host(endpoint):
            unix_client = self._client_for(endpoint, unix_path=endpoint.unix_path)
            # the socket at that path must be this server's (not another one's on this host)
            unix_client.server_instance_id = endpoint.instance_id
            try:
                unix_client.check()
                return unix_client
            except (BulkUnavailable, BulkStatusError) as error:
                unix_client.close()
                logger.info(
                    "the Unix socket %s of %s is not usable (%s); using TCP",
                    endpoint.unix_path,
                    self.address,
                    error,
                )
        return self._client_for(endpoint, unix_path=None)

    def same_host(self, endpoint: kvstash_pb2.BulkEndpointResponse) -> bool:
        """True when ``endpoint`` offers a Unix socket this process can use: on for this tier,
        the server's host identity is ours and the socket file exists here."""
        return (
            self._local
            and bool(endpoint.unix_path)
            and bool(self._host_id)
            and endpoint.host_id == self._host_id
            and os.path.exists(endpoint.unix_path)
        )

    def _client_for(self, endpoint: kvstash_pb2.BulkEndpointResponse, *, unix_path: str | None) -> BulkClient:
        tls_context = (
            ssl.create_default_context(cafile=self._ca_path) if self._secure and unix_path is None else None
        )
        return BulkClient(
            self.address.rsplit(":", 1)[0].strip("[]"),
            endpoint.port,
            token=self._token,
            timeout_s=self._timeout_s,
            connect_timeout_s=min(self._timeout_s, BULK_CONNECT_TIMEOUT_S),
            tls_context=tls_context,
            max_connections=self._max_connections,
            unix_path=unix_path,
            protocol_version=endpoint.protocol_version,
        )

    def succeeded(self) -> None:
        """A bulk call went through."""
        with self._lock:
            self._num_failures_in_row = 0

    def failed(self, client: BulkClient, error: BulkUnavailable) -> None:
        """Stop using a bulk channel that failed; this call and those of the next retry period
        (doubled after each failure in a row) go over gRPC instead."""
        with self._lock:
            if self._client is client:
                self._client = None
                self._asked_at = time.monotonic()
                self._retry_s = min(BULK_RETRY_S * 2**self._num_failures_in_row, BULK_MAX_RETRY_S)
                self._num_failures_in_row += 1
            retry_s = self._retry_s
        # INFO, not WARNING: the call goes on over gRPC, and a server that is really down is
        # reported once by the caller (the connector's tier incident), not once per channel.
        logger.info("bulk channel of %s failed, using gRPC for %g s: %s", self.address, retry_s, error)
        self._logged_transport = TRANSPORT_GRPC
        client.close()

    def _log_unreachable(self, timed_out: bool, details: str) -> None:
        """One plain WARNING line per outage: the tier is created (the engine starts) and its
        reads are misses until the server answers (the connector's breaker keeps asking)."""
        if timed_out:
            reason = f"no answer within {self._timeout_s:g} s"
        elif "refused" in details.lower():
            reason = "connection refused"
        else:  # gRPC's text ends with the cause, e.g. "...: DNS resolution failed for x:1"
            reason = details.rsplit(": ", 1)[-1].strip() or "no connection"
        if self._logged_transport != _UNREACHABLE:
            self._logged_transport = _UNREACHABLE
            scheme = "grpcs" if self._secure else "grpc"
            logger.warning(
                "remote tier %s://%s is unreachable (%s); its chunks are misses until it answers",
                scheme,
                self.address,
                reason,
            )

    def _log_transport(self, transport: str, detail: str) -> None:
        if transport != self._logged_transport:
            self._logged_transport = transport
            logger.info("grpc tier %s: values move over %s (%s)", self.address, transport, detail)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
