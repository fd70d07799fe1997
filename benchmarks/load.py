"""Load test: many concurrent clients against a real cache server, and many concurrent
streaming clients against a real ``kvstash serve`` whose remote tier is that server.

Part 1, cache server: ``--clients`` threads, each with its own channel, run a mix of
Put / Get / Contains on a key space larger than the server's memory cap for
``--duration`` seconds. Every Get that hits must return exactly the bytes stored
under that key (values are chosen by key), so a wrong value counts as an error.
Reports errors, misses, throughput, p50/p99 latency per operation and the server's
peak resident memory (psutil, sampled every 50 ms) against ``cap + --rss-margin-mb``.

Part 2, engine server (``--streams`` > 0): ``kvstash serve`` on a tiny model made on
the fly, with ``--kv-offload`` to the same cache server; ``--streams`` asyncio clients
each stream ``--requests-per-stream`` completions whose prompts share a 192-token prefix
(stored by one warm-up request; GPU prefix caching is off, so every request loads it
from the cache server).
Reports failed requests (non-200, an error event, no [DONE], no token), TTFT and
latency percentiles.

    python benchmarks/load.py --out load.json                 # 16 clients x 20 s, 32 streams
    python benchmarks/load.py --quick --out load.json         # the bounded CI run (about a minute)

Exit status 1 when any error, failed request or RSS overrun happened.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MIB = 1 << 20
CHUNK_SIZE = 64  # tokens per stored chunk in the engine run: the shared prefix is 3 chunks
START_TIMEOUT_S = 180.0


# ---- child processes -----------------------------------------------------------------
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in [n for n in env if n.startswith("KVSTASH_")]:
        del env[name]  # the flags below alone configure the children
    return env


class Child:
    """A ``kvstash`` subcommand run as a child process; ``port`` is read from its output."""

    def __init__(self, args: list[str], port_pattern: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="kvstash-load-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", *args],
            cwd=REPO_ROOT,
            env=_child_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        pattern = re.compile(port_pattern)
        while True:
            match = pattern.search(Path(self.log.name).read_text(errors="replace"))
            if match:
                self.port = int(match.group(1))
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{' '.join(args[:1])} did not start:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class RssMonitor:
    """Samples a process's resident memory every 50 ms on a thread; ``peak`` is the maximum."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._process = psutil.Process(pid)
        self.baseline = self._process.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ---- part 1: cache server ------------------------------------------------------------
