"""Real Redis servers as child processes, for tests and benchmarks: a standalone
``redis-server`` and a Redis Cluster of 3 or more masters.

Every process listens on a free loopback port, keeps its files in its own
temporary directory and persists nothing (``--save "" --appendonly no``).
``RedisServerProcess()`` raises ``RedisServerMissing`` when ``redis-server`` or
``redis-cli`` is not on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

START_TIMEOUT_S = 15.0
CLUSTER_TIMEOUT_S = 60.0


class RedisServerMissing(RuntimeError):
    """``redis-server`` or ``redis-cli`` is not on PATH."""


def find_redis_server() -> str:
    """The path of ``redis-server``; raises ``RedisServerMissing`` when it or ``redis-cli`` is missing."""
    path = shutil.which("redis-server")
    if path is None or shutil.which("redis-cli") is None:
        raise RedisServerMissing(
            "redis-server/redis-cli not found on PATH (install the redis-server package)"
        )
    return path


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ping(port: int) -> bool:
    """True when a Redis server answers PING on ``port`` (raw RESP, no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServerProcess:
    """One real ``redis-server`` on a loopback port chosen at the first ``start()``.

    ``restart()`` reuses the same port, so clients that hold the URL can reconnect.
    ``extra_args`` are appended to the command line (the cluster uses it).
    """

    def __init__(self, extra_args: tuple[str, ...] = ()) -> None:
        self.executable = find_redis_server()
        self.extra_args = tuple(extra_args)
        self.port: int | None = None
        self.workdir = tempfile.mkdtemp(prefix="kvstash-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("redis server has not been started yet")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "redis.log")

    def start(self) -> RedisServerProcess:
        """Start the server and wait until it answers PING; a port lost to a race is retried."""
        if self.process is not None:
            return self
        num_attempts = 1 if self.port is not None else 3
        for attempt in range(num_attempts):
            port = self.port if self.port is not None else free_port()
            if self._launch(port):
                self.port = port
                return self
            if attempt == num_attempts - 1:
                break
        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{port}; log:\n{self._log_tail()}")

    def _launch(self, port: int) -> bool:
        command = [
            self.executable,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", self.workdir,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", self.log_path,
            *self.extra_args,
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                return False  # exited: most likely the port was taken meanwhile
            if _ping(port):
                self.process = process
                return True
            time.sleep(0.02)
        process.kill()
        process.wait()
        return False

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                return "".join(log.readlines()[-20:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s). Idempotent; the port is kept."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def restart(self) -> RedisServerProcess:
        """Stop and start again on the same port (data is gone: nothing is persisted)."""
        self.stop()
        return self.start()

    def flushall(self) -> None:
        import redis

        with redis.Redis(port=self.port, socket_timeout=5) as client:
            client.flushall()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class RedisClusterProcess:
    """A real Redis Cluster of ``num_masters`` masters and no replicas on loopback ports.

    Created with ``redis-cli --cluster create``; ``start()`` returns once every
    node reports ``cluster_state:ok``.
    """

    def __init__(self, num_masters: int = 3) -> None:
        if num_masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {num_masters}")
        self.num_masters = num_masters
        self.nodes: list[RedisServerProcess] = []

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        if not self.nodes:
            raise RuntimeError("redis cluster has not been started yet")
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self) -> RedisClusterProcess:
        for _ in range(self.num_masters):
            # An explicit bus port: the default (port + 10000) may be taken or exceed 65535.
            node = RedisServerProcess(
                extra_args=(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000",
                    "--cluster-port", str(free_port()),
                )
            )  # fmt: skip
            self.nodes.append(node)
            node.start()
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        result = subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=CLUSTER_TIMEOUT_S,
        )
        if result.returncode != 0:
            self.close()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{result.stdout}\n{result.stderr}")
        self._wait_until_ok()
        return self

    def _wait_until_ok(self) -> None:
        import redis

        deadline = time.monotonic() + CLUSTER_TIMEOUT_S
        while time.monotonic() < deadline:
            states = []
            for port in self.ports:
                with redis.Redis(port=port, socket_timeout=5, decode_responses=True) as client:
                    states.append(client.cluster("info").get("cluster_state"))
            if all(state == "ok" for state in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"redis cluster on ports {self.ports} never reached cluster_state:ok: {states}")

    def flushall(self) -> None:
        for node in self.nodes:
            node.flushall()

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.nodes = []
