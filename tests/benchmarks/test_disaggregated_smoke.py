"""benchmarks/disaggregated.py runs end to end on CPU at its smallest size: one engine, two
engines dealt requests in turn, and a producer + consumer behind `kvstash proxy` through a
real cache server, all real `kvstash serve` processes. Every request finishes, the JSON has
the issue's figures, and the lone prompts' greedy answers through the proxy equal one
engine's, the consumer having loaded all but their last token."""

from __future__ import annotations

import json
import signal

import pytest

FIGURES = (
    "decode_ttft_p50_ms", "decode_ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "finished_per_s",
    "goodput_per_s", "slo_attainment", "itl_p99_over_alone",
)  # fmt: skip


@pytest.mark.slow
def test_disaggregated_tiny_run(tmp_path, run_benchmark, tiny_model_dir):
    out = tmp_path / "pd.json"
    flags = ["--model", str(tiny_model_dir("llama")), "--users", "2", "--decode-tokens", "12"]
    flags += ["--long-min", "256", "--long-max", "512", "--long-rate", "3", "--duration", "1"]
    result = run_benchmark(["benchmarks/disaggregated.py", *flags, "--lone-repeats", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert list(report["setups"]) == ["alone", "mixed", "round-robin", "pd"]
    for setup, summary in report["setups"].items():
        assert summary["num_failed"] == 0 and summary["num_finished"] == summary["num_requests"], summary
        assert summary["num_decodes"] >= 2, setup
        for figure in FIGURES:
            assert summary[figure] is not None and summary[figure] >= 0, (setup, figure)
        assert summary["itl_p50_ms"] <= summary["itl_p99_ms"] <= summary["itl_max_ms"]
        # every request generated what it asked for
        for record in report["records"][setup]:
            assert record["num_tokens"] == (12 if record["kind"] == "decode" else 8), record
    assert report["setups"]["alone"]["num_long"] == 0 and report["setups"]["alone"]["itl_p99_over_alone"] == 1
    for setup in ("mixed", "round-robin", "pd"):
        assert report["setups"][setup]["num_long"] == 3  # 1 s at 3 per second
        assert report["setups"][setup]["long_ttft_p99_ms"] > 0
    # round-robin dealt requests to both engines
    assert len({r["target"] for r in report["records"]["round-robin"]}) == 2
    lone = report["lone"]
    assert lone["outputs_equal"] and lone["prompt_tokens"] == 512
    assert lone["consumer_external_hit_tokens"] == [511]  # handed over: all but the last token
    assert lone["engine_ttft_ms"] > 0 and lone["proxy_ttft_ms"] > 0
    assert report["slo"] == {"ttft_ms": 1000.0, "itl_ms": 150.0}
    # every process stopped on SIGTERM (exit 0, or the signal uvicorn raises again)
    codes = report["shutdown_codes"]["both"] + report["shutdown_codes"]["pd"]
    assert len(codes) == 6 and set(codes) <= {0, -signal.SIGTERM}
    assert "ITL p99/alone" in result.stdout and "greedy answers equal: True" in result.stdout


def test_disaggregated_refuses_bad_input(refused_flags):
    """Bad flags stop the script before any process starts, naming the flag (exit 2)."""
    cases = [
        (["--setups", "alone,nope"], "unknown set-up 'nope'"),
        (["--long-min", "900", "--long-max", "800"], "--long-min 900 exceeds --long-max 800"),
        (["--gpu-share", "0.7"], "--gpu-share must be in (0, 0.5]"),
        (["--gpu-share", "0.4", "--gpu-kv-tokens", "100"], "not both"),
        (["--users", "0"], "--users must be at least 1"),
    ]
    refused_flags(["benchmarks/disaggregated.py"], cases)
