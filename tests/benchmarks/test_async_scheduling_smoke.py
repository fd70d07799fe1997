"""benchmarks/async_scheduling.py runs end to end on CPU and reports both modes, the
idle gaps and the prepare times (numbers are not asserted: benchmarks only)."""

from __future__ import annotations

import json


def test_async_scheduling_tiny_run(tmp_path, run_benchmark):
    out = tmp_path / "async.json"
    result = run_benchmark(
        ["benchmarks/async_scheduling.py", "--model-size", "tiny", "--device", "cpu"]
        + ["--concurrency", "1", "2", "--prompt-len", "16", "--new-tokens", "5", "--rounds", "1"]
        + [
            "--prepare-requests",
            "8",
            "--prepare-context-len",
            "64",
            "--prepare-steps",
            "4",
            "--out",
            str(out),
        ],
    )
    data = json.loads(out.read_text())
    assert [row["concurrency"] for row in data["decode"]] == [1, 2]
    for row in data["decode"]:
        for mode in ("sync", "async"):
            assert row[mode]["tokens_per_s"] > 0
            assert len(row[mode]["round_tokens_per_s"]) == 1
    prepare = data["prepare"]
    assert prepare["num_requests"] == 8
    assert prepare["from_scratch"]["median_us"] > 0 and prepare["persistent_batch"]["median_us"] > 0
    assert "persistent batch" in result.stdout
    assert set(data["meets_targets"]) == {"async_speedup", "prepare_speedup"}
