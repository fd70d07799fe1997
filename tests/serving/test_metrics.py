"""`/metrics` parses with prometheus_client's parser and its counters move as
requests run; two engines' metrics in one process stay apart."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.serving.server_process import NUM_GPU_BLOCKS, metric_value

COUNTERS = [
    "kvstash_prompt_tokens_total",
    "kvstash_generation_tokens_total",
    "kvstash_gpu_prefix_hit_tokens_total",
    "kvstash_time_to_first_token_seconds_count",
    "kvstash_inter_token_latency_seconds_count",
    "kvstash_engine_computed_tokens_total",
]


def snapshot(server) -> dict[str, float]:
    text = server.metrics_text()
    values = {name: metric_value(text, name) for name in COUNTERS}
    values["length"] = metric_value(text, "kvstash_requests_total", finish_reason="length")
    return values


def test_metrics_parse_and_name_conventions(server) -> None:
    text = server.metrics_text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    expected_types = {
        "kvstash_requests": "counter",
        "kvstash_prompt_tokens": "counter",
        "kvstash_generation_tokens": "counter",
        "kvstash_gpu_prefix_hit_tokens": "counter",
        "kvstash_external_hit_tokens": "counter",
        "kvstash_kv_loaded_tokens": "counter",
        "kvstash_kv_loaded_bytes": "counter",
        "kvstash_kv_saved_tokens": "counter",
        "kvstash_kv_load_throughput_gb_per_second": "histogram",
        "kvstash_time_to_first_token_seconds": "histogram",
        "kvstash_inter_token_latency_seconds": "histogram",
        "kvstash_kv_blocks_total": "gauge",
        "kvstash_kv_blocks_used": "gauge",
        "kvstash_kv_cache_usage_ratio": "gauge",
        "kvstash_spec_decode_draft_tokens": "counter",
        "kvstash_spec_decode_accepted_tokens": "counter",
        "kvstash_spec_decode_acceptance_ratio": "gauge",
        "kvstash_tier_hit_chunks": "counter",
        "kvstash_step_time_seconds": "gauge",
    }
    for name, metric_type in expected_types.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == metric_type, name
    assert metric_value(text, "kvstash_kv_blocks_total") == NUM_GPU_BLOCKS
    assert 0.0 <= metric_value(text, "kvstash_kv_cache_usage_ratio") <= 1.0
    terms = {sample.labels["term"] for sample in families["kvstash_step_time_seconds"].samples}
    assert terms == {"step", "eager_step", "token", "pair"}


def test_counters_move_as_requests_run(server, client) -> None:
    prompt = [(17 * i + 3) % 500 + 5 for i in range(40)]  # 2.5 KV blocks, used by no other test
    before = snapshot(server)
    first = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    middle = snapshot(server)
    num_prompt = first.usage.prompt_tokens
    assert num_prompt == 40 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert middle["length"] == before["length"] + 1
    assert middle["kvstash_prompt_tokens_total"] == before["kvstash_prompt_tokens_total"] + num_prompt
    assert middle["kvstash_generation_tokens_total"] == before["kvstash_generation_tokens_total"] + 6
    assert (
        middle["kvstash_time_to_first_token_seconds_count"]
        == before["kvstash_time_to_first_token_seconds_count"] + 1
    )
    assert (
        middle["kvstash_inter_token_latency_seconds_count"]
        == before["kvstash_inter_token_latency_seconds_count"] + 5
    )
    assert (
        middle["kvstash_engine_computed_tokens_total"]
        >= before["kvstash_engine_computed_tokens_total"] + num_prompt
    )

    second = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    after = snapshot(server)
    num_gpu_hit = second.usage.prompt_tokens_details.cached_tokens
    assert num_gpu_hit == 32  # the two full blocks
    assert (
        after["kvstash_gpu_prefix_hit_tokens_total"]
        == middle["kvstash_gpu_prefix_hit_tokens_total"] + num_gpu_hit
    )
    # The hit tokens were not recomputed.
    num_computed = (
        after["kvstash_engine_computed_tokens_total"] - middle["kvstash_engine_computed_tokens_total"]
    )
    assert num_computed <= num_prompt - num_gpu_hit + 6


def test_two_engines_in_one_process_keep_separate_metrics(serving_model_dir) -> None:
    from engine import EngineArgs, EngineCore, SamplingParams
    from engine.metrics import EngineMetrics

    engines = [EngineCore(serving_model_dir, EngineArgs(num_gpu_blocks=n)) for n in (32, 48)]
    metrics = [EngineMetrics(engine) for engine in engines]
    engines[0].add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0))
    while engines[0].has_unfinished_requests():
        for output in engines[0].step():
            if output.finished:
                metrics[0].observe_finished(output, None)
    texts = [m.render().decode() for m in metrics]
    assert metric_value(texts[0], "kvstash_requests_total", finish_reason="length") == 1
    assert metric_value(texts[1], "kvstash_requests_total", finish_reason="length") == 0
    assert [metric_value(t, "kvstash_kv_blocks_total") for t in texts] == [32, 48]


def test_every_exposed_metric_is_in_the_docs_table(serving_model_dir, repo_root) -> None:
    """Issue #17: kvstash_tier_errors_total was exposed but missing from docs/serving.md."""
    from connector import OffloadConfig
    from engine import EngineArgs, EngineCore
    from engine.metrics import EngineMetrics

    engine = EngineCore(
        serving_model_dir, EngineArgs(num_gpu_blocks=32, kv_offload=OffloadConfig(cpu_bytes=1 << 24))
    )
    text = EngineMetrics(engine).render().decode()
    docs = (repo_root / "docs" / "serving.md").read_text()
    names = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # prometheus_client's own creation-time gauges
            continue
        suffix = "_total" if family.type == "counter" else ""
        names.add(family.name + suffix)
    assert "kvstash_tier_errors_total" in names
    missing = sorted(name for name in names if f"`{name}" not in docs and f"{name}`" not in docs)
    assert not missing, f"metrics missing from docs/serving.md: {missing}"
