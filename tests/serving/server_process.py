"""A real `kvstash serve` child process on a free loopback port, for tests.

`ServeProcess(model_dir, *flags).start()` runs `python -m engine.cli serve MODEL
--host 127.0.0.1 --port 0 FLAGS`, reads the bound port from uvicorn's
"Uvicorn running on http://127.0.0.1:PORT" line and waits for `/health`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: model loading is slow on a busy 2-core machine
START_TIMEOUT_S = 180.0
#: engine flags of the shared test server and of its offline reference (same KV pool)
NUM_GPU_BLOCKS = 256
MAX_NUM_SEQS = 16
_RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


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
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.port is None:
            match = _RUNNING.search(self.log())
            if match:
                self.port = int(match.group(1))
            elif self.process.poll() is not None or time.monotonic() > deadline:
                log = self.log()
                self.close()
                raise RuntimeError(f"kvstash serve did not start\n{log}")
            else:
                time.sleep(0.2)
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
