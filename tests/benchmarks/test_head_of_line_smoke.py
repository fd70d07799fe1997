"""benchmarks/head_of_line.py runs end to end on CPU: the disk hit is fetched in the
background (load_policy always) while the co-running decode keeps stepping, with the
prefill cap off and on in the same run."""

from __future__ import annotations

import json


def test_head_of_line_benchmark_tiny_run(tmp_path, run_benchmark):
    out = tmp_path / "hol.json"
    result = run_benchmark(
        ["benchmarks/head_of_line.py", "--tiny", "--repeats", "1", "--length", "300"]
        + ["--tiers", "disk", "--load-policy", "always", "--out", str(out)],
    )
    off, on = json.loads(out.read_text())["rows"]
    assert (off["max_decode_gap_ms"], on["max_decode_gap_ms"]) == (0, 50)
    for row in (off, on):
        assert row["tier"] == "disk" and row["tier_to_loaded_tokens"] == {"disk": 299}
        assert row["hit_ttft_ms"] > 0 and row["recompute_ttft_ms"] > 0 and row["lone_recompute_ttft_ms"] > 0
        assert row["hit_decode_max_gap_ms"] > 0 and row["decode_median_gap_ms"] > 0
    assert "cap ms" in result.stdout
