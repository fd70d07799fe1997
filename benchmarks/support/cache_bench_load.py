"""The end-to-end load of ``benchmarks/cache_server.py`` (``--load-mib``): KV chunks of the
8B model's shape stored in the cache server, then loaded per transport with
``GrpcBackend.get_into`` into pinned buffers by several threads (and on to the GPU with
``--to-device``); the best and median GB/s, the server's CPU per MB and the hits by tier.

Called by the benchmark once per run, after the Put/Get cells. Stores its own keys
(``load/N``) in the server; changes nothing else.
"""

from __future__ import annotations

import argparse
import functools
import threading
import time

import numpy as np
import torch

from benchmarks.support.cache_bench_clients import TRANSPORT_QUERY
from benchmarks.support.cache_bench_servers import server_cpu_s, tier_hits

MIB = 1 << 20
#: one 256-token chunk of an 8B model (Llama-3-8B: 32 layers, 8 KV heads, head dim 128), bf16
LOAD_CHUNK_SHAPE = (32, 2, 256, 8, 128)


def measure_load(address: str, args: argparse.Namespace, server_process) -> list[dict]:
    """Store ``--load-mib`` of 8B-shaped chunks, then per transport load them all with ``get_into``
    into pinned buffers (``--load-connections`` threads and bulk connections); best of rounds."""
    from concurrent.futures import ThreadPoolExecutor

    from storage_backends import create_backend
    from storage_backends.chunk import KVChunk

    chunk_bytes = int(np.prod(LOAD_CHUNK_SHAPE)) * 2
    num_chunks = max(1, args.load_mib * MIB // chunk_bytes)
    cuda = torch.cuda.is_available()
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(-(2**15), 2**15, LOAD_CHUNK_SHAPE, dtype=torch.int16, generator=generator)
    keys = [f"load/{i}" for i in range(num_chunks)]
    writer = create_backend(f"grpc://{address}?timeout=120&concurrency=4")
    try:
        # Distinct contents per chunk would cost the benchmark's own time; the server checks each anyway.
        writer.put_many([(key, KVChunk(source.view(torch.bfloat16))) for key in keys])
    finally:
        writer.close()
    buffers = [torch.empty(LOAD_CHUNK_SHAPE, dtype=torch.bfloat16, pin_memory=cuda) for _ in keys]
    device_buffers = (
        [torch.empty(LOAD_CHUNK_SHAPE, dtype=torch.bfloat16, device="cuda") for _ in keys]
        if args.to_device
        else []
    )
    rows = []
    for transport in args.transports:
        query = f"&bulk_connections={args.load_connections}&concurrency={args.load_connections}"
        backend = create_backend(f"grpc://{address}?timeout=120{query}{TRANSPORT_QUERY[transport]}")
        streams: dict[int, object] = {}
        load = functools.partial(load_one, backend, keys, buffers, device_buffers, streams)
        try:
            backend.get_into(keys[0], buffers[0])  # discovery and the first connection, outside the clock
            seconds, cpu_seconds = [], []
            hits_before = tier_hits(address)
            for _ in range(args.load_rounds):
                cpu_start, start = server_cpu_s(server_process), time.perf_counter()
                with ThreadPoolExecutor(args.load_connections) as pool:
                    list(pool.map(load, range(num_chunks)))
                seconds.append(time.perf_counter() - start)
                cpu_seconds.append(server_cpu_s(server_process) - cpu_start)
            hits_after = tier_hits(address)
            used = backend.transport
        finally:
            backend.close()
        if used != transport:
            raise RuntimeError(f"asked for transport {transport}, the tier used {used}")
        total = num_chunks * chunk_bytes
        rows.append(
            {
                "transport": transport,
                "num_chunks": num_chunks,
                "chunk_bytes": chunk_bytes,
                "total_bytes": total,
                "connections": args.load_connections,
                "pinned": cuda,
                "to_device": bool(device_buffers),
                "best_gb_per_s": total / min(seconds) / 1e9,
                "median_gb_per_s": total / float(np.median(seconds)) / 1e9,
                "seconds": seconds,
                "server_cpu_ms_per_mb_last_round": cpu_seconds[-1] * 1e3 / (total / 1e6),
                "server_cpu_ms_per_mb_median": float(np.median(cpu_seconds)) * 1e3 / (total / 1e6),
                # which tier served the timed loads (a small --server-memory-mib: the disk tier)
                "tier_hits": {name: hits_after[name] - hits_before.get(name, 0) for name in hits_after},
            }
        )
    return rows


def load_one(
    backend, keys: list[str], buffers: list, device_buffers: list, streams: dict, index: int
) -> None:
    """One chunk into its pinned buffer (and on to the GPU, on this thread's own stream)."""
    chunk = backend.get_into(keys[index], buffers[index])
    if chunk is None:
        raise RuntimeError(f"load of {keys[index]} missed")
    if device_buffers:
        stream = streams.get(threading.get_ident())
        if stream is None:
            stream = streams[threading.get_ident()] = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            device_buffers[index].copy_(buffers[index], non_blocking=True)
        stream.synchronize()


def print_load_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "transport",
        "KV loaded",
        "chunks",
        "connections",
        "pinned",
        "to GPU",
        "GB/s best",
        "GB/s median",
        "server CPU ms/MB",
        "hits by tier",
    )
    for row in rows:
        table.add_row(
            row["transport"],
            f"{row['total_bytes'] / MIB:.0f} MiB",
            str(row["num_chunks"]),
            str(row["connections"]),
            str(row["pinned"]),
            str(row["to_device"]),
            f"{row['best_gb_per_s']:.2f}",
            f"{row['median_gb_per_s']:.2f}",
            f"{row['server_cpu_ms_per_mb_median']:.3f}",
            " ".join(f"{name}={hits}" for name, hits in row["tier_hits"].items()),
        )
    Console(width=170).print(table)
