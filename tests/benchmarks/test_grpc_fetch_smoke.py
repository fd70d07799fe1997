"""benchmarks/grpc_fetch.py runs end to end on CPU: the raw bulk channel, the connector's fetch
path and its prober read the same chunks from a real cache server; bad flags are refused."""

from __future__ import annotations

import json


def test_grpc_fetch_benchmark_tiny_run(tmp_path, run_benchmark):
    out = tmp_path / "grpc_fetch.json"
    result = run_benchmark(
        ["benchmarks/grpc_fetch.py", "--chunks", "2", "--rounds", "1", "--raw-connections", "2"]
        + ["--step-thread-duty", "0", "0.5", "--out", str(out)]
    )
    payload = json.loads(out.read_text())
    assert payload["num_bytes"] == 2 * 32 << 20
    assert [row["step_thread_duty"] for row in payload["rows"]] == [0.0, 0.5]
    for row in payload["rows"]:
        assert row["raw_best_gb_per_s"] > 0 and row["fetch_best_gb_per_s"] > 0
        assert row["probe_median_gb_per_s"] > 0
        # the connector's cache-server tier: a bulk connection per read in flight
        assert row["fetch_reads_in_flight"] == row["fetch_connections"] == 8
    assert "fetch / raw" in result.stdout


def test_grpc_fetch_benchmark_refuses_bad_flags(refused_flags):
    refused_flags(
        ["benchmarks/grpc_fetch.py"],
        [
            (["--chunks", "0"], "must be positive"),
            (["--step-thread-duty", "1.5"], "between 0 and 1"),
        ],
    )