def make_values(num_values: int, value_bytes: int) -> list:
    """Chunks (uint8 [1, 2, T, 1, 1]) of about ``value_bytes`` each; key ``load:{i}`` stores
    chunk ``i % num_values``, serialized for its key by the client before the clock starts."""
    import torch

    from storage_backends.chunk import KVChunk

    generator = torch.Generator().manual_seed(0)
    shape = (1, 2, max(1, value_bytes // 2), 1, 1)
    return [
        KVChunk(torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator))
        for _ in range(num_values)
    ]


def cache_client(
    address: str, values: list, num_keys: int, deadline: float, seed: int, results: dict
) -> None:
    """One client's loop: 30 % Put, 50 % Get, 20 % Contains of 8 keys, until ``deadline``."""
    import grpc

    from protos import kvstash_pb2, kvstash_pb2_grpc
    from storage_backends.chunk import encode_chunk
    from storage_backends.grpc_channel import make_channel
    from storage_backends.grpc_codec import PIECE_BYTES

    rng = random.Random(seed)
    latencies: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    with make_channel(address, secure=False) as channel:
        stub = kvstash_pb2_grpc.KVCacheStub(channel)
        while time.monotonic() < deadline:
            index = rng.randrange(num_keys)
            key = f"load:{index}"
            value = encode_chunk(values[index % len(values)], key=key)  # a value is bound to its key
            roll = rng.random()
            started = time.perf_counter()
            try:
                if roll < 0.3:
                    op = "put"
                    pieces = [
                        kvstash_pb2.PutRequest(key=key, total_size=len(value), data=value[:PIECE_BYTES]),
                        *(
                            kvstash_pb2.PutRequest(data=value[start : start + PIECE_BYTES])
                            for start in range(PIECE_BYTES, len(value), PIECE_BYTES)
                        ),
                    ]
                    stub.Put(iter(pieces), timeout=30)
                elif roll < 0.8:
                    op = "get"
                    try:
                        data = b"".join(r.data for r in stub.Get(kvstash_pb2.GetRequest(key=key), timeout=30))
                    except grpc.RpcError as error:
                        if error.code() != grpc.StatusCode.NOT_FOUND:
                            raise
                        counts["misses"] += 1
                    else:
                        if data != value:
                            counts["wrong_values"] += 1
                else:
                    op = "contains"
                    keys = [f"load:{(index + i) % num_keys}" for i in range(8)]
                    stub.Contains(kvstash_pb2.ContainsRequest(keys=keys), timeout=30)
            except grpc.RpcError as error:
                counts[f"error_{error.code().name}"] += 1
                continue
            latencies[op].append(time.perf_counter() - started)
            counts[op] += 1
    results[seed] = (latencies, counts)


def run_cache_load(
    address: str, num_clients: int, duration_s: float, num_keys: int, value_bytes: int
) -> dict:
    values = make_values(16, value_bytes)
    results: dict = {}
    deadline = time.monotonic() + duration_s
    threads = [
        threading.Thread(target=cache_client, args=(address, values, num_keys, deadline, seed, results))
        for seed in range(num_clients)
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    latencies: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for client_latencies, client_counts in results.values():
        for op, values_s in client_latencies.items():
            latencies[op] += values_s
        for name, number in client_counts.items():
            counts[name] += number
    errors = {name: n for name, n in counts.items() if name.startswith("error_") or name == "wrong_values"}
    ops = {
        op: {
            "count": len(values_s),
            "per_s": len(values_s) / elapsed,
            "p50_ms": 1e3 * float(np.percentile(values_s, 50)),
            "p99_ms": 1e3 * float(np.percentile(values_s, 99)),
        }
        for op, values_s in sorted(latencies.items())
        if values_s
    }
    return {
        "num_clients": num_clients,
        "duration_s": round(elapsed, 2),
        "num_keys": num_keys,
        "value_bytes": values[0].nbytes,
        "num_ops": sum(op["count"] for op in ops.values()),
        "num_errors": sum(errors.values()),
        "errors": errors,
        "num_get_misses": counts["misses"],
        "ops": ops,
    }


def server_memory(address: str) -> dict:
    from protos import kvstash_pb2, kvstash_pb2_grpc
    from storage_backends.grpc_channel import make_channel

    with make_channel(address, secure=False) as channel:
        stats = kvstash_pb2_grpc.AdminStub(channel).Stats(kvstash_pb2.StatsRequest(), timeout=30)
    memory = stats.tiers[0]
    return {
        "bytes_used": memory.bytes_used,
        "capacity_bytes": memory.capacity_bytes,
        "evictions": memory.evictions,
        "num_rejected": stats.num_rejected,
        "puts": memory.puts,
    }


# ---- part 2: engine server -----------------------------------------------------------
async def stream_completion(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion; returns its outcome, TTFT and latency."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    ttft = None
    num_chunks = 0
    done = False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "reason": f"HTTP {response.status_code}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    return {"ok": False, "reason": f"error event: {event['error']}"}
                if ttft is None:
                    ttft = time.perf_counter() - started
                num_chunks += 1
    except Exception as error:  # noqa: BLE001 - every failure is counted, none stops the run
        return {"ok": False, "reason": f"{type(error).__name__}: {error}"}
    if not done or num_chunks == 0:
        return {"ok": False, "reason": f"stream ended early ({num_chunks} events, [DONE] {done})"}
    return {"ok": True, "ttft_s": ttft, "latency_s": time.perf_counter() - started}


async def wait_for_puts(cache_address: str, num_puts: int, timeout_s: float = 60.0) -> None:
    """Wait until the cache server has taken ``num_puts`` puts in all: the engine's
    write-through is asynchronous, and the streams must find the prefix stored."""
    deadline = time.monotonic() + timeout_s
    while (done := server_memory(cache_address)["puts"]) < num_puts:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the warm-up's prefix did not reach the cache server in {timeout_s:g} s "
                f"({done} of {num_puts} puts)"
            )
        await asyncio.sleep(0.05)


async def run_streams(
    url: str, cache_address: str, num_streams: int, requests_per_stream: int, max_tokens: int
) -> dict:
    import httpx

    rng = random.Random(1)
    shared_prefix = [rng.randrange(3, 500) for _ in range(192)]

    async def one_stream(stream_index: int) -> list[dict]:
        outcomes = []
        async with httpx.AsyncClient(timeout=600) as client:
            for request_index in range(requests_per_stream):
                suffix = [3 + (stream_index * 7 + request_index * 13 + i) % 497 for i in range(24)]
                outcomes.append(await stream_completion(client, url, shared_prefix + suffix, max_tokens))
        return outcomes

    # One request stores the shared prefix in the cache server first; with GPU prefix caching
    # off, every later request then loads it from there while 31 others stream.
    num_puts_before = server_memory(cache_address)["puts"]
    async with httpx.AsyncClient(timeout=600) as client:
        warmup = await stream_completion(client, url, shared_prefix + [3] * 24, max_tokens)
    if not warmup["ok"]:
        raise RuntimeError(f"the warm-up request failed: {warmup['reason']}")
    await wait_for_puts(cache_address, num_puts_before + len(shared_prefix) // CHUNK_SIZE)
    started = time.perf_counter()
    outcomes = [o for stream in await asyncio.gather(*map(one_stream, range(num_streams))) for o in stream]
    elapsed = time.perf_counter() - started
    good = [o for o in outcomes if o["ok"]]
    failures = [o["reason"] for o in outcomes if not o["ok"]]

    def percentile(name: str, q: float) -> float | None:
        return 1e3 * float(np.percentile([o[name] for o in good], q)) if good else None

    return {
        "num_streams": num_streams,
        "num_requests": len(outcomes),
        "num_failed": len(failures),
        "failures": failures[:10],
        "duration_s": round(elapsed, 2),
        "ttft_p50_ms": percentile("ttft_s", 50),
        "ttft_p99_ms": percentile("ttft_s", 99),
        "latency_p50_ms": percentile("latency_s", 50),
        "latency_p99_ms": percentile("latency_s", 99),
    }


def external_hit_tokens(url: str) -> float:
    """Sum of the engine's external-hit token counters in /metrics (0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if "external" in sample.name and sample.name.endswith("_total") and "token" in sample.name:
                total += sample.value
    return total


# ---- report ----------------------------------------------------------------------------
def print_report(result: dict) -> None:
    cache = result["cache_server"]
    print(
        f"\ncache server: {cache['num_clients']} clients, {cache['duration_s']} s, "
        f"{cache['num_keys']} keys x {cache['value_bytes']} B, memory cap {result['memory_cap_bytes'] // MIB} MiB"
    )
    print(f"{'op':<10}{'count':>10}{'ops/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for op, figures in cache["ops"].items():
        print(
            f"{op:<10}{figures['count']:>10}{figures['per_s']:>10.0f}{figures['p50_ms']:>10.2f}{figures['p99_ms']:>10.2f}"
        )
    print(f"errors {cache['num_errors']} {cache['errors']}, get misses {cache['num_get_misses']}")
    rss = result["server_rss"]
    print(
        f"server RSS: baseline {rss['baseline_mib']:.0f} MiB, peak {rss['peak_mib']:.0f} MiB, "
        f"limit {rss['limit_mib']:.0f} MiB (baseline + cap + {rss['margin_mib']} MiB margin): "
        f"{'ok' if rss['within_limit'] else 'OVER'}"
    )
    engine = result.get("engine_server")
    if engine:
        print(
            f"\nengine server: {engine['num_streams']} concurrent streams, {engine['num_requests']} requests "
            f"in {engine['duration_s']} s, failed {engine['num_failed']}"
        )
        if engine["ttft_p50_ms"] is not None:
            print(
                f"TTFT p50 {engine['ttft_p50_ms']:.0f} ms p99 {engine['ttft_p99_ms']:.0f} ms; "
                f"latency p50 {engine['latency_p50_ms']:.0f} ms p99 {engine['latency_p99_ms']:.0f} ms; "
                f"external hit tokens {engine['external_hit_tokens']:.0f}"
            )
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}")


@click.command()
@click.option("--clients", type=int, default=16, show_default=True, help="Concurrent cache-server clients.")
@click.option("--duration", type=float, default=20.0, show_default=True, help="Seconds of cache-server load.")
@click.option("--keys", "num_keys", type=int, default=2000, show_default=True, help="Key space size.")
@click.option("--value-kb", type=int, default=256, show_default=True, help="Value size, KiB.")
@click.option("--memory-mb", type=int, default=128, show_default=True, help="The server's memory cap, MiB.")
@click.option(
    "--rss-margin-mb",
    type=int,
    default=256,
    show_default=True,
    help="Resident memory allowed above baseline + cap (gRPC buffers, values in flight).",
)
@click.option(
    "--streams", type=int, default=32, show_default=True, help="Concurrent streaming HTTP clients; 0 skips."
)
@click.option("--requests-per-stream", type=int, default=4, show_default=True)
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--quick", is_flag=True, help="Bounded CI run: 6 s of cache load, one request per stream.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the results as JSON here.")
def main(
    clients,
    duration,
    num_keys,
    value_kb,
    memory_mb,
    rss_margin_mb,
    streams,
    requests_per_stream,
    max_tokens,
    quick,
    out,
):
    """Load the cache server and the engine server; print a table, write JSON."""
    if quick:
        duration, num_keys, value_kb, memory_mb, requests_per_stream, max_tokens = 6.0, 800, 64, 32, 1, 8
    if min(clients, num_keys, value_kb, memory_mb) <= 0 or duration <= 0 or streams < 0:
        raise click.UsageError("counts, sizes and the duration must be positive (--streams may be 0)")
    cap = memory_mb * MIB
    server = Child(
        ["cache-server", "--host", "127.0.0.1", "--port", "0", "--memory-gb", str(cap / (1 << 30))],
        r"listening on grpc://127\.0\.0\.1:(\d+)",
    )
    address = f"127.0.0.1:{server.port}"
    result: dict = {"memory_cap_bytes": cap, "quick": quick}
    try:
        monitor = RssMonitor(server.process.pid)
        result["cache_server"] = run_cache_load(address, clients, duration, num_keys, value_kb * 1024)
        monitor.stop()
        result["server_memory"] = server_memory(address)
        limit = monitor.baseline + cap + rss_margin_mb * MIB
        result["server_rss"] = {
            "baseline_mib": monitor.baseline / MIB,
            "peak_mib": monitor.peak / MIB,
            "limit_mib": limit / MIB,
            "margin_mib": rss_margin_mb,
            "within_limit": monitor.peak <= limit,
        }
        if streams:
            result["engine_server"] = run_engine_load(server.port, streams, requests_per_stream, max_tokens)
    finally:
        server.close()
    engine = result.get("engine_server", {"num_failed": 0})
    result["passed"] = (
        result["cache_server"]["num_errors"] == 0
        and result["server_rss"]["within_limit"]
        and result["server_memory"]["bytes_used"] <= cap
        and engine["num_failed"] == 0
    )
    print_report(result)
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(0 if result["passed"] else 1)


def run_engine_load(cache_port: int, num_streams: int, requests_per_stream: int, max_tokens: int) -> dict:
    """Start ``kvstash serve`` on a tiny model with offload to the cache server and stream at it.

    The engine loads every hit (``--kv-offload-load-policy always``): this run measures the
    server under load, and the planner, timing a loaded 2-core machine, would otherwise
    recompute the tiny prefix instead of loading it (CI once saw 0 hit tokens that way).
    """
    from bench.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvstash-load-model-") as model_dir:
        make_tiny_model(model_dir, arch="llama")
        serve = Child(
            [
                "serve", model_dir, "--host", "127.0.0.1", "--port", "0", "--served-model-name", "tiny",
                "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "32", "--no-enable-prefix-caching",
                "--kv-offload", "--kv-offload-cpu-gb", "0", "--kv-offload-chunk-size", str(CHUNK_SIZE),
                "--kv-offload-load-policy", "always",
                "--kv-offload-remote", f"grpc://127.0.0.1:{cache_port}",
            ],
            r"Uvicorn running on http://127\.0\.0\.1:(\d+)",
        )  # fmt: skip
        url = f"http://127.0.0.1:{serve.port}"
        try:
            figures = asyncio.run(
                run_streams(url, f"127.0.0.1:{cache_port}", num_streams, requests_per_stream, max_tokens)
            )
            figures["external_hit_tokens"] = external_hit_tokens(url)
        finally:
            serve.close()
    return figures


if __name__ == "__main__":
    main()
