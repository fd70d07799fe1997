"""``kvstash admin --server HOST:PORT …``: inspect and manage a running cache server.

Every subcommand makes one or a few RPCs and prints a rich table, or JSON with
``--json``. Any failure exits non-zero with a one-line reason such as
``cannot reach HOST:PORT`` or ``unauthenticated``.

gRPC modules are imported inside the commands: the ``kvstash`` root command
imports this module, and must start on machines without grpcio-health-checking.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from cache_server.config import AUTH_TOKEN_ENV

TIER_COLUMNS = (
    "num_keys",
    "bytes_used",
    "capacity_bytes",
    "hits",
    "misses",
    "puts",
    "evictions",
    "corrupt",
    "errors",
    "verified",
)
TRANSPORT_COLUMNS = ("num_puts", "num_gets", "bytes_received", "bytes_sent")
BYTE_FIELDS = ("bytes_used", "capacity_bytes", "bytes_received", "bytes_sent")
SERVER_FIELDS = (
    "version",
    "uptime_s",
    "num_active_streams",
    "num_puts",
    "num_gets",
    "num_get_hits",
    "bytes_received",
    "bytes_sent",
    "num_rejected",
)


@dataclass
class AdminTarget:
    """Where and how to call: built once by the group, used by one subcommand."""

    server: str
    metadata: tuple[tuple[str, str], ...]
    tls_ca: str | None
    timeout_s: float

    @contextlib.contextmanager
    def channel(self) -> Iterator[Any]:
        """An open ``grpc.Channel``; RPC failures inside become one-line click errors."""
        import grpc

        from storage_backends.grpc_channel import make_channel

        try:
            channel = make_channel(self.server, secure=self.tls_ca is not None, ca_path=self.tls_ca)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            yield channel
        except grpc.RpcError as error:
            raise click.ClickException(self.reason(error)) from None
        finally:
            channel.close()

    def reason(self, error: Any) -> str:
        """One line for a failed call (``error`` is a ``grpc.RpcError``)."""
        import grpc

        code = error.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return f"cannot reach {self.server}"
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return (
                f"unauthenticated: {self.server} refused the auth token (--auth-token or ${AUTH_TOKEN_ENV})"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"timed out: no answer from {self.server} within {self.timeout_s:g} s"
        if code == grpc.StatusCode.NOT_FOUND:
            return f"not found: {error.details()}"
        return f"{code.name.lower()}: {error.details()}"


def _emit(as_json: bool, data: Any, table: Table | str) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        Console(soft_wrap=True).print(table)


def _count(num: int, noun: str) -> str:
    """``"1 key"``, ``"2 keys"``."""
    return f"{num} {noun}" if num == 1 else f"{num} {noun}s"


def _human_bytes(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


@click.group("admin")
@click.option("--server", required=True, metavar="HOST:PORT", help="Address of the cache server.")
@click.option("--auth-token", envvar=AUTH_TOKEN_ENV, help=f"Bearer token (or ${AUTH_TOKEN_ENV}).")
@click.option("--tls-ca", type=click.Path(dir_okay=False), help="CA certificate (PEM); turns TLS on.")
@click.option("--timeout", "timeout_s", type=float, default=10.0, show_default=True, help="Seconds per call.")
@click.pass_context
def admin(
    ctx: click.Context, server: str, auth_token: str | None, tls_ca: str | None, timeout_s: float
) -> None:
    """Inspect and manage a running kvstash cache server."""
    metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
    ctx.obj = AdminTarget(server, metadata, tls_ca, timeout_s)


@admin.command()
@json_option
@click.pass_obj
def health(target: AdminTarget, as_json: bool) -> None:
    """Standard gRPC health check; exits 1 unless the server is SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with target.channel() as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=target.timeout_s
        )
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    _emit(as_json, {"server": target.server, "status": status}, f"{target.server}: {status}")
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise SystemExit(1)


@admin.command()
@json_option
@click.pass_obj
def stats(target: AdminTarget, as_json: bool) -> None:
    """Server counters and one row per storage tier."""
    from protos import kvstash_pb2, kvstash_pb2_grpc

    with target.channel() as channel:
        reply = kvstash_pb2_grpc.AdminStub(channel).Stats(
            kvstash_pb2.StatsRequest(), timeout=target.timeout_s, metadata=target.metadata
        )
    server = {name: getattr(reply, name) for name in SERVER_FIELDS}
    tiers = [
        {"name": tier.name, **{name: getattr(tier, name) for name in TIER_COLUMNS}} for tier in reply.tiers
    ]
    transports = [
        {"name": path.name, **{name: getattr(path, name) for name in TRANSPORT_COLUMNS}}
        for path in reply.transports
    ]
    server_table = Table("counter", "value", title=f"cache server {target.server}")
    for name, value in server.items():
        shown = (
            _human_bytes(value)
            if name.startswith("bytes")
            else (f"{value:.1f}" if name == "uptime_s" else value)
        )
        server_table.add_row(name, str(shown))
    # One column per tier: the table stays narrow however many counters there are.
    tier_table = Table("counter", *(tier["name"] for tier in tiers), title="tiers")
    for name in TIER_COLUMNS:
        cells = [_human_bytes(tier[name]) if name in BYTE_FIELDS else str(tier[name]) for tier in tiers]
        tier_table.add_row(name, *cells)
    # Values moved per path: "unix" / "tcp" (bulk channel) or "grpc".
    transport_table = Table("transport", *(path["name"] for path in transports), title="transports")
    for name in TRANSPORT_COLUMNS:
        cells = [_human_bytes(path[name]) if name in BYTE_FIELDS else str(path[name]) for path in transports]
        transport_table.add_row(name, *cells)
    grid = Table.grid()
    grid.add_row(server_table)
    grid.add_row(tier_table)
    # A server that moved no value yet has no path to show (JSON: an empty list).
    grid.add_row(transport_table if transports else "transports: no transfers yet")
    _emit(as_json, {"server": server, "tiers": tiers, "transports": transports}, grid)


