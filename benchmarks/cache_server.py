"""Cache server vs redis-server: Put/Get throughput and latency for KV-chunk-sized values.

Starts both servers itself on free loopback ports (``kvstash cache-server``
memory-only, and ``redis-server`` without persistence), then for every value
size and client count runs puts of distinct keys followed by gets of the same
keys. Each client is a thread with its own connection (a gRPC channel, a
redis-py connection), so 8 clients means 8 calls in flight.

Both sides move the same serialized chunk bytes. The kvstash side is the
engine's own ``grpc://`` tier, so it verifies the checksum of every Get on the
client (redis-py does not) and the server verifies every Put: the production path.
It runs once per transport (``--transports``), all against the same server:
``unix`` (the bulk channel's Unix socket, chosen automatically on the same host; a
single Put's value goes through the connection's shared-memory staging area),
``tcp`` (the bulk TCP port, ``?local=off``) and ``grpc`` (``?bulk=off``).

``--load-mib`` adds the end-to-end figure: that many MiB of KV in chunks of the
8B model's shape (32 layers, 8 KV heads, 128 dims, bf16, 256 tokens = 32 MiB)
are stored, then loaded with ``GrpcBackend.get_into`` into pinned buffers
(plain ones without CUDA) by ``--load-connections`` threads over as many bulk
connections, per transport; with ``--to-device`` each chunk is also copied to
the GPU (non-blocking, its own stream per thread) before the clock stops.

The machine is shared, so each cell runs ``--rounds`` times, alternating the two
systems, and the table shows medians: MB/s of each system and the median of the
per-round ratios (kvstash ÷ redis; a burst of load elsewhere hits both halves of
a round). It also shows each server process's CPU time per MB moved, and the
client process's (its threads: redis-py or the grpc:// tier), which load
elsewhere changes far less than throughput: on a machine with free cores,
server + client CPU per MB is what bounds a single client's rate.

``--server-disk-mib`` gives the server a disk tier (in a temporary folder) and
``--server-memory-mib`` sizes its memory tier: with a memory tier smaller than the
load, every timed load Get misses memory and is served from the disk tier (read,
verified once, kept in memory, sent); the load table shows the hits by tier and the
server's CPU per MB, the figure that load elsewhere on the machine changes least.

``put_many`` is the engine's write path (the connector's write-through hands
the tier batches): ``--put-batch`` values per call, pipelined over the bulk
pool (``--bulk-connections``) on the kvstash side, one redis-py pipeline of SETs
on the Redis side. Prints a table and writes JSON
with ``--out`` (every round's rows and the medians).

    .venv/bin/python benchmarks/cache_server.py --out bench-out/cache_server.json
    .venv/bin/python benchmarks/cache_server.py --sizes-kib 32768 --clients 1 --load-mib 2048 \
        --load-connections 8 --to-device --out bench-out/cache_server_load.json   # the GPU machine
    .venv/bin/python benchmarks/cache_server.py --load-only --load-mib 2048 --load-connections 8 --to-device
    .venv/bin/python benchmarks/cache_server.py --load-only --load-mib 512 --server-memory-mib 160 \
        --server-disk-mib 1024 --transports unix --load-rounds 5   # Gets from the server's disk tier
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.support.cache_bench_clients import TRANSPORTS, GrpcClient, RedisClient  # noqa: E402
from benchmarks.support.cache_bench_load import measure_load, print_load_table  # noqa: E402
from benchmarks.support.cache_bench_servers import (  # noqa: E402
    clear_cache_server,
    clear_redis,
    server_cpu_s,
    start_cache_server,
    start_redis,
)
from storage_backends.chunk import KVChunk, encode_chunk  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = (2 * MIB, 8 * MIB, 32 * MIB)
DEFAULT_CLIENTS = (1, 8)


def make_value(num_bytes: int, seed: int) -> KVChunk:
    """A chunk of about ``num_bytes``; serialized per key by :func:`measure` (a value is bound to its key)."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = max(1, num_bytes // 2)  # layout [layers=1, K/V=2, tokens, heads=1, dim=1] of uint8
    tensor = torch.randint(0, 256, (1, 2, num_tokens, 1, 1), dtype=torch.uint8, generator=generator)
    return KVChunk(tensor)


