"""Who listens on a port, and a command run to its exit (tests of taken ports only)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil


def listening_pids(port: int) -> set[int]:
    """The processes with a TCP socket listening on ``port`` (any address)."""
    return {
        conn.pid
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
    }


def run_to_exit(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int, list[str]]:
    """Run ``argv`` until it exits -> (exit code, its non-empty stdout and stderr lines)."""
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    return done.returncode, [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
