"""The real cache server as a child process, for tests and benchmarks.

``CacheServerProcess(args)`` runs ``python -m cache_server --port 0 ARGS``
(the same click command as ``kvstash cache-server``, without importing the
engine, which keeps start-up short), reads the bound port from its first line
of output and waits until the standard health service answers SERVING.
``stop()`` sends SIGTERM and returns the exit code; ``close()`` kills what is
left and removes the log file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


def repo_env(**extra: str) -> dict[str, str]:
    """Environment for a child process that imports the repository's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("KVSTASH_AUTH_TOKEN", None)
    env.update(extra)
    return env


class CacheServerProcess:
    """One ``kvstash cache-server`` child process on a free loopback port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int = 0) -> None:
        self.args = tuple(args)
        self.env = env or repo_env()
        self.requested_port = port
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.scheme = "grpcs" if "--tls-cert" in self.args else "grpc"
        # Open for the child's whole life (its stderr), so not a with-block.
        self._log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="kvstash-cache-server-", suffix=".log", delete=False
        )
        self._lines: list[str] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    def start(self, tls_ca: str | None = None) -> CacheServerProcess:
        """Start and wait for SERVING (over TLS with ``tls_ca`` when the server uses TLS)."""
        port = self.port if self.port is not None else self.requested_port
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cache_server", "--host", "127.0.0.1", "--port", str(port), *self.args],
            cwd=REPO_ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
        )
        first_line = self._read_first_line()
        if "listening on" not in first_line:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"cache server did not start: {first_line!r}\n{self.log()}")
        self.port = int(first_line.strip().rsplit(":", 1)[1])
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        self.wait_serving(tls_ca)
        return self

    def _read_first_line(self) -> str:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        return result[0] if result else ""

    def _drain(self) -> None:
        for line in self.process.stdout:
            self._lines.append(line)

    def wait_serving(self, tls_ca: str | None = None) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from storage_backends.grpc_channel import make_channel

        deadline = time.monotonic() + START_TIMEOUT_S
        with make_channel(self.address, secure=self.scheme == "grpcs", ca_path=tls_ca) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"cache server never became SERVING\n{self.log()}")
                time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the server and wait for it; returns its exit code."""
        if self.process is None:
            raise RuntimeError("cache server is not running")
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"cache server ignored signal {sig} for {timeout_s} s\n{self.log()}") from None
        self.process = None
        return code

    def log(self) -> str:
        """Everything the server wrote to stderr so far."""
        return Path(self._log_file.name).read_text(errors="replace")

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None
        self._log_file.close()
        os.unlink(self._log_file.name)
