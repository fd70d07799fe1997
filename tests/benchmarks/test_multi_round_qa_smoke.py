"""benchmarks/multi_round_qa.py runs on CPU: later rounds load contexts from the CPU tier
and the outputs equal the offload-off run (the script exits non-zero otherwise)."""

from __future__ import annotations

import json


def test_multi_round_qa_tiny_run(tmp_path, run_benchmark):
    out = tmp_path / "mrqa.json"
    run_benchmark(
        ["benchmarks/multi_round_qa.py", "--tiny", "--users", "3", "--rounds", "2"]
        + ["--out", str(out), "--png", str(tmp_path / "m.png")],
    )
    report = json.loads(out.read_text())
    assert report["outputs_identical"] is True
    # the GPU pool holds about one user's context: in round 2 each user's first chunk
    # (256 tokens) is found, in the GPU prefix cache or else in the CPU tier
    assert report["off"]["external_hit_tokens"] == 0
    assert report["on"]["external_hit_tokens"] > 0
    assert report["on"]["external_hit_tokens"] + report["on"]["gpu_hit_tokens"] >= 3 * 256
    assert (tmp_path / "m.png").stat().st_size > 0
