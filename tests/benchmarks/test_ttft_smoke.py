"""benchmarks/ttft.py runs end to end on CPU: every tier serves the repeated prompt (the
disk tier through the asynchronous path: fetched into the emptied CPU tier, then loaded)."""

from __future__ import annotations

import json


def test_ttft_benchmark_tiny_run(tmp_path, run_benchmark):
    out = tmp_path / "ttft.json"
    run_benchmark(
        ["benchmarks/ttft.py", "--tiny", "--skip-hf", "--repeats", "1"]
        + ["--lengths", "300", "--tiers", "cpu,disk", "--load-policy", "always"]
        + ["--out", str(out), "--png", str(tmp_path / "t.png")],
    )
    (row,) = json.loads(out.read_text())["rows"]
    # a repeated 300-token prompt loads everything but its last token from the tier alone
    assert row["cpu_ext_tokens"] == 299
    assert row["disk_ext_tokens"] == 299
    assert row["recompute_ms"] > 0 and row["cpu_hit_ms"] > 0
    assert (tmp_path / "t.png").stat().st_size > 0
