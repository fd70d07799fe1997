"""Start, run and stop the cache server (``kvstash cache-server`` calls :func:`run`).

One server = one ``grpc.aio`` server with the KVCache and Admin services, the
standard ``grpc.health.v1`` health service and server reflection, over one
:class:`~cache_server.store.TieredStore`. Several servers can run in one process;
nothing here is global.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING, new calls are refused,
in-flight calls get ``grace_s`` seconds to finish, then the store is closed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from cache_server.auth import BearerTokenInterceptor
from cache_server.config import ServerConfig
from cache_server.malformed import MalformedRequestInterceptor
from cache_server.service import AdminService, Counters, KVCacheService, kvcache_handler
from cache_server.store import TieredStore
from protos import kvstash_pb2, kvstash_pb2_grpc
from storage_backends.grpc_backend import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

SERVICE_NAMES = tuple(service.full_name for service in kvstash_pb2.DESCRIPTOR.services_by_name.values())


class CacheServer:
    """A started server. Build with :meth:`start`; end with :meth:`stop` (idempotent)."""

    def __init__(self, config: ServerConfig, store: TieredStore, server: grpc.aio.Server, port: int) -> None:
        self.config = config
        self.store = store
        self.port = port
        self._server = server
        self._health = health_aio.HealthServicer()
        self._stopped = False

    @classmethod
    async def start(cls, config: ServerConfig) -> CacheServer:
        """Open the storage tiers, bind the port and start serving. Called once per server."""
        store = TieredStore(config)
        try:
            interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
            interceptors.append(MalformedRequestInterceptor())  # after auth: no token, no parsing
            server = grpc.aio.server(interceptors=interceptors, options=CHANNEL_OPTIONS)
            counters = Counters()
            server.add_generic_rpc_handlers(
                (kvcache_handler(KVCacheService(store, config.limits, counters)),)
            )
            kvstash_pb2_grpc.add_AdminServicer_to_server(AdminService(store, config.limits, counters), server)
            address = f"{config.host}:{config.port}"
            if config.tls_cert is not None:
                with open(config.tls_key, "rb") as key_file, open(config.tls_cert, "rb") as cert_file:
                    credentials = grpc.ssl_server_credentials([(key_file.read(), cert_file.read())])
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
            instance = cls(config, store, server, port)
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
        except Exception:
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
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        await asyncio.to_thread(self.store.close)


async def serve(config: ServerConfig) -> None:
    """Run a server until SIGTERM or SIGINT, then shut it down gracefully."""
    server = await CacheServer.start(config)
    scheme = "grpcs" if config.tls_cert else "grpc"
    # Tests and scripts read this line to learn the port (the config may ask for port 0).
    print(f"kvstash cache server listening on {scheme}://{config.host}:{server.port}", flush=True)
    tiers = ", ".join(tier.name for tier in server.store.tiers)
    logger.info("tiers: %s; auth %s", tiers, "on" if config.auth_token else "off")
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
    """Blocking entry point for the CLI."""
    asyncio.run(serve(config))
    sys.stdout.flush()
