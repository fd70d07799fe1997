"""benchmarks/router.py runs end to end on CPU at a small size: two real `kvstash serve`
replicas publishing KV events, dealt a multi-turn workload round-robin and by user, then
through a real `kvstash router`. Every request finishes, the JSON has the issue's figures,
and the load per replica read from the replicas' /metrics matches where the client sent
each request."""

from __future__ import annotations

import json
import zlib

import pytest

USERS, TURNS = 6, 2


@pytest.mark.slow
def test_router_tiny_run(tmp_path, run_benchmark, tiny_model_dir):
    out = tmp_path / "router.json"
    flags = ["--model", str(tiny_model_dir("llama")), "--users", str(USERS), "--turns", str(TURNS)]
    flags += ["--rate", "10", "--cpu-tier-gb", "0.0015"]
    result = run_benchmark(["benchmarks/router.py", *flags, "--out", str(out)])
    report = json.loads(out.read_text())
    # the users' contexts do not fit one replica's GPU pool + CPU tier
    assert report["total_context_tokens"] > report["replica_cache_tokens"]
    assert list(report["policies"]) == ["round-robin", "affinity", "kv-aware"]
    for policy, summary in report["policies"].items():
        assert summary["num_failed"] == 0 and summary["num_finished"] == USERS * TURNS, (policy, summary)
        for figure in ("hit_rate", "ttft_mean_ms", "ttft_p90_ms", "requests_per_s", "prompt_tokens_per_s"):
            assert summary[figure] is not None and summary[figure] >= 0, (policy, figure)
        assert summary["ttft_mean_ms"] > 0 and summary["requests_per_s"] > 0
        loads = summary["replica_loads"]
        # the replicas counted every request and prompt token of the policy, none of another's
        assert sum(load["requests"] for load in loads) == USERS * TURNS, (policy, loads)
        prompt_tokens = sum(r["num_prompt_tokens"] for r in report["records"][policy])
        assert sum(load["prompt_tokens"] for load in loads) == prompt_tokens, (policy, loads)
    by_policy = report["policies"]
    # the client dealt round-robin: half each
    assert [load["requests"] for load in by_policy["round-robin"]["replica_loads"]] == [USERS * TURNS / 2] * 2
    # session affinity: a user's turns all go to replica crc32(user id) % 2
    expected = [0.0, 0.0]
    for user in range(USERS):
        expected[zlib.crc32(f"user-{user}".encode()) % 2] += TURNS
    assert [load["requests"] for load in by_policy["affinity"]["replica_loads"]] == expected
    # a later turn extends the previous prompt: whoever holds it serves part of it from cache
    for policy in ("affinity", "kv-aware"):
        assert by_policy[policy]["hit_rate_later_turns"] > 0, policy
    assert set(report["p90_ttft_ratios"]) == {"round-robin", "affinity"}
    assert "P90 TTFT over kv-aware's" in result.stdout


def test_router_benchmark_refuses_bad_input(refused_flags):
    """Bad flags stop the script before any process starts, naming the flag (exit 2)."""

    cases = [
        (["--policies", "round-robin,random"], "unknown policy 'random'"),
        (["--context-min", "900", "--context-max", "800"], "--context-min 900 exceeds --context-max 800"),
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--rate", "0"], "--rate must be positive"),
    ]
    refused_flags(["benchmarks/router.py"], cases)
