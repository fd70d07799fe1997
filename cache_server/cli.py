"""``kvstash cache-server``: run the cache server in the foreground until SIGTERM.

Attached to the ``kvstash`` root group by ``engine/cli.py``; ``python -m
cache_server`` runs the same command on its own.
"""

from __future__ import annotations

import click

from cache_server.admin_cli import admin
from cache_server.config import AUTH_TOKEN_ENV, GIB, Limits, ServerConfig
from cache_server.tenants import load_tenants

__all__ = ["admin", "cache_server"]


@click.command("cache-server")
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all)."
)
@click.option("--port", type=int, default=50051, show_default=True, help="TCP port; 0 picks a free one.")
@click.option(
    "--bulk-port",
    default="any",
    show_default=True,
    help="TCP port of the bulk data channel for Put/Get values (clients find it over gRPC): "
    "a number, 'any' for a free port, or 0 / 'off' to move values over gRPC only.",
)
@click.option(
    "--bulk-socket",
    default="auto",
    show_default=True,
    help="Unix domain socket of the bulk data channel, used by clients on this host instead of TCP: "
    "'auto' (a private folder under the temp dir), a path, or 'off'.",
)
@click.option(
    "--memory-gb", type=float, default=4.0, show_default=True, help="Byte cap of the memory tier, GiB."
)
@click.option(
    "--disk-path", type=click.Path(file_okay=False), help="Folder of the disk tier (kept across restarts)."
)
@click.option("--disk-gb", type=float, help="Byte cap of the disk tier, GiB (required with --disk-path).")
@click.option(
    "--disk-direct-io/--no-disk-direct-io",
    default=True,
    show_default=True,
    help="Read and write the disk tier with O_DIRECT where the filesystem accepts it; "
    "--no-disk-direct-io: buffered I/O through the page cache (faster with RAM to spare).",
)
@click.option("--redis-url", help="Redis below the disk tier, e.g. redis://redis:6379/0.")
@click.option(
    "--auth-token",
    envvar=AUTH_TOKEN_ENV,
    help=f"Bearer token clients must send (or ${AUTH_TOKEN_ENV}): one admin tenant; "
    "with --tenants it is added to the file's tenants.",
)
@click.option(
    "--tenants",
    "tenants_path",
    type=click.Path(dir_okay=False),
    help="YAML list of {name, token, prefixes, admin}: each token may touch only keys under its "
    "prefixes; Clear and server-wide Stats need admin (docs/cache_server.md).",
)
@click.option("--tls-cert", type=click.Path(dir_okay=False), help="PEM certificate chain for TLS.")
@click.option("--tls-key", type=click.Path(dir_okay=False), help="PEM private key for TLS.")
@click.option(
    "--grace-s", type=float, default=10.0, show_default=True, help="Seconds in-flight calls get on SIGTERM."
)
@click.option(
    "--max-value-mb", type=float, default=256.0, show_default=True, help="Largest value accepted, MiB."
)
@click.option(
    "--max-concurrent-streams",
    type=int,
    default=64,
    show_default=True,
    help="Put/Get streams served at once.",
)
@click.option(
    "--max-bulk-connections",
    type=int,
    default=256,
    show_default=True,
    help="Bulk-channel connections open at once (more are closed; those clients use gRPC).",
)
@click.option(
    "--max-staging-mb",
    type=float,
    default=64.0,
    show_default=True,
    help="Largest shared-memory staging area of one same-host bulk connection, MiB (single Puts "
    "skip the socket: written whole into an area up to this size, larger ones through it as a "
    "ring; each area counts against the memory tier while in use).",
)
@click.option(
    "--heap-reserve-mb",
    type=float,
    default=1024.0,
    show_default=True,
    help="Free memory kept faulted in ahead of new values, MiB (the first reserve before the server "
    "serves, later ones by a background thread; never beyond --memory-gb), so that Puts into a "
    "fresh server do not pay a page fault per 4 KiB; 0: off.",
)
@click.option(
    "--request-timeout-s",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds a request may take in all beyond its bytes at the minimum rate (bulk hello, "
    "request header, Put/Get value); a slower client is cut and its slot and memory freed.",
)
@click.option(
    "--min-rate-mib-s",
    type=float,
    default=1.0,
    show_default=True,
    help="Slowest a Put or Get value may move, MiB/s (its deadline: --request-timeout-s + size / rate).",
)
def cache_server(
    host: str,
    port: int,
    bulk_port: str,
    bulk_socket: str,
    memory_gb: float,
    disk_path: str | None,
    disk_gb: float | None,
    disk_direct_io: bool,
    redis_url: str | None,
    auth_token: str | None,
    tenants_path: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    grace_s: float,
    max_value_mb: float,
    max_concurrent_streams: int,
    max_bulk_connections: int,
    max_staging_mb: float,
    heap_reserve_mb: float,
    request_timeout_s: float,
    min_rate_mib_s: float,
) -> None:
    """Serve KV chunks over gRPC from memory, with optional disk and Redis tiers below."""
    from cache_server.server import run

    try:
        tenants = tuple(load_tenants(tenants_path)) if tenants_path is not None else ()
        config = ServerConfig(
            host=host,
            port=port,
            bulk_port=_parse_bulk_port(bulk_port),
            bulk_socket=None if bulk_socket.strip().lower() == "off" else bulk_socket,
            memory_bytes=int(memory_gb * GIB),
            disk_path=disk_path,
            disk_bytes=int(disk_gb * GIB) if disk_gb is not None else None,
            disk_direct_io=disk_direct_io,
            redis_url=redis_url,
            auth_token=auth_token or None,
            tenants=tenants,
            tls_cert=tls_cert,
            tls_key=tls_key,
            grace_s=grace_s,
            heap_reserve_bytes=int(heap_reserve_mb * (1 << 20)),
            limits=Limits(
                max_value_bytes=int(max_value_mb * (1 << 20)),
                max_concurrent_streams=max_concurrent_streams,
                max_bulk_connections=max_bulk_connections,
                max_staging_bytes=int(max_staging_mb * (1 << 20)),
                request_timeout_s=request_timeout_s,
                min_rate_bytes_per_s=int(min_rate_mib_s * (1 << 20)),
            ),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        run(config)
    except (RuntimeError, ValueError, OSError) as exc:
        # grpc reports a port it cannot bind as a RuntimeError; tiers raise ValueError or BackendError.
        raise click.ClickException(f"cannot start the cache server on {host}:{port}: {exc}") from None


def _parse_bulk_port(text: str) -> int | None:
    """``--bulk-port``: None (off) for "0" or "off", 0 (a free port) for "any", else the port."""
    text = text.strip().lower()
    if text in ("0", "off"):
        return None
    if text == "any":
        return 0
    if not text.isdigit():
        raise click.UsageError(f"--bulk-port must be a port number, 'any' or 'off', got {text!r}")
    return int(text)
