"""The two servers ``benchmarks/cache_server.py`` compares, as child processes on free
loopback ports: ``kvstash cache-server`` (``python -m cache_server``, memory only or with a
disk tier) and ``redis-server`` without persistence; and what the benchmark asks of them
between its measurements (empty them, the cache server's hits by tier, a server process's
CPU time).

The benchmark starts each once and terminates it at the end; ``clear_*`` run after each
measurement so that the next starts empty. Nothing here is shared with the tests'
fixtures (``cache_server_process.py``, ``redis_process.py``): this start-up is the
benchmark's own (no health wait, the port read from the first line).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_cache_server(
    memory_gb: float, bulk: str, disk_path: str | None = None, disk_gb: float | None = None
) -> tuple[subprocess.Popen, str]:
    # keep the caller's PYTHONPATH after the repo's (packages installed beside the system's)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "cache_server", "--port", "0", "--memory-gb", str(memory_gb)]
        + ["--bulk-port", "any" if bulk == "on" else "off"]
        + (["--disk-path", disk_path, "--disk-gb", str(disk_gb)] if disk_path is not None else []),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = process.stdout.readline()
    if "listening on" not in line:
        process.kill()
        raise RuntimeError(f"cache server did not start: {line!r}")
    return process, line.strip().rsplit("//", 1)[1]


def start_redis(max_memory_bytes: int) -> tuple[subprocess.Popen, int, str]:
    executable = shutil.which("redis-server")
    if executable is None:
        raise RuntimeError("redis-server not found on PATH (apt-get install redis-server)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvstash-bench-redis-")
    process = subprocess.Popen(
        [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", workdir, "--maxmemory", str(max_memory_bytes), "--proto-max-bulk-len", str(512 * MIB)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("redis-server did not answer PING") from None
            time.sleep(0.05)
    client.close()
    return process, port, workdir


def server_cpu_s(process) -> float:
    """User plus system CPU seconds of a server process (``psutil.Process``) so far."""
    times = process.cpu_times()
    return times.user + times.system


def clear_cache_server(address: str) -> None:
    from protos import kvstash_pb2, kvstash_pb2_grpc
    from storage_backends.grpc_channel import make_channel

    with make_channel(address, secure=False) as channel:
        kvstash_pb2_grpc.AdminStub(channel).Clear(kvstash_pb2.ClearRequest(), timeout=60)


def tier_hits(address: str) -> dict[str, int]:
    """Hits so far of each of the server's tiers (shows which tier served a load)."""
    from protos import kvstash_pb2, kvstash_pb2_grpc
    from storage_backends.grpc_channel import make_channel

    with make_channel(address, secure=False) as channel:
        stats = kvstash_pb2_grpc.AdminStub(channel).Stats(kvstash_pb2.StatsRequest(), timeout=60)
    return {tier.name: tier.hits for tier in stats.tiers}


def clear_redis(port: int) -> None:
    import redis

    with redis.Redis(port=port) as client:
        client.flushall()
