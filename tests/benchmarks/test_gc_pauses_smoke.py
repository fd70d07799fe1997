"""benchmarks/gc_pauses.py runs a kvstash command in its process and reports the collector's
passes per generation."""

from __future__ import annotations

import json
import subprocess
import sys


def test_gc_pauses_of_a_short_command(tmp_path, run_benchmark):
    out, model = tmp_path / "gc.json", tmp_path / "model"
    result = run_benchmark(
        ["benchmarks/gc_pauses.py", "--out", str(out), "--", "make-tiny-model", str(model)],
    )
    data = json.loads(out.read_text())
    assert data["command"] == ["make-tiny-model", str(model)] and data["exit_code"] == 0
    assert (model / "config.json").exists()  # the command itself ran
    assert set(data["generations"]) == {"0", "1", "2"}
    assert data["generations"]["0"]["count"] > 0  # importing torch alone collects generation 0
    assert all(row["ms"] >= 2.0 for row in data["long_passes"])
    assert "generation" in result.stdout


def test_gc_pauses_reports_a_failing_command(tmp_path, repo_root, subprocess_env):
    out = tmp_path / "gc.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/gc_pauses.py", "--out", str(out), "--", "no-such-command"],
        cwd=repo_root,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2  # click's usage error
    assert json.loads(out.read_text())["exit_code"] == 2
