"""benchmarks/deterministic.py runs on CPU: every run of the matrix (offload off, CPU- and
disk-tier hits, two token budgets, alone and batched, no drafts / n-gram / replayed
drafts) gives the
reference tokens, and the tier runs really hit (the script exits non-zero otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_deterministic_benchmark_tiny_run(tmp_path, repo_root, subprocess_env):
    out = tmp_path / "det.json"
    command = [
        sys.executable,
        "benchmarks/deterministic.py",
        "--tiny",
        "--num-requests",
        "3",
        "--num-alone",
        "1",
    ]
    command += ["--min-prompt", "20", "--max-prompt", "60", "--new-tokens", "4", "--budgets", "8192", "16"]
    result = subprocess.run(
        command + ["--out", str(out)],
        cwd=repo_root,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["total_differing_requests"] == 0
    runs = report["runs"]
    assert len(runs) == 30  # 3 sources x 2 budgets x (3 proposers at once + 2 one at a time)
    assert all(r["external_hit_tokens"] > 0 for r in runs if r["source"] != "offload off")
    # the CPU tier was emptied before each disk-tier run: those hits came from disk
    assert all(r["tier_chunk_hits"].get("hits_disk", 0) > 0 for r in runs if r["source"] == "disk-tier hit")
    assert not any("hits_disk" in r["tier_chunk_hits"] for r in runs if r["source"] == "CPU-tier hit")
    assert {r["max_num_batched_tokens"] for r in runs} == {8192, 16}
    # replayed drafts were verified in every replay run; runs without speculation drafted nothing
    assert all(r["num_draft_tokens"] > 0 for r in runs if r["speculative"] == "replay")
    assert all(r["num_draft_tokens"] == 0 for r in runs if r["speculative"] == "off")
    assert report["throughput_ratio_total"] > 0
