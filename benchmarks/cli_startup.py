"""How long the ``kvstash`` command takes to start (issue 35: ``kvstash --help`` and
``kvstash admin --server HOST:PORT health`` within 0.5 s; the compose stack's health check
runs the latter every 10 s).

Times, over ``--runs`` fresh processes each (``python -m engine.cli``, as the console
command runs):

- ``python -c pass``: the interpreter's own start, the floor (it grows with the machine's load);
- ``kvstash --help``: to its exit;
- ``kvstash admin --server ADDR health``: to its exit, against a cache server this script
  starts (a ``kvstash cache-server`` on a free loopback port);
- ``kvstash cache-server``: from the start of the process to its ``listening on`` line.

and prints min / median / max seconds per command and writes them as JSON. ``--root``
times another source tree (e.g. a checkout of an older commit) with this interpreter:

    python benchmarks/cli_startup.py --runs 5 --out cli_startup.json
    python benchmarks/cli_startup.py --runs 5 --root /path/to/old/checkout --out before.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0


def kvstash_env(root: Path) -> dict[str, str]:
    """The environment of a child ``kvstash`` that runs the code under ``root``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("KVSTASH_AUTH_TOKEN", None)
    return env


def kvstash(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli", *args]


class CacheServer:
    """A ``kvstash cache-server --port 0`` child of ``root``; :attr:`seconds_to_listening` is the
    time from its start to its ``listening on`` line."""

    def __init__(self, root: Path) -> None:
        started = time.perf_counter()
        self.process = subprocess.Popen(
            kvstash("--log-level", "WARNING", "cache-server", "--host", "127.0.0.1", "--port", "0"),
            cwd=root,
            env=kvstash_env(root),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self._first_line()
        self.seconds_to_listening = time.perf_counter() - started
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"the cache server did not start (first line {line!r})")
        # "kvstash cache server listening on grpc://127.0.0.1:PORT ..."
        self.address = line.split("://", 1)[1].split()[0]
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # never a full pipe

    def _first_line(self) -> str:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        return lines[0] if lines else ""

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def time_command(root: Path, args: list[str]) -> float:
    """Seconds ``kvstash ARGS`` takes to exit; RuntimeError when it fails."""
    started = time.perf_counter()
    result = subprocess.run(kvstash(*args), cwd=root, env=kvstash_env(root), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"kvstash {' '.join(args)} exited {result.returncode}: {result.stderr[-2000:]}")
    return seconds


def time_python(root: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], cwd=root, env=kvstash_env(root), check=True)
    return time.perf_counter() - started


def repeat(runs: int, measure: Callable[[], float]) -> dict[str, object]:
    times = [measure() for _ in range(runs)]
    return {
        "min_s": min(times),
        "median_s": statistics.median(times),
        "max_s": max(times),
        "times_s": times,
    }


def time_server_start(root: Path) -> float:
    server = CacheServer(root)
    server.stop()
    return server.seconds_to_listening


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per command (default 5)")
    parser.add_argument(
        "--root", type=Path, default=REPO_ROOT, help="source tree whose kvstash to time (default: this one)"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    root = args.root.resolve()
    if not (root / "engine" / "cli.py").is_file():
        parser.error(f"--root {args.root} holds no engine/cli.py")

    results: dict[str, dict[str, object]] = {}
    # the floor: a bare interpreter start on this machine under its present load
    results["python -c pass"] = repeat(args.runs, lambda: time_python(root))
    results["kvstash --help"] = repeat(args.runs, lambda: time_command(root, ["--help"]))
    server = CacheServer(root)
    try:
        health = ["admin", "--server", server.address, "health"]
        results["kvstash admin --server ADDR health"] = repeat(args.runs, lambda: time_command(root, health))
    finally:
        server.stop()
    results["kvstash cache-server (to listening)"] = repeat(args.runs, lambda: time_server_start(root))

    width = max(len(name) for name in results)
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(
        f"kvstash start-up, {args.runs} runs each, {root} ({platform.machine()}, {os.cpu_count()} cores{load})"
    )
    print(f"{'command':<{width}}  {'min s':>7}  {'median s':>8}  {'max s':>7}")
    for name, row in results.items():
        print(f"{name:<{width}}  {row['min_s']:>7.3f}  {row['median_s']:>8.3f}  {row['max_s']:>7.3f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "root": str(root),
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "runs": args.runs,
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
