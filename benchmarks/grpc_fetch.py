"""The cache server's bulk channel alone against the engine's fetch path over it, same bytes.

Issue 31: a 16k gRPC hit on an H100 took 0.43x recompute where the bulk channel moves the
same 2 GiB at 16.6 GB/s (``benchmarks/cache_server.py --load-only``): the engine's path
delivered about half the wire's rate and its planner believed less still. This benchmark
stores ``--chunks`` KV chunks of an 8B model's shape (32 MiB each; 64 are a 16k prompt) in a
real ``kvstash cache-server`` on this host and loads them three ways, ``--rounds`` times each:

- ``raw``: ``GrpcBackend.get_into`` into buffers already faulted in, ``--raw-connections``
  threads over as many bulk connections (what ``cache_server.py --load-only`` measures);
- ``fetch``: the connector's background fetcher (``connector.fetcher.ChunkFetcher``) over the
  tier the connector opens for ``remote_url`` (its URL parameters, its reads in flight),
  into the CPU tier's slab (pinned with CUDA), from the job's start to its end; the CPU tier
  is emptied before each round, and a first round (the slab's first touch) is not counted;
- ``probe``: what the connector's tier prober (``connector.tier_probe``) measures of that tier,
  i.e. the rates the planner starts from.

``--bulk-connections N`` names N bulk connections in the fetch path's tier URL (the
connector's own choice otherwise: ``remote_reads_in_flight``). ``--step-thread-duty D`` runs a thread that holds the GIL for D of every 10 ms while the
paths are measured (an engine's step thread runs Python: scheduling, launches); 0: none.
Prints a table; ``--out`` writes JSON.

Usage: ``python benchmarks/grpc_fetch.py --chunks 64 --step-thread-duty 0 0.5``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.support.cache_bench_load import LOAD_CHUNK_SHAPE  # noqa: E402
from benchmarks.support.cache_bench_servers import start_cache_server  # noqa: E402

MIB = 1 << 20
DTYPE = torch.bfloat16


class StepThread:
    """A thread that holds the GIL ``duty`` of every 10 ms (pure Python) and sleeps the rest."""

    def __init__(self, duty: float) -> None:
        self.duty = duty
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-step-thread", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            end = time.perf_counter() + 0.01 * self.duty
            while time.perf_counter() < end:
                pass
            if self.duty < 1:
                time.sleep(0.01 * (1 - self.duty))

    def __enter__(self) -> StepThread:
        if self.duty > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.duty > 0:
            self._thread.join()


def measure_raw(url: str, keys: list[str], connections: int, rounds: int, duty: float) -> list[float]:
    from storage_backends import create_backend

    backend = create_backend(f"{url}?timeout=120&bulk_connections={connections}&concurrency={connections}")
    buffers = [torch.zeros(LOAD_CHUNK_SHAPE, dtype=DTYPE, pin_memory=torch.cuda.is_available()) for _ in keys]
    try:
        backend.get_into(keys[0], buffers[0])  # discovery and the first connection, outside the clock
        seconds = []
        with StepThread(duty), ThreadPoolExecutor(connections) as pool:
            for _ in range(rounds):
                start = time.perf_counter()
                chunks = list(pool.map(lambda i: backend.get_into(keys[i], buffers[i]), range(len(keys))))
                seconds.append(time.perf_counter() - start)
                if any(chunk is None for chunk in chunks):
                    raise RuntimeError("a raw load missed")
    finally:
        backend.close()
    return seconds


def open_fetcher(url: str, num_chunks: int, chunk_bytes: int):
    """The connector's tiers and fetcher for ``remote_url=url`` as ``connector.factory`` builds
    them for an engine (its URL parameters, reads in flight per tier), CPU tier sized for the chunks."""
    from connector.breaker import CircuitBreaker
    from connector.config import OffloadConfig
    from connector.factory import tier_reads_in_flight
    from connector.fetcher import ChunkFetcher
    from connector.tiers import TierManager

    config = OffloadConfig(cpu_bytes=(num_chunks + 1) * chunk_bytes, remote_url=url)
    tiers = TierManager.from_config(config, LOAD_CHUNK_SHAPE, DTYPE, pin_memory=torch.cuda.is_available())
    fetcher = ChunkFetcher(
        tiers.cpu.view,  # the slab's memory only: the benchmark grants the slots
        {tier.name: tier for tier in tiers.lower},
        {tier.name: CircuitBreaker(tier.name) for tier in tiers.lower},
        tier_to_reads_in_flight=tier_reads_in_flight(tiers, config),
        dtype=DTYPE,
        layout=tiers.cpu.layout,
    )
    return tiers, fetcher


def measure_fetch(url: str, keys: list[str], chunk_bytes: int, rounds: int, duty: float) -> dict:
    from connector.base import FetchSpec
    from connector.fetcher import FetchJob
    from connector.slot_grants import SlotGrants

    tiers, fetcher = open_fetcher(url, len(keys), chunk_bytes)
    tier = tiers.lower[0]
    seconds: list[float] = []
    try:
        with StepThread(duty):
            for round_index in range(rounds + 1):  # the first round touches the slab: not counted
                for key in tiers.cpu.keys(""):
                    tiers.cpu.delete(key)
                # the slots granted as the scheduler side grants a fetch's (a fresh index state
                # each round: the chunks were deleted above)
                grants = SlotGrants(tiers.cpu.index)
                spec = FetchSpec(
                    round_index,
                    "bench",
                    tuple(keys),
                    (LOAD_CHUNK_SHAPE,) * len(keys),
                    (tier.name,) * len(keys),
                    600.0,
                )
                job = FetchJob.from_spec(grants.grant_fetch(spec))
                start = time.perf_counter()
                fetcher.start(job)
                while not fetcher.poll():
                    fetcher.wait_for_progress(0.005)
                elapsed = time.perf_counter() - start
                fetcher.release(job)
                grants.apply_fills(fetcher.take_fills(round_index + 1))
                grants.release_fetch(spec.fetch_id)
                if job.num_ready_chunks != len(keys):
                    raise RuntimeError(f"the fetch brought {job.num_ready_chunks} of {len(keys)} chunks")
                if round_index:
                    seconds.append(elapsed)
        reads_in_flight = fetcher.tier_to_reads_in_flight[tier.name]
        connections = getattr(tier, "max_reads_in_flight", None)
    finally:
        fetcher.close()
        tiers.close()
    return {"seconds": seconds, "reads_in_flight": reads_in_flight, "connections": connections}


class FixedStepTimes:
    """A step-time model that the prober's planner needs and this benchmark does not use."""

    def rate(self, num_prompt_tokens: int) -> float:
        return 30_000.0

    def prefill_seconds(self, begin: int, end: int) -> float:
        return (end - begin) / 30_000.0


