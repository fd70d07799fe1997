"""Disaggregated prefill/decode with real processes: a producer `kvstash serve --kv-role
producer` and a consumer `--kv-role consumer` over one real Redis, and `kvstash proxy` in
front of them (a second `--prefill` URL where nothing listens). The session's plain
`kvstash serve` (`server`, no offload: one engine of role both) is the reference: greedy
tokens through the proxy must equal its tokens, and the consumer must have loaded the
prompt from Redis rather than computing it."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
import redis

from benchmarks.support.delay_proxy import DelayProxy
from tests.serving.server_process import FrontProcess, ServeProcess, answer, metric_value

#: the engines' and the proxy's API key (the proxy passes it on to the engines)
KEY = "pd-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: two full 256-token chunks and a partial one; each test uses prompts of its own
PROMPT_LEN = 600


def prompt(seed: int) -> list[int]:
    return [(37 * i + 11 * seed + 3) % 480 + 10 for i in range(PROMPT_LEN)]


class Stack:
    def __init__(self, producer: ServeProcess, consumer: ServeProcess, proxy: FrontProcess, redis_url: str):
        self.producer, self.consumer, self.proxy, self.redis_url = producer, consumer, proxy, redis_url
        self.dead_url = ""


@pytest.fixture(scope="module")
def stack(redis_server, serving_model_dir) -> Iterator[Stack]:
    redis_server.flushall()
    # The consumer reads Redis through a slow link: its planner, measuring it, would recompute
    # these prompts rather than fetch them (a tiny model computes 600 tokens in ~40 ms, the link
    # brings a 128 KiB chunk in ~130 ms), so only the hand-over makes it load them.
    slow_link = DelayProxy(redis_server.port, delay_s=0.02, rate_bytes_per_s=1e6).start()
    engine = ("--num-gpu-blocks", "256", "--max-num-seqs", "16", "--api-key", KEY, "--kv-offload")
    engine += ("--kv-transfer", "shared")  # the direct path: test_disaggregated_direct.py
    producer_tier = ("--kv-offload-remote", redis_server.url, "--kv-offload-cpu-gb", "0.25")
    consumer_tier = (
        "--kv-offload-remote",
        f"redis://127.0.0.1:{slow_link.port}",
        "--kv-offload-cpu-gb",
        "0.25",
    )
    producer = ServeProcess(serving_model_dir, "--kv-role", "producer", *producer_tier, *engine).start()
    consumer = ServeProcess(serving_model_dir, "--kv-role", "consumer", *consumer_tier, *engine).start()
    dead_url = url_nobody_listens_on()
    prefill = ("--prefill", dead_url, "--prefill", producer.url)
    proxy = FrontProcess(
        "proxy", *prefill, "--decode", consumer.url, "--api-key", KEY, "--retry-after-s", "60"
    ).start()
    try:
        deployed = Stack(producer, consumer, proxy, redis_server.url)
        deployed.dead_url = dead_url
        yield deployed
    finally:
        for process in (proxy, producer, consumer, slow_link):
            process.close()


def url_nobody_listens_on() -> str:
    """A loopback URL whose port was free a moment ago (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def completion_body(route: str, seed: int, stream: bool, max_tokens: int = 8) -> dict:
    body: dict = {"model": "tiny", "temperature": 0, "ignore_eos": True, "stream": stream}
    if route == "/v1/completions":
        body |= {"prompt": prompt(seed), "max_tokens": max_tokens}
    else:
        text = " ".join(f"w{t}" for t in prompt(seed)[:150])
        body |= {"messages": [{"role": "user", "content": text}], "max_completion_tokens": max_tokens}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def metrics(url: str) -> str:
    response = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def ask(url: str, route: str, body: dict, headers: dict | None = AUTH) -> tuple[str, dict]:
    return answer(url, route, body, headers)


ROUTES = ("/v1/completions", "/v1/chat/completions")


def test_answers_through_the_proxy_equal_one_engine_s_and_the_consumer_loads_the_prompt(stack, server):
    before = metrics(stack.consumer.url)
    for seed, (route, stream) in enumerate([(r, s) for r in ROUTES for s in (False, True)]):
        body = completion_body(route, seed, stream)
        text, usage = ask(stack.proxy.url, route, body)
        reference, reference_usage = ask(server.url, route, body, None)
        assert text == reference, (route, stream)
        assert usage["prompt_tokens"] == reference_usage["prompt_tokens"]
        assert usage["completion_tokens"] == 8
        # everything but the last prompt token came from Redis (its logits give the first token)
        assert usage["kvstash"]["external_hit_tokens"] == usage["prompt_tokens"] - 1, (route, stream)
    after = metrics(stack.consumer.url)
    assert metric_value(after, "kvstash_tier_hit_chunks_total", tier="redis") > metric_value(
        before, "kvstash_tier_hit_chunks_total", tier="redis"
    )
    for reason in ("missing", "fetch", "timeout", "load", "short", "namespace"):
        assert metric_value(after, "kvstash_pd_fallbacks_total", reason=reason) == 0
    producer_metrics = metrics(stack.producer.url)
    assert metric_value(producer_metrics, "kvstash_pd_handed_over_tokens_total") > 0
    proxy_metrics = metrics(stack.proxy.url)
    assert metric_value(proxy_metrics, "kvstash_proxy_prefill_skipped_total") == 0
    # clients of the proxy need its key too
    refused = httpx.post(stack.proxy.url + ROUTES[0], json=completion_body(ROUTES[0], 0, False), timeout=30)
    assert refused.status_code == 401
    # the prefill URL where nothing listens was tried and taken out
    dead = metric_value(
        proxy_metrics, "kvstash_proxy_engine_failures_total", role="prefill", url=stack.dead_url
    )
    assert dead >= 1


def test_a_prefix_the_consumer_holds_is_loaded_from_its_gpu_and_only_the_rest_from_redis(stack, server):
    route = "/v1/completions"
    first = completion_body(route, 40, False)
    ask(stack.proxy.url, route, first)
    longer = first | {"prompt": prompt(40) + prompt(41)[:300]}
    text, usage = ask(stack.proxy.url, route, longer)
    reference, _ = ask(server.url, route, longer, None)
    assert text == reference
    hits = usage["kvstash"]
    # the first prompt's full blocks are in the consumer's prefix cache; the producer's chunks
    # bring the rest but the last token
    assert hits["gpu_hit_tokens"] == PROMPT_LEN // 16 * 16
    assert hits["external_hit_tokens"] == PROMPT_LEN + 300 - 1 - hits["gpu_hit_tokens"]


def stored_chunk_keys(redis_url: str, params: dict, token_ids: list[int]) -> list[bytes]:
    """The Redis keys of a prompt's chunks, first to last, named as the producer's answer says
    (its namespace; the Redis tier puts a prefix of its own in front)."""
    from connector.token_db import TokenDatabase

    spans = TokenDatabase(params["namespace"], params["chunk_size"], True).chunk_spans(token_ids)
    client = redis.Redis.from_url(redis_url)
    try:
        stored = list(client.scan_iter())
    finally:
        client.close()
    keys = []
    for span in spans:
        (key,) = [key for key in stored if key.endswith(span.key.encode())]
        keys.append(key)
    return keys


@pytest.mark.parametrize(("damage", "reason"), [("delete", "missing"), ("corrupt", "fetch")])
def test_a_chunk_lost_between_producer_and_consumer_is_recomputed(stack, server, damage, reason):
    route = "/v1/completions"
    seed = 10 if damage == "delete" else 11
    produced = httpx.post(
        stack.producer.url + route, json=completion_body(route, seed, False, 1), headers=AUTH, timeout=300
    )
    assert produced.status_code == 200, produced.text
    params = produced.json()["kv_transfer_params"]
    assert params["num_chunks"] == 3 and params["num_tokens"] == PROMPT_LEN
    keys = stored_chunk_keys(stack.redis_url, params, prompt(seed))
    assert len(keys) == 3
    client = redis.Redis.from_url(stack.redis_url)
    try:
        if damage == "delete":
            client.delete(keys[1])  # the consumer finds the first chunk only
        else:
            for key in keys:
                value = bytearray(client.get(key))
                value[-1] ^= 0xFF  # the payload's last byte: its CRC no longer matches
                client.set(key, bytes(value))
    finally:
        client.close()
    before = metrics(stack.consumer.url)
    body = completion_body(route, seed, False) | {"kv_transfer_params": params}
    text, usage = ask(stack.consumer.url, route, body)
    reference, _ = ask(server.url, route, completion_body(route, seed, False), None)
    assert text == reference
    # the chunks before the lost one were loaded, the rest recomputed
    assert usage["kvstash"]["external_hit_tokens"] == (256 if damage == "delete" else 0)
    after = metrics(stack.consumer.url)
    counted = metric_value(after, "kvstash_pd_fallbacks_total", reason=reason) - metric_value(
        before, "kvstash_pd_fallbacks_total", reason=reason
    )
    assert counted == 1
    assert "P/D: request" in stack.consumer.log() and f"({reason})" in stack.consumer.log()


def test_kv_transfer_params_are_checked_where_they_enter(stack):
    route = "/v1/completions"
    body = completion_body(route, 30, False)
    handed = {"kvstash_version": 1, "durable": True, "namespace": "n", "chunk_size": 256}
    handed |= {"num_chunks": 3, "num_tokens": PROMPT_LEN, "tier": "redis"}
    for bad, words in [
        ({"durable": True}, "kvstash_version"),
        (handed | {"num_tokens": 4 * 256}, "exceeds num_chunks * chunk_size"),
        (handed | {"num_chunks": -1}, "num_chunks must be an integer >= 0"),
    ]:
        response = httpx.post(
            stack.consumer.url + route, json=body | {"kv_transfer_params": bad}, headers=AUTH, timeout=30
        )
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    # a producer computes prompts: it takes no hand-over
    response = httpx.post(
        stack.producer.url + route, json=body | {"kv_transfer_params": handed}, headers=AUTH, timeout=30
    )
    assert response.status_code == 400 and "no producer" in response.json()["error"]["message"]
    # of another namespace: never looked for, recomputed and counted (the proxy would drop a
    # client's own kv_transfer_params; sent to the consumer directly they are taken as given)
    before = metric_value(metrics(stack.consumer.url), "kvstash_pd_fallbacks_total", reason="namespace")
    text, usage = ask(stack.consumer.url, route, body | {"kv_transfer_params": handed})
    assert usage["kvstash"]["external_hit_tokens"] == 0
    after = metric_value(metrics(stack.consumer.url), "kvstash_pd_fallbacks_total", reason="namespace")
    assert after == before + 1


def test_a_dead_producer_leaves_the_consumer_to_compute(stack, server):
    stack.producer.close()  # killed: every prefill URL of the proxy is dead now
    for seed, route in enumerate(ROUTES, start=20):
        for stream in (False, True):
            body = completion_body(route, seed, stream)
            text, usage = ask(stack.proxy.url, route, body)
            reference, _ = ask(server.url, route, body, None)
            assert text == reference
            if not stream:  # computed by the consumer (the streamed twin then hits its GPU prefix cache)
                assert usage["kvstash"]["external_hit_tokens"] == 0
    proxy_metrics = metrics(stack.proxy.url)
    assert metric_value(proxy_metrics, "kvstash_proxy_prefill_skipped_total") == 4
    health = httpx.get(f"{stack.proxy.url}/health", timeout=30)
    assert health.status_code == 200
    assert not any(engine["up"] for engine in health.json()["prefill"])


def test_the_cache_server_as_the_shared_tier_and_a_streamed_prefill(serving_model_dir, server):
    """grpc:// (a real `kvstash cache-server`) as the tier producer and consumer share; the
    producer's streamed answer carries the hand-over in its final chunk."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.support.cache_server_process import CacheServerProcess

    cache_server = CacheServerProcess("--memory-gb", "0.1").start()
    engine = ("--num-gpu-blocks", "256", "--max-num-seqs", "4", "--api-key", KEY, "--kv-offload")
    engine += (
        "--kv-offload-remote",
        cache_server.url,
        "--kv-offload-cpu-gb",
        "0.1",
        "--kv-transfer",
        "shared",
    )
    producer = ServeProcess(serving_model_dir, "--kv-role", "producer", *engine)
    consumer = ServeProcess(serving_model_dir, "--kv-role", "consumer", *engine)
    try:
        with ThreadPoolExecutor(2) as pool:  # both load the model at once
            list(pool.map(ServeProcess.start, (producer, consumer)))
        route = "/v1/completions"
        with httpx.stream(
            "POST", producer.url + route, json=completion_body(route, 90, True, 1), headers=AUTH, timeout=300
        ) as response:
            assert response.status_code == 200, response.read()
            events = [
                line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")
            ]
        assert events[-1] == "[DONE]"
        finals = [json.loads(e) for e in events[:-1] if '"finish_reason":"' in e]
        assert len(finals) == 1
        params = finals[0]["kv_transfer_params"]
        assert params["tier"] == "grpc" and params["num_chunks"] == 3 and "direct" not in params
        body = completion_body(route, 90, False) | {"kv_transfer_params": params}
        text, usage = ask(consumer.url, route, body)
        reference, _ = ask(server.url, route, completion_body(route, 90, False), None)
        assert text == reference
        assert usage["kvstash"]["external_hit_tokens"] == PROMPT_LEN - 1
        consumer_metrics = metrics(consumer.url)
        assert metric_value(consumer_metrics, "kvstash_tier_hit_chunks_total", tier="grpc") == 3
        assert metric_value(consumer_metrics, "kvstash_pd_handoffs_total", path="shared") == 1
    finally:
        for process in (producer, consumer, cache_server):
            process.close()
