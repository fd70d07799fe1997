"""The cache server under many small entries: memory per entry, Contains and ListKeys scaling.

Starts a real ``kvstash cache-server`` (memory tier, plus a disk tier for the
Contains part) and measures three things the server's accounting and limits
depend on:

- **entry overhead**: RSS growth of the server process per stored entry, for
  tiny values under 1 KiB keys, less the value and key bytes. This is where
  ``cache_server.memory_tier.ENTRY_OVERHEAD_BYTES`` comes from; the table also
  shows what the memory tier reports (``bytes_used``) for the same entries.
- **Contains**: keys alternating between the memory and the disk tier, one call
  over all of them, at growing key counts (time per key should stay flat).
- **ListKeys**: the time of one page of 100 keys at growing key counts (it
  should not grow with the number of keys).

Prints a table per part and writes JSON with ``--out``.

    .venv/bin/python benchmarks/cache_server_limits.py --out bench-out/cache_server_limits.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import psutil  # noqa: E402

from benchmarks.support.cache_server_process import CacheServerProcess  # noqa: E402
from benchmarks.support.cache_server_values import alternating_tiers_server, make_value, put_all  # noqa: E402
from protos import kvstash_pb2, kvstash_pb2_grpc  # noqa: E402
from storage_backends.grpc_backend import make_channel  # noqa: E402

KEY_BYTES = 1024


def long_key(index: int) -> str:
    return f"{index:08d}/".ljust(KEY_BYTES, "k")


def memory_tier_stats(address: str) -> kvstash_pb2.TierStats:
    with make_channel(address, secure=False) as channel:
        stats = kvstash_pb2_grpc.AdminStub(channel).Stats(kvstash_pb2.StatsRequest(), timeout=30)
    return next(tier for tier in stats.tiers if tier.name == "memory")


def measure_entry_overhead(num_entries: int) -> dict:
    server = CacheServerProcess("--memory-gb", "4").start()
    try:
        keys = [long_key(i) for i in range(num_entries)]
        value = make_value(0, num_bytes=64, key=keys[0])
        # Warm the server's paths (threads, buffers) first so their one-time memory is not counted.
        put_all(server.url, [f"warm/{i}" for i in range(2000)], 0)
        process = psutil.Process(server.process.pid)
        rss_before = process.memory_info().rss
        used_before = memory_tier_stats(server.address).bytes_used
        put_all(server.url, keys, 0)
        rss_after = process.memory_info().rss
        used_after = memory_tier_stats(server.address).bytes_used
    finally:
        server.close()
    rss_per_entry = (rss_after - rss_before) / num_entries
    return {
        "num_entries": num_entries,
        "value_bytes": len(value),
        "key_bytes": KEY_BYTES,
        "rss_growth_bytes": rss_after - rss_before,
        "rss_per_entry_bytes": rss_per_entry,
        "overhead_per_entry_bytes": rss_per_entry - len(value) - KEY_BYTES,
        "reported_per_entry_bytes": (used_after - used_before) / num_entries,
    }


def measure_contains_and_listing(key_counts: list[int]) -> tuple[list[dict], list[dict]]:
    contains_rows, listing_rows = [], []
    for num_keys in key_counts:
        keys = [f"k/{i:08d}" for i in range(num_keys)]
        with tempfile.TemporaryDirectory(prefix="kvstash-bench-disk-") as disk_path:
            server = alternating_tiers_server(disk_path, keys, 1)
            try:
                with make_channel(server.address, secure=False) as channel:
                    contains_rows.append(_time_contains(kvstash_pb2_grpc.KVCacheStub(channel), keys))
                    listing_rows.append(_time_listing(kvstash_pb2_grpc.AdminStub(channel), num_keys))
            finally:
                server.close()
    return contains_rows, listing_rows


def _time_contains(kv, keys: list[str]) -> dict:
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        reply = kv.Contains(kvstash_pb2.ContainsRequest(keys=keys), timeout=300)
        seconds.append(time.perf_counter() - start)
    return {"num_keys": len(keys), "num_hits": reply.num_hits, "seconds": min(seconds)}


def _time_listing(admin, num_keys: int) -> dict:
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        admin.ListKeys(kvstash_pb2.ListKeysRequest(prefix="k/", page_size=100), timeout=60)
        seconds.append(time.perf_counter() - start)
    return {"num_keys": num_keys, "page_size": 100, "seconds": min(seconds)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-entries", type=int, default=20000)
    parser.add_argument("--key-counts", type=int, nargs="+", default=[2000, 8000, 32000])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    overhead = measure_entry_overhead(args.num_entries)
    print("entry overhead (tiny values under 1 KiB keys)")
    for name, value in overhead.items():
        print(f"  {name:28s} {value:>14,.0f}")
    contains_rows, listing_rows = measure_contains_and_listing(args.key_counts)
    print(f"\n{'keys':>8} {'Contains ms':>12} {'us/key':>8} {'ListKeys page ms':>17}")
    for contains, listing in zip(contains_rows, listing_rows, strict=True):
        print(
            f"{contains['num_keys']:>8} {contains['seconds'] * 1e3:>12.1f} "
            f"{contains['seconds'] * 1e6 / contains['num_keys']:>8.1f} {listing['seconds'] * 1e3:>17.2f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "machine": platform.node(),
            "entry_overhead": overhead,
            "contains": contains_rows,
            "list_keys": listing_rows,
        }
        args.out.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
