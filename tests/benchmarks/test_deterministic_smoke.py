"""benchmarks/deterministic.py runs on CPU: every run of the matrix (offload off, CPU- and
disk-tier hits, two token budgets, alone and batched, no drafts / n-gram / replayed
drafts) gives the reference tokens, and the tier runs really hit (the script exits
non-zero otherwise); run in two parts as the issue-size GPU run is."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(command: list[str], repo_root, subprocess_env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/deterministic.py", "--tiny", *command],
        cwd=repo_root,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


SMALL = ["--num-requests", "3", "--num-alone", "1", "--min-prompt", "20", "--max-prompt", "60"]
SMALL += ["--new-tokens", "4", "--budgets", "8192", "16"]


def test_deterministic_benchmark_tiny_run_in_two_parts(tmp_path, repo_root, subprocess_env):
    """`--sources off` (reference, default-mode cost), then `--sources cpu disk --reference`
    (the tier runs against the first part's reference tokens): the whole matrix."""
    first, second = tmp_path / "off.json", tmp_path / "tiers.json"
    result = _run([*SMALL, "--sources", "off", "--out", str(first)], repo_root, subprocess_env)
    assert result.returncode == 0, result.stderr[-3000:]
    result = _run(
        [*SMALL, "--sources", "cpu", "disk", "--reference", str(first), "--out", str(second)],
        repo_root,
        subprocess_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    off, tiers = json.loads(first.read_text()), json.loads(second.read_text())
    assert off["total_differing_requests"] == 0 and tiers["total_differing_requests"] == 0
    assert off["throughput_ratio_total"] > 0 and off["throughput_ratio_total_small_budget"] > 0
    assert "throughput_ratio_total" not in tiers  # the cost is the first part's
    assert len(off["reference_token_ids"]) == 3
    runs = off["runs"] + tiers["runs"]
    assert len(runs) == 30  # 3 sources x 2 budgets x (3 proposers at once + 2 one at a time)
    assert {r["source"] for r in off["runs"]} == {"offload off"}
    assert all(r["external_hit_tokens"] > 0 for r in runs if r["source"] != "offload off")
    # the CPU tier was emptied before each disk-tier run: those hits came from disk
    assert all(r["tier_chunk_hits"].get("hits_disk", 0) > 0 for r in runs if r["source"] == "disk-tier hit")
    assert not any("hits_disk" in r["tier_chunk_hits"] for r in runs if r["source"] == "CPU-tier hit")
    assert {r["max_num_batched_tokens"] for r in runs} == {8192, 16}
    # replayed drafts were verified in every replay run; runs without speculation drafted nothing
    assert all(r["num_draft_tokens"] > 0 for r in runs if r["speculative"] == "replay")
    assert all(r["num_draft_tokens"] == 0 for r in runs if r["speculative"] == "off")


def test_a_reference_of_other_prompts_is_refused(tmp_path, repo_root, subprocess_env):
    reference = tmp_path / "other.json"
    reference.write_text(json.dumps({"prompts_digest": "0" * 32, "reference_token_ids": [[1]]}))
    result = _run([*SMALL, "--sources", "cpu", "--reference", str(reference)], repo_root, subprocess_env)
    assert result.returncode != 0 and "no reference tokens for these prompts" in result.stderr
    result = _run([*SMALL, "--sources", "disk"], repo_root, subprocess_env)
    assert result.returncode != 0 and "--reference" in result.stderr
