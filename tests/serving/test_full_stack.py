"""The docker-compose stack as local processes on loopback: `redis-server`,
`kvstash cache-server --redis-url ...` and `kvstash serve MODEL --kv-offload
--kv-offload-remote grpc://127.0.0.1:PORT` (the compose services' commands).

One request goes through the whole stack twice. Between the two, the engine
server and the cache server are both restarted, so the second request's KV can
only come from Redis, through the cache server, over gRPC, into the engine: an
external hit that must not change a single output token."""

from __future__ import annotations

import time

import httpx
import redis

from benchmarks.support.cache_server_process import CacheServerProcess
from tests.serving.server_process import ServeProcess, metric_value

#: 300 prompt tokens: one full 256-token chunk and a 44-token partial chunk
PROMPT_TOKEN_IDS = [(31 * i + 7) % 500 + 5 for i in range(300)]


def complete(server: ServeProcess) -> dict:
    body = {
        "model": "tiny",
        "prompt": PROMPT_TOKEN_IDS,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_keys(redis_url: str, timeout_s: float = 60.0) -> int:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while (num_keys := client.dbsize()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    client.close()
    return num_keys


# Every hit is loaded: this test checks the path through the stack, not the planner (which
# would recompute a tiny model's prompt rather than wait for a remote tier it has not measured).
LOAD_EVERY_HIT = {"KVSTASH_KV_OFFLOAD_LOAD_POLICY": "always"}


def test_request_through_the_whole_stack_hits_the_external_cache(redis_url, tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    cache_server = CacheServerProcess("--redis-url", redis_url, "--memory-gb", "0.1").start()
    engine_flags = ("--kv-offload", "--kv-offload-remote", cache_server.url, "--num-gpu-blocks", "128")
    try:
        first_server = ServeProcess(model_dir, *engine_flags, extra_env=LOAD_EVERY_HIT).start()
        try:
            first = complete(first_server)
        finally:
            first_server.stop()
        assert first["usage"]["kvstash"]["external_hit_tokens"] == 0
        # Both chunks were written through the cache server into Redis.
        assert wait_for_keys(redis_url) >= 2

        # A fresh cache server (empty memory tier, same port) over the same Redis.
        assert cache_server.stop() == 0
        cache_server.start()

        second_server = ServeProcess(model_dir, *engine_flags, extra_env=LOAD_EVERY_HIT).start()
        try:
            second = complete(second_server)
            metrics = second_server.metrics_text()
        finally:
            second_server.close()
    finally:
        cache_server.close()

    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    usage = second["usage"]
    # Everything but the last prompt token (its logits give the first output token).
    assert usage["kvstash"]["external_hit_tokens"] == len(PROMPT_TOKEN_IDS) - 1
    assert usage["kvstash"]["gpu_hit_tokens"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(PROMPT_TOKEN_IDS) - 1
    assert metric_value(metrics, "kvstash_external_hit_tokens_total") == len(PROMPT_TOKEN_IDS) - 1
    assert metric_value(metrics, "kvstash_kv_loaded_tokens_total") == len(PROMPT_TOKEN_IDS) - 1
    assert metric_value(metrics, "kvstash_kv_loaded_bytes_total") > 0
    assert metric_value(metrics, "kvstash_tier_hit_chunks_total", tier="grpc") == 2
    assert metric_value(metrics, "kvstash_kv_load_throughput_gb_per_second_count") == 1
