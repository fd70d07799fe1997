"""benchmarks/eager_step.py runs end to end on CPU (32 tiny layers) and reports every shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_tiny_eager_step_benchmark_prints_a_table_and_writes_json(tmp_path, subprocess_env):
    out = tmp_path / "eager.json"
    command = [sys.executable, "benchmarks/eager_step.py", "--tiny", "--repeats", "1", "--batches", "1,2"]
    command += [
        "--decode-context",
        "40",
        "--prefix",
        "64",
        "--chunk",
        "20",
        "--profile",
        "3",
        "--out",
        str(out),
    ]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "| decode | 2 | 2 | 40 |" in result.stdout and "| chunk | 1 | 20 | 64 |" in result.stdout
    data = json.loads(out.read_text())
    assert [(r["shape"], r["batch_size"]) for r in data["rows"]] == [
        ("decode", 1),
        ("decode", 2),
        ("chunk", 1),
    ]
    for row in data["rows"]:
        assert 0 < row["forward_host_ms"] <= row["step_ms"]
        parts = row["parts_us_per_layer"]
        assert set(parts) == {
            "layer",
            "input_layernorm",
            "self_attn",
            "post_attention_layernorm",
            "mlp",
            "attn call",
        }
        assert 0 < parts["attn call"] < parts["self_attn"] < parts["layer"]
        assert row["profile"]["top_host"]
