"""`kvstash serve` takes its port before anything heavy: a port another process listens on
fails with one line naming it and a non-zero exit, and nothing was loaded meanwhile."""

from __future__ import annotations

import socket
import subprocess
import sys

import psutil

from tests.serving.server_process import REPO_ROOT, ServeProcess, repo_env


def run_serve(model_dir, port: int) -> tuple[int, list[str]]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=REPO_ROOT,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


def test_a_taken_port_fails_in_one_line_before_the_model_loads(serving_model_dir) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = run_serve(serving_model_dir, port)
    assert code != 0
    # One line: no engine or uvicorn log line came before it (the model never loaded).
    assert lines == [
        f"Error: port 127.0.0.1:{port} is already in use by another process (stop it or choose another port)"
    ]


def test_a_second_serve_on_a_serving_port_leaves_the_first_alone(
    server: ServeProcess, serving_model_dir
) -> None:
    code, lines = run_serve(serving_model_dir, server.port)
    assert code != 0 and len(lines) == 1 and f"port 127.0.0.1:{server.port} is already in use" in lines[0]
    listeners = {
        conn.pid
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == server.port
    }
    assert listeners == {server.process.pid}
