"""benchmarks/spec_decode.py runs end to end in its --tiny mode (CPU) and writes a
consistent JSON and the speedup plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_tiny_benchmark_writes_table_json_and_plot(tmp_path, subprocess_env):
    out = tmp_path / "spec_decode.json"
    command = [
        sys.executable,
        "benchmarks/spec_decode.py",
        "--tiny",
        "--new-tokens",
        "8",
        "--batch-sizes",
        "2",
        "--corrupt-fractions",
        "0",
        "1",
        "--out",
        str(out),
    ]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "replayed greedy drafts" in result.stdout
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    [ngram] = data["ngram"]
    assert ngram["outputs_identical"] and ngram["plain_tokens_per_s"] > 0 and ngram["spec_tokens_per_s"] > 0
    exact, corrupt = data["replay"]
    # Greedy drafts from the same model are all accepted; corrupted ones never are; the
    # output never changes.
    assert exact["acceptance_rate"] == 1.0 and corrupt["acceptance_rate"] == 0.0
    assert exact["outputs_identical"] and corrupt["outputs_identical"]
    # 7 tokens after the first: 4 drafts + 1, then 1 draft + 1; without accepted drafts, 1 per step
    assert (exact["decode_steps"], corrupt["decode_steps"]) == (2, 7)
