"""`kvstash bench` (its click command) with small flags: both runs, the table, JSON, PNG and log; offload
saves recomputation in every round after the first, and outputs stay identical."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.cli import bench

SMALL_FLAGS = [
    "--model-size",
    "tiny",
    "--users",
    "2",
    "--context-len",
    "300",
    "--rounds",
    "3",
    "--question-len",
    "16",
    "--answer-len",
    "4",
]


def test_bench_small_run_writes_table_json_and_plot(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "out"
    result = CliRunner().invoke(bench, [*SMALL_FLAGS, "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "outputs identical: yes" in result.output

    # The model was made under the user's cache folder, and the disk tier used it too.
    assert (tmp_path / "cache" / "kvstash" / "models" / "tiny-llama" / "config.json").is_file()
    assert any((tmp_path / "cache" / "kvstash" / "bench" / "kv-disk").rglob("*"))

    report = json.loads((out / "bench.json").read_text())
    assert report["outputs_identical"] is True
    assert report["workload"]["num_users"] == 2 and len(report["turns"]["on"]) == 6
    rows = report["rounds"]
    assert [row["round"] for row in rows] == [1, 2, 3]
    assert rows[0]["external_hit_tokens_on"] == 0
    assert rows[0]["computed_tokens_on"] == rows[0]["computed_tokens_off"]
    for row in rows[1:]:
        # The first 256-token chunk of each user's context is cached: what the engine's
        # own prefix cache kept, the tiers gave back.
        assert row["gpu_hit_tokens_on"] + row["external_hit_tokens_on"] >= 256
        assert row["external_hit_tokens_on"] > 0
        assert row["loaded_tokens_on"] == row["external_hit_tokens_on"]
        assert row["computed_tokens_on"] < row["computed_tokens_off"]
        assert row["outputs_identical"]
    assert all(t["ttft_s"] > 0 for t in report["turns"]["off"] + report["turns"]["on"])

    png = (out / "bench_ttft.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "req=" in (out / "bench.log").read_text()


def test_bench_rejects_bad_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = CliRunner().invoke(bench, ["--users", "0", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "num_users must be >= 1" in result.output
    assert not (tmp_path / "cache" / "kvstash" / "models").exists()  # nothing was made


@pytest.mark.gpu
def test_bench_on_cuda_float32_outputs_identical_and_less_computed(tmp_path, monkeypatch) -> None:
    """The bench preset on a GPU, float32 (the exactness rule's dtype)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "out"
    flags = [
        "--model-size",
        "bench",
        "--device",
        "cuda",
        "--dtype",
        "float32",
        "--users",
        "4",
        "--context-len",
        "2048",
        "--rounds",
        "3",
    ]
    result = CliRunner().invoke(bench, [*flags, "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["outputs_identical"] is True
    for row in report["rounds"][1:]:
        assert row["gpu_hit_tokens_on"] + row["external_hit_tokens_on"] >= 2048
        assert row["computed_tokens_on"] < row["computed_tokens_off"] / 4
