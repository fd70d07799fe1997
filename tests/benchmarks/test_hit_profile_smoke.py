"""benchmarks/hit_profile.py runs end to end on CPU: the CPU-tier hit loads exactly the
cached prefix (not the other prompt's suffix) and the profile lists operations."""

from __future__ import annotations

import json


def test_hit_profile_tiny_run(tmp_path, run_benchmark):
    out = tmp_path / "hit.json"
    result = run_benchmark(
        ["benchmarks/hit_profile.py", "--tiny", "--prefix", "256", "--suffixes", "1,40"]
        + ["--repeats", "1", "--profile", "--top", "3", "--out", str(out)],
    )
    data = json.loads(out.read_text())
    assert [row["suffix_tokens"] for row in data["rows"]] == [1, 40]
    assert [row["loaded_tokens"] for row in data["rows"]] == [256, 256]
    assert all(row["cpu_hit_ms"] > 0 and row["gpu_hit_ms"] > 0 for row in data["rows"])
    assert set(data["profiles"]) == {"1", "40"}
    assert all(len(p["top_host"]) == 3 for p in data["profiles"].values())
    assert "CPU hit ms" in result.stdout
