"""The cache server's settings: where it listens, its storage tiers and its limits.

Built once by the CLI (``kvstash cache-server``) or by a test, then read-only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cache_server.tenants import Tenant, TenantRegistry, build_registry

GIB = 1 << 30
MIB = 1 << 20
#: environment variable with the bearer token (server and clients; storage_backends.grpc_backend reads it too)
AUTH_TOKEN_ENV = "KVSTASH_AUTH_TOKEN"


@dataclass(frozen=True)
class Limits:
    """Per-request limits; a request over one gets INVALID_ARGUMENT or RESOURCE_EXHAUSTED."""

    #: longest key, in UTF-8 bytes
    max_key_bytes: int = 1024
    #: largest value; a 256-token chunk of an 8B model is 32 MiB, so leave room above it
    max_value_bytes: int = 256 * MIB
    #: most keys in one Contains call
    max_contains_keys: int = 65536
    #: Put and Get streams served at once; more are refused, not queued
    max_concurrent_streams: int = 64
    #: largest ListKeys page
    max_page_size: int = 10000
    #: bulk-channel connections open at once (idle ones count); more are refused
    max_bulk_connections: int = 256
    #: largest shared-memory staging area one Unix-socket connection may hold (single Puts up
    #: to about this size skip the socket; ``storage_backends.staging_area``); each area counts
    #: against the memory tier's cap while a connection has it, like an upload in flight, and
    #: is at most an eighth of it. Larger values pass through a smaller area as a ring
    #: (protocol 4). 64 MiB holds a 32 MiB chunk of an 8B model (its area: 33 MiB): in the
    #: benchmark's runs on the 2-core VM that did better than a 16 MiB ring (docs/benchmarks.md)
    max_staging_bytes: int = 64 * MIB
    #: seconds a whole request may take on top of its bytes at ``min_rate_bytes_per_s``: a bulk
    #: hello (with the TLS handshake) or request header gets this much in all, a Put or Get value
    #: this plus its size over the minimum rate; a request past its deadline is cut and its
    #: stream slot and reserved memory are freed (slow-loris clients)
    request_timeout_s: float = 10.0
    #: slowest transfer a value may have (bytes per second), see ``request_timeout_s``
    min_rate_bytes_per_s: int = MIB

    def transfer_deadline_s(self, num_bytes: int) -> float:
        """Seconds a request moving a value of ``num_bytes`` may take in all."""
        return self.request_timeout_s + num_bytes / self.min_rate_bytes_per_s

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"limit {name} must be positive, got {value}")


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``cache_server.server.serve`` needs.

    ``port`` 0 lets the OS pick a free port; the server prints the one it bound.
    ``bulk_port`` is the bulk data channel's TCP port (docs/cache_server.md): 0 lets
    the OS pick one (clients learn it over gRPC), None turns the channel off.
    ``bulk_socket`` is its Unix domain socket for clients on this host: ``"auto"`` (a
    new private folder under the temp dir), a path, or None (none).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    bulk_port: int | None = 0
    bulk_socket: str | None = "auto"
    memory_bytes: int = 4 * GIB
    disk_path: str | None = None
    disk_bytes: int | None = None
    #: read and write the disk tier with O_DIRECT where its filesystem accepts it; off:
    #: buffered I/O through the page cache (faster on hosts with RAM to spare for it)
    disk_direct_io: bool = True
    redis_url: str | None = None
    auth_token: str | None = None
    #: tenants (``--tenants FILE``, read by ``cache_server.tenants.load_tenants``); with
    #: ``auth_token`` too, that token is one more admin tenant
    tenants: tuple[Tenant, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    #: seconds that in-flight calls get to finish after SIGTERM
    grace_s: float = 10.0
    #: free heap memory a background thread keeps faulted in ahead of new values, so that a
    #: fresh server's Puts do not pay a page fault per 4 KiB (``cache_server.heap_reserve``;
    #: the heap never grows past ``memory_bytes`` for it); 0: off
    heap_reserve_bytes: int = GIB
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.bulk_port is not None and not 0 <= self.bulk_port <= 65535:
            raise ValueError(f"bulk port must be in 0..65535, got {self.bulk_port}")
        if self.bulk_socket is not None and not self.bulk_socket.strip():
            raise ValueError("the bulk socket path is empty (use 'auto' or 'off')")
        if self.bulk_port and self.bulk_port == self.port:
            raise ValueError(f"the bulk port and the gRPC port are both {self.port}")
        if self.memory_bytes <= 0:
            raise ValueError(f"memory capacity must be positive, got {self.memory_bytes} bytes")
        if self.disk_bytes is not None and self.disk_bytes <= 0:
            raise ValueError(f"disk capacity must be positive, got {self.disk_bytes} bytes")
        if self.disk_bytes is not None and self.disk_path is None:
            raise ValueError("a disk capacity was given without a disk path")
        if self.disk_path is not None and self.disk_bytes is None:
            # The disk tier always has a cap (it evicts to respect it): no silent unbounded default.
            raise ValueError("--disk-path needs --disk-gb, the disk tier's cap in GiB")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"TLS file not found: {path}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("the auth token is empty")
        if self.heap_reserve_bytes < 0:
            raise ValueError(f"the heap reserve must be >= 0 bytes, got {self.heap_reserve_bytes}")
        if self.grace_s < 0:
            raise ValueError(f"grace period must be >= 0 seconds, got {self.grace_s}")
        self.tenant_registry()  # raises ValueError for duplicate tokens or names

    def tenant_registry(self) -> TenantRegistry | None:
        """Who may do what: None when the server is open (no token, no tenants)."""
        return build_registry(self.tenants, self.auth_token)
