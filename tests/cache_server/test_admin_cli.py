"""``kvstash admin`` against the real server: tables, JSON, exit codes, one-line errors.

The table forms and the failures run as real subprocesses (``python -m engine.cli``);
the JSON forms run in-process through click's runner, to keep the suite fast.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from engine.cli import main
from storage_backends.grpc_backend import GrpcBackend
from tests.cache_server.helpers import run_kvstash
from tests.cache_server.server_process import free_port_for_tests


def admin_json(address: str, *args: str):
    result = CliRunner().invoke(main, ["admin", "--server", address, *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_every_admin_command(cache_server, cache_server_url) -> None:
    backend = GrpcBackend.from_url(cache_server_url)
    try:
        for i in range(3):
            backend.put_encoded(f"model-a/{i}", make_value(i, key=f"model-a/{i}"))
        backend.put_encoded("model-b/0", make_value(7, num_bytes=3 << 20, key="model-b/0"))
    finally:
        backend.close()
    address = cache_server.address

    # The real console command, as a subprocess, with its tables.
    tables = run_kvstash("admin", "--server", address, "stats")
    assert tables.returncode == 0, tables.stderr
    assert "num_puts" in tables.stdout and "memory" in tables.stdout and "evictions" in tables.stdout
    health = CliRunner().invoke(main, ["admin", "--server", address, "health"])
    assert health.exit_code == 0 and f"{address}: SERVING" in health.stdout

    assert admin_json(address, "health")["status"] == "SERVING"
    stats = admin_json(address, "stats")
    assert stats["tiers"][0]["name"] == "memory" and stats["tiers"][0]["num_keys"] == 4
    assert stats["server"]["num_puts"] >= 4
    # The client runs on the server's host, so its single Puts' values went through shared
    # memory (staged Puts, next to the Unix socket's connection).
    shm = next(path for path in stats["transports"] if path["name"] == "shm")
    assert shm["num_puts"] >= 4 and shm["bytes_received"] >= 3 << 20
    assert "transports" in tables.stdout and "shm" in tables.stdout

    runner = CliRunner()
    listing = runner.invoke(main, ["admin", "--server", address, "ls", "--prefix", "model-a/"])
    assert listing.exit_code == 0 and "3 keys" in listing.stdout and "model-a/2" in listing.stdout
    assert "model-b/0" not in listing.stdout
    listing_json = admin_json(address, "ls", "--limit", "2")
    assert [entry["key"] for entry in listing_json["keys"]] == ["model-a/0", "model-a/1"]
    assert listing_json["truncated"] is True

    info = runner.invoke(main, ["admin", "--server", address, "info", "model-b/0"])
    assert info.exit_code == 0 and "3.0 MiB" in info.stdout and "LKTHD" in info.stdout
    info_json = admin_json(address, "info", "model-b/0")
    assert (
        info_json["size_bytes"] == len(make_value(7, num_bytes=3 << 20, key="model-b/0"))
        and info_json["tier"] == "memory"
    )

    evicted = runner.invoke(main, ["admin", "--server", address, "evict", "model-a/0"])
    assert evicted.exit_code == 0 and evicted.stdout.strip() == "evicted 1 key"
    evicted = runner.invoke(main, ["admin", "--server", address, "evict", "--prefix", "model-a/1"])
    assert evicted.exit_code == 0 and evicted.stdout.strip() == "evicted 1 key"
    assert admin_json(address, "evict", "--prefix", "model-a/") == {"num_evicted": 1}
    declined = runner.invoke(main, ["admin", "--server", address, "clear"], input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert admin_json(address, "ls")["keys"][0]["key"] == "model-b/0"
    assert admin_json(address, "clear", "--yes") == {"num_cleared": 1}
    assert admin_json(address, "ls")["keys"] == []


def test_failures_exit_non_zero_with_one_line_reasons(cache_server, cache_server_url) -> None:
    address = f"127.0.0.1:{free_port_for_tests()}"
    unreachable = run_kvstash("admin", "--server", address, "--timeout", "3", "stats")
    assert unreachable.returncode == 1
    assert unreachable.stderr.strip() == f"Error: cannot reach {address}"

    runner = CliRunner()
    missing = runner.invoke(main, ["admin", "--server", cache_server.address, "info", "no-such-key"])
    assert missing.exit_code == 1
    assert missing.stderr.strip() == f"Error: not found: no key 'no-such-key' on {cache_server.address}"
    assert len(missing.stderr.strip().splitlines()) == 1 and "Traceback" not in missing.output
    down = runner.invoke(main, ["admin", "--server", address, "--timeout", "3", "health"])
    assert down.exit_code == 1 and f"cannot reach {address}" in down.output
    usage = runner.invoke(main, ["admin", "--server", cache_server.address, "evict"])
    assert usage.exit_code == 2 and "exactly one of KEY or --prefix" in usage.output


def test_an_idle_server_shows_no_empty_transports_table() -> None:
    """A fresh server moved no value yet: `stats` says so instead of an empty table (the JSON
    keeps its empty list); `clear` of nothing says 0 keys."""
    process = CacheServerProcess("--memory-gb", "0.0625").start()
    try:
        assert admin_json(process.address, "stats")["transports"] == []
        tables = run_kvstash("admin", "--server", process.address, "stats")
        assert tables.returncode == 0, tables.stderr
        assert "transports: no transfers yet" in tables.stdout
        assert "transport " not in tables.stdout  # no table's header row
        cleared = run_kvstash("admin", "--server", process.address, "clear", "--yes")
        assert cleared.returncode == 0 and cleared.stdout.strip() == "cleared 0 keys"
    finally:
        process.close()
