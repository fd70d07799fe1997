"""The soak's child processes: ``kvstash serve`` and ``kvstash cache-server`` (``python -m
cache_server``), each with its output in a log file and its port read from that output.

Used by ``benchmarks/soak.py``: a serve process and a cache server at the start, the cache
server again at each restart, a reference serve process at the end. ``Child.stop`` sends
SIGTERM (and kills what is left after its timeout); nothing here outlives the soak's
``stop`` calls. The children get the caller's environment with the repository on
``PYTHONPATH`` and no ``KVSTASH_*`` variables: their flags alone configure them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: how long a child may take to print its port (and serve to answer /health)
START_TIMEOUT_S = 300.0


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in [n for n in env if n.startswith("KVSTASH_") and n != "KVSTASH_CACHE_DIR"]:
        del env[name]  # the flags alone configure the children
    return env


class Child:
    """A child process whose output goes to ``log_path``; ``port`` is read from its
    output with ``port_pattern``; ``extra_env`` is added to its environment. ``stop()``
    sends SIGTERM and returns the exit code."""

    def __init__(
        self,
        command: list[str],
        log_path: Path,
        port_pattern: str,
        what: str,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.command, self.log_path, self.what = command, log_path, what
        self.extra_env = dict(extra_env or {})
        self._pattern = re.compile(port_pattern)
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self) -> Child:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO_ROOT,
                env=child_env() | self.extra_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            match = self._pattern.search(self.output()[offset:])
            if match:
                self.port = int(match.group(1))
                return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.output()[offset:][-3000:]
                self.kill()
                raise RuntimeError(f"{self.what} did not start ({' '.join(self.command)}):\n{tail}")
            time.sleep(0.1)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_serve(model: str, flags: list[str], log_path: Path, what: str) -> Child:
    command = [sys.executable, "-m", "engine.cli", "serve", model, "--host", "127.0.0.1", "--port", "0"]
    command += ["--served-model-name", "soak", *flags]
    child = Child(command, log_path, r"Uvicorn running on http://127\.0\.0\.1:(\d+)", what).start()
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while httpx.get(f"http://127.0.0.1:{child.port}/health", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            child.kill()
            raise RuntimeError(f"{what}: /health never answered 200\n{child.output()[-3000:]}")
        time.sleep(0.5)
    return child


def cache_server_command(port: int, memory_mib: float) -> list[str]:
    return [
        sys.executable, "-m", "cache_server", "--host", "127.0.0.1", "--port", str(port),
        "--memory-gb", f"{memory_mib / 1024:.6f}", "--heap-reserve-mb", "0", "--grace-s", "2",
    ]  # fmt: skip


def start_cache_server(port: int, memory_mib: float, log_path: Path, attempts: int = 20) -> Child:
    """Start the cache server on ``port`` (0: a free one); a restart on a port that the
    old process just left is retried for a few seconds."""
    for attempt in range(attempts):
        child = Child(
            cache_server_command(port, memory_mib),
            log_path,
            r"listening on grpc://127\.0\.0\.1:(\d+)",
            "cache server",
        )
        try:
            return child.start()
        except RuntimeError:
            if port == 0 or attempt == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")
