"""benchmarks/cache_server.py runs end to end: every transport against redis-server, and the load."""

from __future__ import annotations

import json
import subprocess
import sys


def test_cache_server_benchmark_tiny_run(tmp_path, repo_root, subprocess_env):
    out = tmp_path / "cache_server.json"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/cache_server.py",
            "--sizes-kib",
            "512",
            "--clients",
            "2",
            "--rounds",
            "1",
        ]
        + ["--mib-per-cell", "2", "--load-mib", "40", "--load-rounds", "1", "--out", str(out)],
        cwd=repo_root,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {(cell["op"]) for cell in report["cells"]} == {"put", "get", "get_into", "put_many"}
    for cell in report["cells"]:
        for transport in ("unix", "tcp", "grpc"):
            assert cell[f"kvstash-{transport}_mb_per_s"] > 0 and cell[f"kvstash-{transport}_ratio"] > 0
        assert cell["redis_mb_per_s"] > 0 and cell["unix_socket_bound_mb_per_s"] > 0
    # the load used each transport it asked for (the benchmark checks the tier's own report)
    assert [row["transport"] for row in report["load"]] == ["unix", "tcp", "grpc"]
    assert all(row["num_chunks"] == 1 and row["best_gb_per_s"] > 0 for row in report["load"])
