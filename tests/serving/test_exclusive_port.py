"""`kvstash serve` takes its port before anything heavy: a port another process listens on
fails with one line naming it and a non-zero exit, and nothing was loaded meanwhile."""

from __future__ import annotations

import socket
import sys

from tests.ports import listening_pids, run_to_exit
from tests.serving.server_process import REPO_ROOT, ServeProcess, repo_env


def run_serve(model_dir, port: int) -> tuple[int, list[str]]:
    argv = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return run_to_exit(argv, REPO_ROOT, repo_env(), timeout_s=120)


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
    listeners = listening_pids(server.port)
    assert listeners == {server.process.pid}
