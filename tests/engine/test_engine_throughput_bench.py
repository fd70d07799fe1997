"""The throughput benchmark script runs end to end in its --tiny mode (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_tiny_benchmark_prints_a_table_and_writes_json(tmp_path, subprocess_env):
    out = tmp_path / "engine_throughput.json"
    command = [sys.executable, "benchmarks/engine_throughput.py", "--tiny", "--out", str(out)]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "kvstash / hf:" in result.stdout
    data = json.loads(out.read_text())
    assert data["num_output_tokens"] == data["num_requests"] * data["new_tokens"] == 32
    assert data["hf_output_tokens_per_s"] > 0 and data["kvstash_output_tokens_per_s"] > 0
    ratio = data["kvstash_output_tokens_per_s"] / data["hf_output_tokens_per_s"]
    assert abs(data["speedup_vs_hf"] - ratio) < 1e-9
    # every output token of 4 requests x 8 tokens came from its own decode or final prefill step
    assert data["kvstash_steps"] >= data["new_tokens"]


def test_tiny_offload_pair_alternates_rounds_on_fresh_prompts(tmp_path, subprocess_env):
    out = tmp_path / "engine_throughput.json"
    command = [
        *(sys.executable, "benchmarks/engine_throughput.py", "--tiny", "--skip-hf", "--offload"),
        *("--repeats", "2", "--out", str(out)),
    ]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "offload on / off throughput: median" in result.stdout
    pair = json.loads(out.read_text())["offload_pair"]
    assert len(pair["round_ratios"]) == 2 and pair["external_hit_tokens"] == 0
    assert pair["off_seconds"] > 0 and pair["on_seconds"] > 0
