"""The router's tier costs come from what each replica measured (issue 33: the best expected
TTFT): a real engine's `/metrics` text turns into ratios of its load and prefill rates, and
`choice` ranks replicas by those ratios rather than by fixed ones. The poller against
real replicas is checked in tests/serving/test_router.py."""

from __future__ import annotations

import pytest

from engine.server.router.choice import Candidate, choose
from engine.server.router.costs import DEFAULT_TIER_COST, ReplicaCosts, costs_from_metrics
from engine.server.router.matching import PrefixMatch
from engine.server.upstream.pool import Engine


def test_a_real_engine_s_metrics_give_its_measured_cpu_tier_cost(tiny_model_dir):
    from connector import OffloadConfig
    from engine import LLM, SamplingParams
    from engine.metrics import EngineMetrics

    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        device="cpu",
        kv_offload=OffloadConfig(chunk_size=32, cpu_bytes=8 << 20, load_policy="always"),
    )
    try:
        prompt = [(7 * i + 3) % 400 + 20 for i in range(200)]
        params = SamplingParams(max_tokens=2, temperature=0.0)
        before = costs_from_metrics(EngineMetrics(llm.engine).render().decode())
        llm.generate([prompt], params)
        llm.reset_prefix_cache()
        assert llm.generate([prompt], params)[0].metrics.num_external_cached_tokens > 0
        text = EngineMetrics(llm.engine).render().decode()
    finally:
        llm.engine.shutdown()
    costs = costs_from_metrics(text)
    assert costs is not None and before is not None
    assert "cpu" not in before.tier_to_bytes_per_s  # nothing loaded yet: the default ratio
    assert before.tier_cost(1000)["cpu"] == DEFAULT_TIER_COST["cpu"]
    assert costs.kv_bytes_per_token == llm.engine.scheduler.connector.planner.bytes_per_token > 0
    rate = costs.tier_to_bytes_per_s["cpu"]
    prefill = costs.prefill_tokens_per_s(200)
    assert rate > 0 and prefill > 0
    assert costs.tier_cost(200)["cpu"] == pytest.approx(min(1.0, prefill * costs.kv_bytes_per_token / rate))
    assert costs.tier_cost(200)["gpu"] == 0.0 and costs.tier_cost(200)["disk"] == DEFAULT_TIER_COST["disk"]


def test_metrics_without_a_planner_or_kv_size_give_no_costs():
    assert (
        costs_from_metrics("# HELP kvstash_requests_total x\n# TYPE kvstash_requests_total counter\n") is None
    )
    only_rates = (
        "# TYPE kvstash_planner_prefill_tokens_per_second gauge\n"
        'kvstash_planner_prefill_tokens_per_second{prompt_tokens="1024"} 5000.0\n'
    )
    assert costs_from_metrics(only_rates) is None  # no KV size: no ratio can be made
    with pytest.raises(ValueError):
        costs_from_metrics("kvstash_kv_bytes_per_token {{{ not prometheus\n")


def test_rates_become_ratios_per_prompt_length_and_remote_media_share_one_tier():
    text = (
        "# TYPE kvstash_kv_bytes_per_token gauge\nkvstash_kv_bytes_per_token 131072.0\n"
        "# TYPE kvstash_planner_prefill_tokens_per_second gauge\n"
        'kvstash_planner_prefill_tokens_per_second{prompt_tokens="1024"} 20000.0\n'
        'kvstash_planner_prefill_tokens_per_second{prompt_tokens="16384"} 30000.0\n'
        "# TYPE kvstash_planner_tier_read_bytes_per_second gauge\n"
        'kvstash_planner_tier_read_bytes_per_second{connections="0",tier="cpu"} 40e9\n'
        'kvstash_planner_tier_read_bytes_per_second{connections="4",tier="disk"} 1e9\n'
        'kvstash_planner_tier_read_bytes_per_second{connections="1",tier="grpc"} 2e9\n'
        'kvstash_planner_tier_read_bytes_per_second{connections="8",tier="grpc"} 16e9\n'
        'kvstash_planner_tier_read_bytes_per_second{connections="8",tier="redis"} 1e9\n'
    )
    costs = costs_from_metrics(text)
    assert costs == ReplicaCosts(131072, ((1024, 20000.0), (16384, 30000.0)), costs.tier_to_bytes_per_s)
    assert costs.tier_to_bytes_per_s == {"cpu": 40e9, "disk": 1e9, "shared": 16e9}
    short, long = costs.tier_cost(1000), costs.tier_cost(16384)
    assert short["cpu"] == pytest.approx(20000 * 131072 / 40e9)
    assert long["shared"] == pytest.approx(30000 * 131072 / 16e9)
    assert short["disk"] == 1.0  # slower than recomputing: the replica recomputes, costing 1
    assert costs.prefill_tokens_per_s(10**6) == 30000.0  # past the longest listed prompt


def test_a_replica_whose_tier_is_measured_slow_loses_to_one_that_recomputes_less():
    a, b = Engine("http://a", "replica"), Engine("http://b", "replica")
    slow_cpu = {**DEFAULT_TIER_COST, "cpu": 1.0}  # its CPU tier delivers no faster than recomputing
    fast_disk = {**DEFAULT_TIER_COST, "disk": 0.05}
    candidates = [
        Candidate(a, PrefixMatch(cpu=1024), slow_cpu),
        Candidate(b, PrefixMatch(disk=768), fast_disk),
    ]
    decision = choose(candidates, 1100)
    assert decision.order[0] is b and decision.reason == "prefix"
    assert decision.tokens_at(a) == 1100 and decision.tokens_at(b) == pytest.approx(1100 - 768 * 0.95)
    # with the fixed ratios the CPU tier's holder would have won
    assert (
        choose([Candidate(a, PrefixMatch(cpu=1024)), Candidate(b, PrefixMatch(disk=768))], 1100).order[0] is a
    )
