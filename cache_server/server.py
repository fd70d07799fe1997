"""Start, run and stop the cache server (``kvstash cache-server`` calls :func:`run`).

One server = one ``grpc.aio`` server with the KVCache and Admin services, the
standard ``grpc.health.v1`` health service and server reflection, plus (unless
``bulk_port`` is None) the bulk data channel for Put/Get values
(``cache_server.bulk_server``), over one :class:`~cache_server.store.TieredStore`.
Several servers can run in one process; nothing here is global.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING, new calls and bulk
connections are refused, in-flight calls and bulk requests get ``grace_s``
seconds to finish, then the store is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys
import tempfile

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from cache_server.allocator import retain_freed_memory
from cache_server.auth import BearerTokenInterceptor
from cache_server.bulk_server import BulkServer
from cache_server.config import ServerConfig
from cache_server.heap_reserve import HeapReserve
from cache_server.malformed import MalformedRequestInterceptor
from cache_server.ports import SERVER_OPTIONS, check_port_free
from cache_server.service import AdminService, Counters, KVCacheService, kvcache_handler
from cache_server.store import TieredStore
from protos import kvstash_pb2, kvstash_pb2_grpc
from protos.bulk_wire import PROTOCOL_VERSION
from storage_backends.grpc_channel import CHANNEL_OPTIONS
from storage_backends.host_identity import host_identity

logger = logging.getLogger(__name__)

SERVICE_NAMES = tuple(service.full_name for service in kvstash_pb2.DESCRIPTOR.services_by_name.values())


class CacheServer:
    """A started server. Build with :meth:`start`; end with :meth:`stop` (idempotent)."""

    def __init__(
        self,
        config: ServerConfig,
        store: TieredStore,
        server: grpc.aio.Server,
        port: int,
        bulk: BulkServer | None,
    ) -> None:
        self.config = config
        self.store = store
        self.port = port
        #: the bulk channel's port, 0 when it is off
        self.bulk_port = bulk.port if bulk is not None else 0
        #: the bulk channel's Unix socket, None when there is none
        self.bulk_socket = bulk.unix_path if bulk is not None else None
        self._server = server
        self._bulk = bulk
        self._health = health_aio.HealthServicer()
        self._stopped = False
        #: the folder made for an "auto" bulk socket, removed on stop
        self._socket_dir: str | None = None

    @classmethod
    async def start(cls, config: ServerConfig) -> CacheServer:
        """Open the storage tiers, bind the port and start serving. Called once per server."""
        store = TieredStore(config)
        bulk = None
        socket_dir = None
        try:
            tenants = config.tenant_registry()
            interceptors = [BearerTokenInterceptor(tenants)] if tenants is not None else []
            interceptors.append(MalformedRequestInterceptor())  # after auth: no token, no parsing
            check_port_free("the gRPC port", config.host, config.port)
            server = grpc.aio.server(interceptors=interceptors, options=CHANNEL_OPTIONS + SERVER_OPTIONS)
            counters = Counters()
            kvcache = KVCacheService(store, config.limits, counters, tenants)
            if config.bulk_port is not None:
                unix_path = config.bulk_socket
                if unix_path == "auto":
                    # A private folder (mode 0700): only this user's processes reach the socket.
                    socket_dir = tempfile.mkdtemp(prefix="kvstash-bulk-")
                    unix_path = os.path.join(socket_dir, "bulk.sock")
                bulk = BulkServer(
                    kvcache,
                    config.host,
                    config.bulk_port,
                    tenants=tenants,
                    tls_context=_server_tls_context(config),
                    max_connections=config.limits.max_bulk_connections,
                    unix_path=unix_path,
                )
                kvcache.bulk_endpoint = kvstash_pb2.BulkEndpointResponse(
                    port=bulk.port,
                    tls=config.tls_cert is not None,
                    protocol_version=PROTOCOL_VERSION,
                    unix_path=unix_path or "",
                    host_id=host_identity() if unix_path else "",
                    instance_id=bulk.instance_id,
                )
            server.add_generic_rpc_handlers((kvcache_handler(kvcache),))
            admin_service = AdminService(store, config.limits, counters, tenants)
            kvstash_pb2_grpc.add_AdminServicer_to_server(admin_service, server)
            address = f"{config.host}:{config.port}"
            if config.tls_cert is not None:
                with open(config.tls_key, "rb") as key_file, open(config.tls_cert, "rb") as cert_file:
                    credentials = grpc.ssl_server_credentials([(key_file.read(), cert_file.read())])
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
            instance = cls(config, store, server, port, bulk)
            instance._socket_dir = socket_dir
            health_pb2_grpc.add_HealthServicer_to_server(instance._health, server)
            reflection.enable_server_reflection(
                (
                    *SERVICE_NAMES,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                server,
            )
            await server.start()
            if bulk is not None:
                bulk.start()
        except Exception:
            if bulk is not None:
                bulk.stop(0)
            _remove_folder(socket_dir)
            store.close()
            raise
        for name in ("", *SERVICE_NAMES):
            await instance._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return instance

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Turn health NOT_SERVING, let in-flight calls finish within the grace period, close storage."""
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        grace_s = self.config.grace_s if grace_s is None else grace_s
        stopping = [self._server.stop(grace_s)]
        if self._bulk is not None:
            stopping.append(asyncio.to_thread(self._bulk.stop, grace_s))
        await asyncio.gather(*stopping)
        _remove_folder(self._socket_dir)
        await asyncio.to_thread(self.store.close)