def run_phase(
    clients: list, call: Callable, keys_per_client: list[list[str]], key_to_value: dict[str, bytes] | None
) -> list[float]:
    """Every client runs its keys in order (puts ``key_to_value[key]`` when given, else gets);
    returns all per-call latencies (seconds)."""
    latencies: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(clients))

    def worker(client, keys: list[str]) -> None:
        own = []
        try:
            barrier.wait()
            for key in keys:
                start = time.perf_counter()
                result = call(client, key) if key_to_value is None else call(client, key, key_to_value[key])
                own.append(time.perf_counter() - start)
                if key_to_value is None and result is None:
                    raise RuntimeError(f"get of {key} returned nothing")
        except BaseException as exc:  # noqa: BLE001 - reported after the join
            errors.append(exc)
        with lock:
            latencies.extend(own)

    threads = [
        threading.Thread(target=worker, args=(c, k)) for c, k in zip(clients, keys_per_client, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return latencies


def run_batches(
    clients: list, keys_per_client: list[list[str]], key_to_value: dict[str, bytes], batch: int
) -> list[float]:
    """Every client runs ``put_many`` over its keys, ``batch`` keys per call; returns the
    per-value latency of each call (its seconds ÷ its number of values), one per value."""
    batches = [[keys[i : i + batch] for i in range(0, len(keys), batch)] for keys in keys_per_client]

    def call(client, keys: list[str]) -> None:
        client.put_many([(key, key_to_value[key]) for key in keys])

    latencies: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(clients))

    def worker(client, client_batches: list[list[str]]) -> None:
        own = []
        try:
            barrier.wait()
            for keys in client_batches:
                start = time.perf_counter()
                call(client, keys)
                own.extend([(time.perf_counter() - start) / len(keys)] * len(keys))
        except BaseException as exc:  # noqa: BLE001 - reported after the join
            errors.append(exc)
        with lock:
            latencies.extend(own)

    threads = [threading.Thread(target=worker, args=(c, b)) for c, b in zip(clients, batches, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return latencies


def socket_bound_mb_per_s(num_bytes: int, num_clients: int, duration_s: float = 0.5) -> float:
    """MB/s that ``num_clients`` Unix socket pairs carry on this machine right now: one thread
    sends ``num_bytes`` buffers with ``sendall``, another receives them with ``recv_into`` (no
    checksum, no protocol, no allocation). Two copies per byte, as for any socket transfer: the
    bound of the socket paths, measured in the same run."""
    payload = bytes(num_bytes)
    moved = [0] * num_clients
    stop = time.perf_counter() + duration_s

    def pair(index: int) -> None:
        sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        view = memoryview(bytearray(num_bytes))

        def send() -> None:
            while time.perf_counter() < stop:
                sender.sendall(payload)
            sender.close()

        thread = threading.Thread(target=send)
        thread.start()
        while received := receiver.recv_into(view):
            moved[index] += received
        thread.join()
        receiver.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=pair, args=(i,)) for i in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(moved) / (time.perf_counter() - start) / 1e6


def client_cpu_s() -> float:
    """User plus system CPU seconds of this process (the clients' threads) so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(
    system: str,
    make_client: Callable,
    server_process,
    chunk: KVChunk,
    num_clients: int,
    ops_per_client: int,
    round_index: int,
    put_batch: int,
) -> list[dict]:
    """Puts, then Gets (``get_encoded``: a new buffer per value), then ``get_into`` (into a buffer
    kept per client; redis: GET again) of distinct keys by ``num_clients`` threads, then
    ``put_many`` of as many other keys, ``put_batch`` per call (redis: a pipeline of SETs);
    one row per op."""
    clients = [make_client() for _ in range(num_clients)]
    keys = [
        [f"bench/{system}/{chunk.nbytes}/{c}/{i}" for i in range(ops_per_client)] for c in range(num_clients)
    ]
    batch_keys = [[f"{key}/batch" for key in client_keys] for client_keys in keys]
    # Serialized before the clock starts: each value carries the hash of its own key.
    key_to_value = {
        key: encode_chunk(chunk, key=key) for client_keys in keys + batch_keys for key in client_keys
    }
    value = next(iter(key_to_value.values()))
    rows = []
    for client in clients:
        client.reserve(len(value))
    try:
        for op in ("put", "get", "get_into", "put_many"):
            if op == "put_many":
                cpu_start, client_start = server_cpu_s(server_process), client_cpu_s()
                start = time.perf_counter()
                latencies = run_batches(clients, batch_keys, key_to_value, put_batch)
                elapsed = time.perf_counter() - start
                cpu_s = (server_cpu_s(server_process) - cpu_start, client_cpu_s() - client_start)
                rows.append(
                    _row(system, round_index, op, len(value), num_clients, latencies, elapsed, *cpu_s)
                )
                continue
            if op == "put":
                call = lambda cl, k, v: cl.put(k, v)  # noqa: E731
            elif op == "get":
                call = lambda cl, k: cl.get(k)  # noqa: E731
            else:
                call = lambda cl, k: cl.get_into(k)  # noqa: E731
            cpu_start, client_start = server_cpu_s(server_process), client_cpu_s()
            start = time.perf_counter()
            latencies = run_phase(clients, call, keys, key_to_value if op == "put" else None)
            elapsed = time.perf_counter() - start
            cpu_s = (server_cpu_s(server_process) - cpu_start, client_cpu_s() - client_start)
            rows.append(_row(system, round_index, op, len(value), num_clients, latencies, elapsed, *cpu_s))
    finally:
        for client in clients:
            client.close()
    return rows


def _row(
    system: str,
    round_index: int,
    op: str,
    value_bytes: int,
    num_clients: int,
    latencies: list[float],
    elapsed: float,
    cpu_s: float,
    client_cpu_s: float,
) -> dict:
    num_bytes = value_bytes * len(latencies)
    return {
        "system": system,
        "round": round_index,
        "op": op,
        "value_bytes": value_bytes,
        "num_clients": num_clients,
        "num_ops": len(latencies),
        "mb_per_s": num_bytes / elapsed / 1e6,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3),
        "p99_ms": float(np.percentile(latencies, 99) * 1e3),
        "server_cpu_ms_per_mb": cpu_s * 1e3 / (num_bytes / 1e6),
        "client_cpu_ms_per_mb": client_cpu_s * 1e3 / (num_bytes / 1e6),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="cache server vs redis-server Put/Get benchmark")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[s // KIB for s in DEFAULT_SIZES])
    parser.add_argument("--clients", type=int, nargs="+", default=list(DEFAULT_CLIENTS))
    parser.add_argument(
        "--mib-per-cell", type=int, default=64, help="MiB moved per op per cell (bounds the run)"
    )
    parser.add_argument("--min-ops", type=int, default=3, help="fewest ops per client per cell")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs per cell and system; the table shows medians"
    )
    parser.add_argument(
        "--bulk", choices=("on", "off"), default="on", help="the server's bulk data channel (off: gRPC only)"
    )
    parser.add_argument(
        "--put-batch", type=int, default=8, help="values per put_many call (redis: SETs per pipeline)"
    )
    parser.add_argument(
        "--bulk-connections",
        type=int,
        default=4,
        help="the kvstash client's bulk connections (?bulk_connections; put_many spreads over them)",
    )
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=TRANSPORTS,
        default=list(TRANSPORTS),
        help="kvstash paths to measure",
    )
    parser.add_argument(
        "--load-mib", type=int, default=256, help="MiB of 8B-shaped KV for the end-to-end load (0: skip)"
    )
    parser.add_argument(
        "--load-connections", type=int, default=4, help="bulk connections (and threads) of the load"
    )
    parser.add_argument(
        "--load-rounds", type=int, default=3, help="loads per transport; the table shows the best"
    )
    parser.add_argument("--to-device", action="store_true", help="copy each loaded chunk to the GPU too")
    parser.add_argument(
        "--load-only",
        action="store_true",
        help="only the end-to-end load (no Put/Get cells, no redis-server)",
    )
    parser.add_argument(
        "--server-memory-mib",
        type=int,
        help="the server's memory tier (default: room for every cell and the load); with "
        "--server-disk-mib, a small one makes Gets come from the disk tier",
    )
    parser.add_argument(
        "--server-disk-mib",
        type=int,
        default=0,
        help="give the server a disk tier of this many MiB in a temporary folder (0: memory only)",
    )
    parser.add_argument(
        "--server-disk-dir", type=Path, help="where the disk tier's temporary folder goes (default: $TMPDIR)"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    cells = [] if args.load_only else [(s * KIB, c) for s in args.sizes_kib for c in args.clients]
    ops = {cell: max(args.min_ops, args.mib_per_cell * MIB // (cell[0] * cell[1])) for cell in cells}
    most_bytes = max((size * clients * ops[(size, clients)] for size, clients in cells), default=0)
    # A cell stores its keys twice (single Puts, then put_many's own keys), and the values of
    # the pipelines in flight count too: Redis counts its clients' query buffers in its used
    # memory (refusing SETs past maxmemory), the cache server its uploads in flight.
    most_in_flight = max((size * clients * args.put_batch for size, clients in cells), default=0)
    memory_gb = (2 * most_bytes + most_in_flight) / (1 << 30) + 0.25

    load_bytes = args.load_mib * MIB
    server_memory_gb = memory_gb + 2 * load_bytes / (1 << 30)
    if args.server_memory_mib is not None:
        server_memory_gb = args.server_memory_mib / 1024
    disk_dir = None
    if args.server_disk_mib:
        disk_dir = tempfile.mkdtemp(prefix="kvstash-bench-disk-", dir=args.server_disk_dir)
    server, address = start_cache_server(
        server_memory_gb, args.bulk, disk_dir, args.server_disk_mib / 1024 if disk_dir else None
    )
    redis_process = None
    if cells:
        redis_process, redis_port, redis_dir = start_redis(int(memory_gb * (1 << 30)))
    import psutil

    server_process = psutil.Process(server.pid)
    systems = {
        f"kvstash-{transport}": (
            lambda transport=transport: GrpcClient(address, transport, args.bulk_connections),
            server_process,
            lambda: clear_cache_server(address),
        )
        for transport in args.transports
    }
    if redis_process is not None:
        systems["redis"] = (
            lambda: RedisClient(redis_port),
            psutil.Process(redis_process.pid),
            lambda: clear_redis(redis_port),
        )
    rows: list[dict] = []
    load_rows: list[dict] = []
    try:
        bounds = {}
        for size, num_clients in cells:
            value = make_value(size, seed=size)
            value_len = len(
                encode_chunk(value, key="bound")
            )  # the header's length does not depend on the key
            bounds[(value_len, num_clients)] = socket_bound_mb_per_s(value_len, num_clients)
            # Rounds alternate the systems so that a burst of load elsewhere on the
            # machine hits each; the table reports medians over rounds.
            for round_index in range(args.rounds):
                for system, (make_client, process, clear) in systems.items():
                    rows.extend(
                        measure(
                            system,
                            make_client,
                            process,
                            value,
                            num_clients,
                            ops[(size, num_clients)],
                            round_index,
                            args.put_batch,
                        )
                    )
                    clear()  # keeps memory bounded: each measurement starts empty
        if load_bytes:
            load_rows = measure_load(address, args, server_process)
    finally:
        server.terminate()
        server.wait(30)
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
        if redis_process is not None:
            redis_process.terminate()
            redis_process.wait(30)
            shutil.rmtree(redis_dir, ignore_errors=True)
    cells_summary = summarize(rows, [f"kvstash-{transport}" for transport in args.transports])
    for cell in cells_summary:
        cell["unix_socket_bound_mb_per_s"] = bounds[(cell["value_bytes"], cell["num_clients"])]

    if cells_summary:
        print_table(cells_summary, args.transports)
    if load_rows:
        print_load_table(load_rows)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "cache_server",
            "machine": {
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "load_average_1m": os.getloadavg()[0],
            },
            "settings": {
                "rounds": args.rounds,
                "mib_per_cell": args.mib_per_cell,
                "put_batch": args.put_batch,
                "bulk_connections": args.bulk_connections,
                "bulk": args.bulk,
                "transports": args.transports,
                "load_mib": args.load_mib,
                "load_connections": args.load_connections,
                "to_device": args.to_device,
                "load_only": args.load_only,
                "server_memory_mib": server_memory_gb * 1024,
                "server_disk_mib": args.server_disk_mib,
            },
            "cells": cells_summary,
            "load": load_rows,
            "rows": rows,
        }
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")
    return 0


def summarize(rows: list[dict], kvstash_systems: list[str]) -> list[dict]:
    """One entry per (size, clients, op): medians over rounds of each system's MB/s, p50/p99 and
    server CPU per MB, and per kvstash transport the median of the per-round ratios ÷ redis."""
    by_cell: dict[tuple, dict[int, dict[str, dict]]] = {}
    for row in rows:
        cell = (row["value_bytes"], row["num_clients"], row["op"])
        by_cell.setdefault(cell, {}).setdefault(row["round"], {})[row["system"]] = row
    summary = []
    for (size, num_clients, op), rounds in by_cell.items():
        entry = {"value_bytes": size, "num_clients": num_clients, "op": op, "num_rounds": len(rounds)}
        for system in (*kvstash_systems, "redis"):
            for metric in ("mb_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_mb", "client_cpu_ms_per_mb"):
                entry[f"{system}_{metric}"] = float(np.median([r[system][metric] for r in rounds.values()]))
        for system in kvstash_systems:
            ratios = [r[system]["mb_per_s"] / r["redis"]["mb_per_s"] for r in rounds.values()]
            entry[f"{system}_ratio"] = float(np.median(ratios))
            entry[f"{system}_ratio_min"], entry[f"{system}_ratio_max"] = min(ratios), max(ratios)
        summary.append(entry)
    return summary


def print_table(cells: list[dict], transports: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = ["value", "clients", "op", "socket bound MB/s", "redis MB/s"]
    for transport in transports:
        columns += [f"{transport} MB/s", f"{transport} ÷ redis (min-max)"]
    columns.append("CPU ms/MB server+client " + " / ".join((*transports, "redis")))
    table = Table(*columns)
    for cell in cells:
        cpu = [
            f"{cell[f'{system}_server_cpu_ms_per_mb']:.2f}+{cell[f'{system}_client_cpu_ms_per_mb']:.2f}"
            for system in (*(f"kvstash-{t}" for t in transports), "redis")
        ]
        row = [f"{cell['value_bytes'] / MIB:.0f} MiB", str(cell["num_clients"]), cell["op"]]
        row += [f"{cell['unix_socket_bound_mb_per_s']:.0f}", f"{cell['redis_mb_per_s']:.0f}"]
        for transport in transports:
            system = f"kvstash-{transport}"
            row += [
                f"{cell[f'{system}_mb_per_s']:.0f}",
                f"{cell[f'{system}_ratio']:.2f} ({cell[f'{system}_ratio_min']:.2f}-{cell[f'{system}_ratio_max']:.2f})",
            ]
        row.append(" / ".join(cpu))
        table.add_row(*row)
    Console(width=200).print(table)


if __name__ == "__main__":
    sys.exit(main())
