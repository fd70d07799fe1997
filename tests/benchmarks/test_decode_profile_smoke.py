"""benchmarks/decode_profile.py runs end to end on CPU: one row per batch size, each step's
time measured and profiled (host operations listed; no bound without a GPU)."""

from __future__ import annotations

import json


def test_decode_profile_tiny_run(tmp_path, run_benchmark):
    out = tmp_path / "decode.json"
    result = run_benchmark(
        [
            "benchmarks/decode_profile.py",
            "--tiny",
            "--batch-sizes",
            "1",
            "2",
            "--profile-steps",
            "3",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert [row["batch_size"] for row in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert row["step_ms_median"] > 0 and row["tokens_per_s"] > 0
        assert row["profile_num_steps"] == 3 and row["profile_top_host_ops"]
        assert row["fraction_of_bound"] is None  # the bound needs a GPU's copy rate
    assert data["weight_bytes"] > 0
    assert "| batch | step ms" in result.stdout
