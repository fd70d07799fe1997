"""Real `kvstash serve`, `kvstash proxy` and `kvstash router` child processes on free loopback ports, for tests.

`FrontProcess("proxy" or "router", *flags).start()` runs `kvstash proxy` or `kvstash router`
the same way; `answer` asks one of them (or a server) and reads a whole or streamed answer.

`ServeProcess(model_dir, *flags).start()` runs `python -m engine.cli serve MODEL
--host 127.0.0.1 --port 0 FLAGS`, reads the bound port from uvicorn's
"Uvicorn running on http://127.0.0.1:PORT" line and waits for `/health`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: model loading is slow on a busy 2-core machine
START_TIMEOUT_S = 180.0
#: engine flags of the shared test server and of its offline reference (same KV pool)
NUM_GPU_BLOCKS = 256
MAX_NUM_SEQS = 16
_RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def bound_port(process: subprocess.Popen, log: Callable[[], str], what: str) -> int:
    """The port uvicorn says it bound, once its log says so; RuntimeError with the log when
    the process ends or ``START_TIMEOUT_S`` passes first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        match = _RUNNING.search(log())
        if match:
            return int(match.group(1))
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start\n{log()}")
        time.sleep(0.1)


def repo_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in [n for n in env if n.startswith("KVSTASH_KV_OFFLOAD")]:
        del env[name]  # the test's flags alone configure offload
    return env


class ServeProcess:
    """One `kvstash serve` process; `url` is its base URL once started."""

    def __init__(
        self,
        model_dir: str | Path,
        *flags: str,
        served_model_name: str = "tiny",
        cli_module: str = "engine.cli",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """`cli_module` runs in place of `engine.cli` (a test wrapper around it, e.g. with
        a fault injected), with `extra_env` added to its environment."""
        self.model_dir = str(model_dir)
        self.cli_module = cli_module
        self.extra_env = dict(extra_env or {})
        self.served_model_name = served_model_name
        self.flags = tuple(flags)
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        # Open for the child's whole life (its output), so not a with-block.
        self._log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="kvstash-serve-", suffix=".log", delete=False
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServeProcess:
        command = [
            sys.executable,
            "-m",
            self.cli_module,
            "serve",
            self.model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--served-model-name",
            self.served_model_name,
            *self.flags,
        ]
        self.process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=repo_env() | self.extra_env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            self.port = bound_port(self.process, self.log, "kvstash serve")
        except RuntimeError:
            self.close()
            raise
        import httpx

        response = httpx.get(f"{self.url}/health", timeout=30)
        if response.status_code != 200:
            raise RuntimeError(f"/health answered {response.status_code}\n{self.log()}")
        return self

    def metrics_text(self) -> str:
        import httpx

        response = httpx.get(f"{self.url}/metrics", timeout=30)
        response.raise_for_status()
        return response.text

    def log(self) -> str:
        path = Path(self._log_file.name)
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout_s: float = 60.0) -> str:
        """SIGTERM and wait for uvicorn's graceful shutdown (the app's lifespan stops the
        engine thread; uvicorn then re-raises the signal, so the exit code is 0 or
        -SIGTERM). Returns the process's output; raises if it did not shut down cleanly."""
        if self.process is None:
            raise RuntimeError("kvstash serve is not running")
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
            log = self.log()
        finally:
            self.close()
        if code not in (0, -signal.SIGTERM) or "Application shutdown complete" not in log:
            raise RuntimeError(f"kvstash serve did not shut down cleanly (exit code {code})\n{log}")
        return log

    def close(self) -> None:
        """Kill the process if it still runs and delete its log. Idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None
        self._log_file.close()
        Path(self._log_file.name).unlink(missing_ok=True)


def metric_value(text: str, sample_name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0.0 when absent), parsed with
    prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


class FrontProcess:
    """`kvstash proxy` or `kvstash router` (``subcommand``) on a free loopback port."""

    def __init__(self, subcommand: str, *flags: str) -> None:
        self.subcommand = subcommand
        self.flags = flags
        self.log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix=f"kvstash-{subcommand}-", suffix=".log", delete=False
        )
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def start(self) -> FrontProcess:
        command = [
            sys.executable,
            "-m",
            "engine.cli",
            self.subcommand,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *self.flags,
        ]
        self.process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=repo_env(), stdout=self.log_file, stderr=subprocess.STDOUT
        )
        self.port = bound_port(self.process, self.log, f"kvstash {self.subcommand}")
        return self

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log_file.close()
        Path(self.log_file.name).unlink(missing_ok=True)


def answer(url: str, route: str, body: dict, headers: dict | None = None) -> tuple[str, dict]:
    """(the answer's text, its usage) from a streamed or a whole answer."""
    import httpx

    if not body["stream"]:
        response = httpx.post(url + route, json=body, headers=headers, timeout=300)
        assert response.status_code == 200, response.text
        whole = response.json()
        choice = whole["choices"][0]
        return choice.get("text", choice.get("message", {}).get("content")), whole["usage"]
    text, usage = "", None
    with httpx.stream("POST", url + route, json=body, headers=headers, timeout=300) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event, event
        for choice in event["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
        usage = event.get("usage") or usage
    return text, usage
