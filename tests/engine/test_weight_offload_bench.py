"""The weight-offload benchmark runs end to end in its --tiny mode (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_tiny_benchmark_prints_a_table_and_writes_json(tmp_path, subprocess_env):
    out = tmp_path / "weight_offload.json"
    command = [
        *(sys.executable, "benchmarks/weight_offload.py", "--tiny", "--batch-size", "2"),
        *("--prompt-len", "32", "--warmup-steps", "1", "--steps", "3", "--skip-eager", "--out", str(out)),
    ]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "target: offload step" in result.stdout
    assert "greedy tokens identical with and without offload: True" in result.stdout
    data = json.loads(out.read_text())
    assert [run["label"] for run in data["runs"]] == ["no offload", "offload"]
    assert data["failed_runs"] == []
    offload = data["runs"][1]
    # four of six layers, the last ones
    assert offload["offloaded_layer_ids"] == [2, 3, 4, 5]
    assert offload["offloaded_bytes"] >= 4 * data["bytes_per_layer"]
    assert offload["ring_bytes"] * 2 == offload["offloaded_bytes"]
    assert len(offload["step_s_all"]) == 3 and offload["h2d_gb_per_s"] > 0
    assert data["tokens_identical"] is True
    assert data["bound_s"] == max(offload["all_copies_s"], data["runs"][0]["step_s_median"])