@admin.command("ls")
@click.option("--prefix", default="", help="Only keys starting with this (e.g. a namespace).")
@click.option("--limit", type=int, default=1000, show_default=True, help="Most keys to show; 0 for all.")
@json_option
@click.pass_obj
def list_keys(target: AdminTarget, prefix: str, limit: int, as_json: bool) -> None:
    """List keys in key order, with the highest tier that holds each."""
    from protos import kvstash_pb2, kvstash_pb2_grpc

    entries: list[dict[str, str]] = []
    page_token = ""
    with target.channel() as channel:
        stub = kvstash_pb2_grpc.AdminStub(channel)
        while limit == 0 or len(entries) < limit:
            page_size = 1000 if limit == 0 else min(1000, limit - len(entries))
            page = stub.ListKeys(
                kvstash_pb2.ListKeysRequest(prefix=prefix, page_size=page_size, page_token=page_token),
                timeout=target.timeout_s,
                metadata=target.metadata,
            )
            entries.extend({"key": entry.key, "tier": entry.tier} for entry in page.entries)
            page_token = page.next_page_token
            if not page_token:
                break
    table = Table("key", "tier", title=f"{len(entries)} keys" + (" (more not shown)" if page_token else ""))
    for entry in entries:
        table.add_row(entry["key"], entry["tier"])
    _emit(as_json, {"keys": entries, "truncated": bool(page_token)}, table)


@admin.command()
@click.argument("key")
@json_option
@click.pass_obj
def info(target: AdminTarget, key: str, as_json: bool) -> None:
    """Size, tier and chunk header of KEY."""
    import grpc

    from protos import kvstash_pb2, kvstash_pb2_grpc

    with target.channel() as channel:
        try:
            reply = kvstash_pb2_grpc.AdminStub(channel).Info(
                kvstash_pb2.InfoRequest(key=key), timeout=target.timeout_s, metadata=target.metadata
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
            # the server's own text names a shortened key; this names the one asked for, once
            raise click.ClickException(f"not found: no key {key!r} on {target.server}") from None
    data = {
        "key": reply.entry.key,
        "tier": reply.entry.tier,
        "size_bytes": reply.size_bytes,
        "dtype": reply.dtype,
        "shape": list(reply.shape),
        "layout": reply.layout,
        "num_tokens": reply.num_tokens,
        "codec": reply.codec,
    }
    table = Table("field", "value", title=key)
    for name, value in data.items():
        table.add_row(name, _human_bytes(value) if name == "size_bytes" else str(value))
    _emit(as_json, data, table)


@admin.command()
@click.argument("key", required=False)
@click.option("--prefix", help="Evict every key starting with this instead of one KEY.")
@json_option
@click.pass_obj
def evict(target: AdminTarget, key: str | None, prefix: str | None, as_json: bool) -> None:
    """Remove KEY, or every key under --prefix, from every tier."""
    from protos import kvstash_pb2, kvstash_pb2_grpc

    if (key is None) == (prefix is None):
        raise click.UsageError("give exactly one of KEY or --prefix")
    if prefix == "":
        raise click.UsageError("an empty --prefix would evict everything; use `clear` for that")
    with target.channel() as channel:
        reply = kvstash_pb2_grpc.AdminStub(channel).Evict(
            kvstash_pb2.EvictRequest(key=key or "", prefix=prefix or ""),
            timeout=target.timeout_s,
            metadata=target.metadata,
        )
    _emit(as_json, {"num_evicted": reply.num_evicted}, f"evicted {_count(reply.num_evicted, 'key')}")


@admin.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_obj
def clear(target: AdminTarget, yes: bool, as_json: bool) -> None:
    """Remove every key from every tier (asks first, unless --yes); --json prints
    ``{"num_cleared": N}``."""
    from protos import kvstash_pb2, kvstash_pb2_grpc

    if not yes:
        click.confirm(f"Remove every key from {target.server}?", abort=True)
    with target.channel() as channel:
        reply = kvstash_pb2_grpc.AdminStub(channel).Clear(
            kvstash_pb2.ClearRequest(), timeout=target.timeout_s, metadata=target.metadata
        )
    _emit(as_json, {"num_cleared": reply.num_evicted}, f"cleared {_count(reply.num_evicted, 'key')}")
