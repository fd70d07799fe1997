"""The bounded CI run of ``benchmarks/load.py``: 16 clients of mixed Put/Get/Contains on
a real cache server for 6 s, then 32 concurrent streaming clients on a real
``kvstash serve`` whose remote tier is that server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_load_benchmark_quick_run(tmp_path, reliability_report):
    out = tmp_path / "load.json"
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "load.py"), "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    cache, engine = result["cache_server"], result["engine_server"]
    assert cache["num_clients"] == 16 and cache["num_errors"] == 0
    assert {"put", "get", "contains"} <= set(cache["ops"]) and cache["num_ops"] > 0
    # The key space is twice the memory cap: the server evicts and still stays under it.
    assert result["server_memory"]["evictions"] > 0
    assert result["server_memory"]["bytes_used"] <= result["memory_cap_bytes"]
    assert result["server_rss"]["within_limit"]
    assert engine["num_streams"] == 32 and engine["num_requests"] == 32 and engine["num_failed"] == 0
    # Every stream's request loaded the 192-token shared prefix from the cache server.
    assert engine["external_hit_tokens"] >= 192 * engine["num_requests"]
    assert "PASS" in run.stdout
    reliability_report.record(
        "load (quick)",
        "16 cache-server clients x 6 s mixed put/get/contains; 32 concurrent streaming HTTP clients",
        num_requests=cache["num_ops"] + engine["num_requests"],
        num_failed=cache["num_errors"] + engine["num_failed"],
        cache_ops=cache["ops"],
        server_rss=result["server_rss"],
        engine_server=engine,
    )