def _remove_folder(path: str | None) -> None:
    """Remove the (empty once the socket is gone) folder of an "auto" bulk socket."""
    if path is not None:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _server_tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The bulk channel's TLS settings: the gRPC port's certificate and key (None without TLS)."""
    if config.tls_cert is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


def _describe_tier(tier) -> str:
    """A tier's name for the start-up log line; the disk tier's says how it does I/O."""
    if tier.name != "disk":
        return tier.name
    return f"disk ({'direct' if tier.stats().get('direct_io') else 'buffered'} I/O)"


async def serve(config: ServerConfig) -> None:
    """Run a server until SIGTERM or SIGINT, then shut it down gracefully."""
    server = await CacheServer.start(config)
    scheme = "grpcs" if config.tls_cert else "grpc"
    # Tests and scripts read this line to learn the port (the config may ask for port 0).
    print(f"kvstash cache server listening on {scheme}://{config.host}:{server.port}", flush=True)
    tiers = ", ".join(_describe_tier(tier) for tier in server.store.tiers)
    bulk = f"port {server.bulk_port}" if server.bulk_port else "off"
    if server.bulk_socket:
        bulk += f" and Unix socket {server.bulk_socket}"
    registry = config.tenant_registry()
    auth = "off" if registry is None else f"{len(registry.tenants)} tenant(s)"
    logger.info("tiers: %s; auth %s; bulk channel %s", tiers, auth, bulk)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    try:
        await stop_requested.wait()
        logger.info("shutting down: health NOT_SERVING, %.1f s grace for in-flight calls", config.grace_s)
    finally:
        await server.stop()
    logger.info("stopped")


def run(config: ServerConfig) -> None:
    """Blocking entry point for the CLI: the process serves only this server, so it may
    tune its allocator (``cache_server.allocator``)."""
    # A taken port fails here, in a line, before the heap reserve faults memory in.
    check_port_free("the gRPC port", config.host, config.port)
    if config.bulk_port:
        check_port_free("the bulk port", config.host, config.bulk_port)
    reserve = None
    if not retain_freed_memory():
        logger.warning("could not tune malloc; freed value memory goes back to the OS")
    elif config.heap_reserve_bytes:
        reserve = HeapReserve(config.heap_reserve_bytes, config.memory_bytes)
        if reserve.start():
            logger.info("%s", reserve.describe())
        else:
            reserve = None
    try:
        asyncio.run(serve(config))
    finally:
        if reserve is not None:
            reserve.stop()
    sys.stdout.flush()
