"""Issue #17's attacks on the cache server, replayed against a real server: what each now costs.

- **slow hellos**: 24 bulk connections (the server allows 24) each send a hello announcing a
  200-byte token and
  then one byte every 3 s. Reported: seconds until the server has cut them all, and whether
  an honest client then moves its values over the bulk channel.
- **stalled uploads**: 6 bulk Puts announcing 200 MiB on a server capped at 0.25 GiB; each
  one the server accepts sends 150 MiB and stalls. Reported: how many were accepted, server
  RSS before and after.
- **tiny values**: 59,000 values of 141 bytes under 1 KiB keys. Reported: RSS growth of the
  server and the memory tier's ``bytes_used``.
- **ListKeys**: 30,000 keys; the time of a page of 1, and the slowest health check answered
  while a client pages through every key.

Prints a table and writes JSON with ``--out``.

    .venv/bin/python benchmarks/cache_server_attacks.py --out bench-out/cache_server_attacks.json
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import psutil  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from benchmarks.support.cache_server_process import CacheServerProcess  # noqa: E402
from benchmarks.support.cache_server_values import make_value, put_all  # noqa: E402
from protos import bulk_wire as wire  # noqa: E402
from protos import kvstash_pb2, kvstash_pb2_grpc  # noqa: E402
from storage_backends import create_backend  # noqa: E402
from storage_backends.grpc_backend import make_channel  # noqa: E402

MIB = 1 << 20


def bulk_port(address: str) -> int:
    with make_channel(address, secure=False) as channel:
        stub = kvstash_pb2_grpc.KVCacheStub(channel)
        return stub.GetBulkEndpoint(kvstash_pb2.BulkEndpointRequest(), timeout=10).port


def memory_tier(address: str) -> kvstash_pb2.TierStats:
    with make_channel(address, secure=False) as channel:
        stats = kvstash_pb2_grpc.AdminStub(channel).Stats(kvstash_pb2.StatsRequest(), timeout=30)
    return next(tier for tier in stats.tiers if tier.name == "memory")


def slow_hellos(num_connections: int = 24, interval_s: float = 3.0) -> dict:
    server = CacheServerProcess("--memory-gb", "0.25", "--max-bulk-connections", str(num_connections)).start()
    try:
        port = bulk_port(server.address)
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(num_connections)]
        start = time.monotonic()
        for sock in sockets:
            sock.sendall(wire.HELLO.pack(wire.MAGIC, 200))  # then token bytes, one every interval_s
        open_sockets = list(sockets)
        while open_sockets and time.monotonic() - start < 120:
            time.sleep(interval_s)
            still_open = []
            for sock in open_sockets:
                try:
                    sock.sendall(b"\0")
                    sock.setblocking(False)
                    closed = sock.recv(1) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                finally:
                    sock.setblocking(True)
                if not closed:
                    still_open.append(sock)
            open_sockets = still_open
        seconds_to_cut_all = time.monotonic() - start
        backend = create_backend(server.url)
        try:
            backend.put_encoded("ns/honest", make_value(1, key="ns/honest"))
            honest_ok = bytes(backend.get_encoded("ns/honest")) == make_value(1, key="ns/honest")
            honest_over_bulk = backend.stats()["bulk_failures"] == 0
        finally:
            backend.close()
        for sock in sockets:
            sock.close()
    finally:
        server.close()
    return {
        "num_connections": num_connections,
        "byte_every_s": interval_s,
        "num_still_open": len(open_sockets),
        "seconds_to_cut_all": seconds_to_cut_all,
        "honest_client_ok": honest_ok,
        "honest_client_over_bulk": honest_over_bulk,
    }


def stalled_uploads(num_uploads: int = 6, announced: int = 200 * MIB, sent: int = 150 * MIB) -> dict:
    server = CacheServerProcess("--memory-gb", "0.25", "--max-value-mb", "256").start()
    held = []
    try:
        process = psutil.Process(server.process.pid)
        rss_before = process.memory_info().rss
        port = bulk_port(server.address)
        # A valid chunk's first bytes, so the server keeps what arrives (zeros fail the header check).
        value = make_value(4, announced, key="ns/stall")
        statuses = []
        for _ in range(num_uploads):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            held.append(sock)
            sock.sendall(wire.HELLO.pack(wire.MAGIC, 0))
            wire.read_reply(sock)
            key = b"ns/stall"
            sock.sendall(wire.REQUEST.pack(wire.OP_PUT, len(key), len(value)) + key)
            reply = wire.read_reply(sock)
            statuses.append(reply.status)
            if reply.status == wire.STATUS_OK:
                sock.sendall(memoryview(value)[:sent])
        time.sleep(2)
        rss_after = process.memory_info().rss
    finally:
        for sock in held:
            sock.close()
        server.close()
    return {
        "num_uploads": num_uploads,
        "announced_mib": announced / MIB,
        "num_accepted": statuses.count(wire.STATUS_OK),
        "num_refused_resource_exhausted": statuses.count(8),
        "rss_before_mib": rss_before / MIB,
        "rss_after_mib": rss_after / MIB,
    }


def tiny_values(num_values: int = 59000) -> dict:
    server = CacheServerProcess("--memory-gb", "4").start()
    try:
        value = make_value(2, num_bytes=64, key="warm/0")
        put_all(server.url, [f"warm/{i}" for i in range(2000)], 2)
        process = psutil.Process(server.process.pid)
        rss_before = process.memory_info().rss
        used_before = memory_tier(server.address).bytes_used
        put_all(server.url, [f"{i:08d}/".ljust(1024, "k") for i in range(num_values)], 2)
        rss_after = process.memory_info().rss
        used_after = memory_tier(server.address).bytes_used
    finally:
        server.close()
    return {
        "num_values": num_values,
        "value_bytes": len(value),
        "rss_growth_mib": (rss_after - rss_before) / MIB,
        "reported_growth_mib": (used_after - used_before) / MIB,
    }


def list_keys(num_keys: int = 30000) -> dict:
    server = CacheServerProcess("--memory-gb", "1").start()
    try:
        put_all(server.url, [f"k/{i:08d}" for i in range(num_keys)], 3)
        with make_channel(server.address, secure=False) as channel:
            admin = kvstash_pb2_grpc.AdminStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            page_s = []
            for _ in range(20):
                start = time.perf_counter()
                admin.ListKeys(kvstash_pb2.ListKeysRequest(page_size=1), timeout=30)
                page_s.append(time.perf_counter() - start)
            done = threading.Event()

            def page_through() -> None:
                for _ in range(3):
                    token = ""
                    while True:
                        page = admin.ListKeys(
                            kvstash_pb2.ListKeysRequest(page_size=100, page_token=token), timeout=30
                        )
                        token = page.next_page_token
                        if not token:
                            break
                done.set()

            pager = threading.Thread(target=page_through)
            pager.start()
            health_s = []
            while not done.is_set():
                start = time.perf_counter()
                health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                health_s.append(time.perf_counter() - start)
                time.sleep(0.005)
            pager.join()
    finally:
        server.close()
    return {
        "num_keys": num_keys,
        "page_of_1_ms_median": sorted(page_s)[len(page_s) // 2] * 1e3,
        "num_health_checks": len(health_s),
        "health_max_ms_while_paging": max(health_s) * 1e3 if health_s else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {
        "slow_hellos": slow_hellos(),
        "stalled_uploads": stalled_uploads(),
        "tiny_values": tiny_values(),
        "list_keys": list_keys(),
    }
    for attack, figures in results.items():
        print(attack)
        for name, value in figures.items():
            print(
                f"  {name:34s} {value:>12.1f}" if isinstance(value, float) else f"  {name:34s} {value!s:>12}"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