def measure_probe(url: str, chunk_bytes: int, connections: int, rounds: int, duty: float) -> list[dict]:
    from connector.config import OffloadConfig, backend_urls
    from connector.planner import LoadPlanner
    from connector.tier_probe import TierProber
    from connector.token_db import KV_LAYOUT
    from storage_backends import create_backend

    planner = LoadPlanner(bytes_per_token=chunk_bytes // LOAD_CHUNK_SHAPE[2], step_times=FixedStepTimes())
    (tier_url,) = backend_urls(OffloadConfig(remote_url=url))  # the tier as the connector opens it
    backend = create_backend(tier_url)
    prober = TierProber(
        planner,
        {backend.name: backend},
        key="bench/probe",
        chunk_shape=LOAD_CHUNK_SHAPE,
        dtype=DTYPE,
        layout=KV_LAYOUT,
        connections=connections,
        interval_s=3600,
    )
    results = []
    try:
        prober.start()  # its opening measurement writes the probe value; the rounds follow it
        deadline = time.monotonic() + 120
        while not prober.tier_to_num_probes.get(backend.name):
            if time.monotonic() > deadline:
                raise RuntimeError("the prober's opening measurement did not end")
            time.sleep(0.05)
        with StepThread(duty):
            for _ in range(rounds):
                if not prober.probe(backend.name):
                    raise RuntimeError("the probe failed")
                measured = planner.rates.snapshot()  # (tier, connections) -> bytes/s
                results.append(
                    {
                        "one_read_gb_per_s": measured[(backend.name, 1)] / 1e9,
                        "gb_per_s": measured[(backend.name, connections)] / 1e9,
                    }
                )
    finally:
        prober.close()
        backend.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--chunks", type=int, default=32, help="8B-shaped chunks of 32 MiB (64: a 16k prompt)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="loads per path; the table shows best and median"
    )
    parser.add_argument("--raw-connections", type=int, default=4, help="threads and bulk connections of raw")
    parser.add_argument("--step-thread-duty", type=float, nargs="+", default=[0.0, 0.5])
    parser.add_argument(
        "--bulk-connections",
        type=int,
        help="the fetch path's tier URL names this many bulk connections (default: the connector's choice)",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if min(args.chunks, args.rounds, args.raw_connections, args.bulk_connections or 1) <= 0:
        parser.error("--chunks, --rounds, --raw-connections and --bulk-connections must be positive")
    if any(not 0 <= duty <= 1 for duty in args.step_thread_duty):
        parser.error("--step-thread-duty values must be between 0 and 1")

    from connector.config import OffloadConfig
    from connector.token_db import KV_LAYOUT
    from storage_backends import create_backend
    from storage_backends.chunk import KVChunk

    chunk_bytes = torch.Size(LOAD_CHUNK_SHAPE).numel() * DTYPE.itemsize
    total = args.chunks * chunk_bytes
    server, address = start_cache_server((total + 2 * chunk_bytes) / (1 << 30) * 1.25 + 0.25, "on")
    url = f"grpc://{address}"
    rows = []
    try:
        source = torch.randint(-(2**15), 2**15, LOAD_CHUNK_SHAPE, dtype=torch.int16).view(DTYPE)
        keys = [f"bench/{i}" for i in range(args.chunks)]
        writer = create_backend(f"{url}?timeout=120")
        try:
            writer.put_many([(key, KVChunk(source, KV_LAYOUT)) for key in keys])
        finally:
            writer.close()
        connections = OffloadConfig().remote_reads_in_flight
        for duty in args.step_thread_duty:
            raw = measure_raw(url, keys, args.raw_connections, args.rounds, duty)
            fetch_url = (
                url if args.bulk_connections is None else f"{url}?bulk_connections={args.bulk_connections}"
            )
            fetch = measure_fetch(fetch_url, keys, chunk_bytes, args.rounds, duty)
            probes = measure_probe(url, chunk_bytes, connections, args.rounds, duty)
            row = {
                "step_thread_duty": duty,
                "raw_connections": args.raw_connections,
                "raw_best_gb_per_s": total / min(raw) / 1e9,
                "raw_median_gb_per_s": total / statistics.median(raw) / 1e9,
                "fetch_reads_in_flight": fetch["reads_in_flight"],
                "fetch_connections": fetch["connections"],
                "fetch_best_gb_per_s": total / min(fetch["seconds"]) / 1e9,
                "fetch_median_gb_per_s": total / statistics.median(fetch["seconds"]) / 1e9,
                "probe_connections": connections,
                "probe_median_gb_per_s": statistics.median(p["gb_per_s"] for p in probes),
                "probe_one_read_median_gb_per_s": statistics.median(p["one_read_gb_per_s"] for p in probes),
                "raw_seconds": raw,
                "fetch_seconds": fetch["seconds"],
                "probes": probes,
            }
            row["fetch_vs_raw"] = row["fetch_median_gb_per_s"] / row["raw_median_gb_per_s"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
    finally:
        server.terminate()
        server.wait(30)
    print_table(rows, total)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        machine = {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "cuda": torch.cuda.is_available(),
        }
        payload = {
            "benchmark": "grpc_fetch",
            "machine": machine,
            "settings": vars(args) | {"out": str(args.out)},
        }
        args.out.write_text(json.dumps(payload | {"num_bytes": total, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    return 0


def print_table(rows: list[dict], total: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "step thread",
        "raw GB/s (conns)",
        "fetch GB/s (reads, conns)",
        "fetch / raw",
        "probe GB/s (one read)",
        title=f"{total / MIB:.0f} MiB from the cache server, best / median of rounds",
    )
    for row in rows:
        table.add_row(
            f"{row['step_thread_duty']:.0%} GIL",
            f"{row['raw_best_gb_per_s']:.2f} / {row['raw_median_gb_per_s']:.2f} ({row['raw_connections']})",
            f"{row['fetch_best_gb_per_s']:.2f} / {row['fetch_median_gb_per_s']:.2f} "
            f"({row['fetch_reads_in_flight']}, {row['fetch_connections']})",
            f"{row['fetch_vs_raw']:.2f}",
            f"{row['probe_median_gb_per_s']:.2f} ({row['probe_one_read_median_gb_per_s']:.2f})",
        )
    Console(width=150).print(table)


if __name__ == "__main__":
    raise SystemExit(main())
