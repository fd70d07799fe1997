"""The processes of one serving benchmark set-up: ``kvstash serve`` engines, a shared tier
(``kvstash cache-server`` or ``redis-server``), ``kvstash proxy`` / ``kvstash router``; all on
loopback ports, each with its log in the stack's folder.

Used by ``benchmarks/disaggregated.py`` and ``benchmarks/router.py``: one `ServingStack` per
set-up, as a ``with`` block; leaving it stops every process it started (SIGTERM, newest
first; a process still there after its timeout is killed). Engines start in parallel and
are ready once ``/health`` answers 200.

GPU memory when several engines share one GPU: ``kv_pool_flags`` gives each engine a KV
pool of ``kv_tokens`` tokens (``--num-gpu-blocks``: engines may then start together), or a
share of the GPU's memory (``--gpu-memory-utilization``: the engine sizes its pool from the
memory free when it starts, so engines given shares start one after another, engine i with
``(i + 1) * share``, each taking what the ones before it left).
"""

from __future__ import annotations

import math
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.support.model_folders import ModelFolder
from benchmarks.support.redis_process import RedisServerProcess
from benchmarks.support.soak_children import START_TIMEOUT_S, Child, start_cache_server

_RUNNING = r"Uvicorn running on http://127\.0\.0\.1:(\d+)"
#: the engines' KV block size (the engine's default)
BLOCK_SIZE = 16
#: the name clients send in "model"
SERVED_MODEL_NAME = "bench"
#: shared tiers a P/D set-up can use
SHARED_TIERS = ("grpc", "redis")


def kv_pool_flags(kv_tokens: int | None, gpu_share: float | None, position: int) -> list[str]:
    """The KV pool flags of the ``position``-th engine on a device (see the module doc)."""
    if kv_tokens is not None:
        return ["--num-gpu-blocks", str(math.ceil(kv_tokens / BLOCK_SIZE))]
    if gpu_share is not None:
        if not 0 < gpu_share * (position + 1) <= 1:
            raise ValueError(
                f"--gpu-share {gpu_share:g} leaves no room for engine {position + 1} on one device"
            )
        return ["--gpu-memory-utilization", f"{gpu_share * (position + 1):.4f}"]
    return []


class ServingStack:
    """Child processes of one set-up. ``engine_env`` is added to every engine's environment
    (e.g. ``OMP_NUM_THREADS`` on CPU, where engines share the cores)."""

    def __init__(self, model: ModelFolder, log_dir: Path, engine_env: dict[str, str] | None = None) -> None:
        self.model, self.log_dir = model, log_dir
        self.engine_env = dict(engine_env or {})
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.redis: RedisServerProcess | None = None

    def __enter__(self) -> ServingStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start_shared_tier(self, kind: str, memory_mib: float) -> str:
        """Start the tier producer and consumer share; returns its URL for ``--kv-offload-remote``."""
        if kind == "grpc":
            child = start_cache_server(0, memory_mib, self._log("cache-server"))
            self.children.append(child)
            return f"grpc://127.0.0.1:{child.port}"
        if kind == "redis":
            self.redis = RedisServerProcess().start()  # RedisServerMissing names what to install
            return self.redis.url
        raise ValueError(f"unknown shared tier {kind!r}: choose one of {', '.join(SHARED_TIERS)}")

    def start_engines(
        self,
        names: list[str],
        flag_lists: list[list[str]],
        one_by_one: bool = False,
        ports: list[int] | None = None,
    ) -> list[str]:
        """Start ``kvstash serve`` per name with its flags (after the model's own) on
        ``ports`` (default: free ones the engines pick); returns their base URLs once every
        one answers ``/health``. Known ports let a proxy or router start at the same time."""
        if len(names) != len(flag_lists) or (ports is not None and len(ports) != len(names)):
            raise ValueError(f"{len(names)} engine names for {len(flag_lists)} flag lists and ports {ports}")
        children = []
        for n, (name, flags) in enumerate(zip(names, flag_lists, strict=True)):
            port = "0" if ports is None else str(ports[n])
            command = [sys.executable, "-m", "engine.cli", "serve", str(self.model.path)]
            command += ["--host", "127.0.0.1", "--port", port, "--served-model-name", SERVED_MODEL_NAME]
            command += [*self.model.serve_flags, *flags]
            children.append(
                Child(command, self._log(name), _RUNNING, f"kvstash serve ({name})", self.engine_env)
            )
        self.children += children
        if one_by_one:
            return [self._ready(child) for child in children]
        with ThreadPoolExecutor(len(children)) as starting:
            return list(starting.map(self._ready, children))

    def start_front(self, subcommand: str, flags: list[str]) -> str:
        """Start ``kvstash proxy`` or ``kvstash router`` with ``flags``; returns its base URL."""
        command = [
            sys.executable,
            "-m",
            "engine.cli",
            subcommand,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *flags,
        ]
        child = Child(command, self._log(subcommand), _RUNNING, f"kvstash {subcommand}")
        self.children.append(child)
        return self._ready(child)

    @staticmethod
    def _ready(child: Child) -> str:
        import httpx

        child.start()
        url = f"http://127.0.0.1:{child.port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or child.process.poll() is not None:
                raise RuntimeError(f"{child.what}: /health never answered 200\n{child.output()[-3000:]}")
            time.sleep(0.2)

    def close(self) -> list[int | None]:
        """Stop every process, newest first; their exit codes (None: killed or never started)."""
        codes = [child.stop(timeout_s=30) for child in reversed(self.children)]
        self.children = []
        if self.redis is not None:
            self.redis.close()
            self.redis = None
        return codes


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (bound at once, then closed)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def kv_event_endpoints() -> tuple[str, str]:
    """Two loopback ZeroMQ endpoints (PUB, REPLAY) on distinct ports free a moment ago."""
    pub, replay = free_ports(2)
    return f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
