"""benchmarks/cli_startup.py times kvstash --help, kvstash admin health against a cache server it
starts, and the cache server's start, and writes them as JSON."""

from __future__ import annotations

import json

EXPECTED_ROWS = {
    "python -c pass",
    "kvstash --help",
    "kvstash admin --server ADDR health",
    "kvstash cache-server (to listening)",
}


def test_cli_startup_one_run(tmp_path, run_benchmark):
    out = tmp_path / "cli_startup.json"
    result = run_benchmark(["benchmarks/cli_startup.py", "--runs", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["runs"] == 1 and set(data["results"]) == EXPECTED_ROWS
    for name, row in data["results"].items():
        assert len(row["times_s"]) == 1 and row["min_s"] == row["median_s"] == row["max_s"] > 0, name
        assert name in result.stdout


def test_cli_startup_refuses_a_tree_without_kvstash(tmp_path, repo_root, subprocess_env):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "benchmarks/cli_startup.py", "--runs", "1", "--root", str(tmp_path)],
        cwd=repo_root,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "holds no engine/cli.py" in result.stderr
