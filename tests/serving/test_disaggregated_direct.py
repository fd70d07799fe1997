"""Disaggregated prefill/decode by the direct path, with real processes: a producer `kvstash
serve --kv-role producer --kv-transfer direct` and a consumer `--kv-role consumer --kv-transfer
direct` (no shared tier at all: NIXL's UCX backend moves the chunks from the producer's CPU
tier into the consumer's, over shared memory or TCP on this host), `kvstash proxy` in front.
The session's plain `kvstash serve` (`server`) is the reference: greedy tokens through the
proxy must equal its tokens. The last test kills the producer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serving.server_process import FrontProcess, ServeProcess, answer, metric_value
from tests.serving.test_disaggregated import AUTH, KEY, PROMPT_LEN, completion_body, metrics, prompt

pytest.importorskip("connector.nixl_import")
from connector.nixl_import import nixl_available  # noqa: E402

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install 'kvstash[nixl]')"
)

ROUTE = "/v1/completions"


class DirectStack:
    def __init__(self, producer: ServeProcess, consumer: ServeProcess, proxy: FrontProcess) -> None:
        self.producer, self.consumer, self.proxy = producer, consumer, proxy


@pytest.fixture(scope="module")
def direct(serving_model_dir) -> Iterator[DirectStack]:
    engine = ("--num-gpu-blocks", "256", "--max-num-seqs", "16", "--api-key", KEY)
    tier = ("--kv-offload", "--kv-offload-cpu-gb", "0.25", "--kv-transfer", "direct")
    producer = ServeProcess(serving_model_dir, "--kv-role", "producer", *tier, *engine)
    consumer = ServeProcess(serving_model_dir, "--kv-role", "consumer", *tier, *engine)
    with ThreadPoolExecutor(2) as pool:  # both load the model at once
        list(pool.map(ServeProcess.start, (producer, consumer)))
    proxy = FrontProcess(
        "proxy", "--prefill", producer.url, "--decode", consumer.url, "--api-key", KEY
    ).start()
    try:
        yield DirectStack(producer, consumer, proxy)
    finally:
        for process in (proxy, producer, consumer):
            process.close()


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    """Whether ``condition()`` became true within ``timeout_s`` (a bound, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def tier_hits(url: str, tier: str) -> float:
    return metric_value(metrics(url), "kvstash_tier_hit_chunks_total", tier=tier)


def test_answers_by_the_direct_path_equal_one_engine_s(direct, server):
    before = metrics(direct.consumer.url)
    for seed, (route, stream) in enumerate([(ROUTE, False), ("/v1/chat/completions", True)], start=50):
        body = completion_body(route, seed, stream)
        text, usage = answer(direct.proxy.url, route, body, AUTH)
        reference, reference_usage = answer(server.url, route, body, None)
        assert text == reference, (route, stream)
        assert usage["prompt_tokens"] == reference_usage["prompt_tokens"]
        # everything but the last prompt token came from the producer
        assert usage["kvstash"]["external_hit_tokens"] == usage["prompt_tokens"] - 1, (route, stream)
    after = metrics(direct.consumer.url)
    assert metric_value(after, "kvstash_pd_handoffs_total", path="direct") == 2 + metric_value(
        before, "kvstash_pd_handoffs_total", path="direct"
    )
    assert metric_value(after, "kvstash_tier_hit_chunks_total", tier="nixl") > metric_value(
        before, "kvstash_tier_hit_chunks_total", tier="nixl"
    )
    for reason in ("missing", "fetch", "timeout", "load", "short", "namespace"):
        assert metric_value(after, "kvstash_pd_fallbacks_total", reason=reason) == 0
    producer_metrics = metrics(direct.producer.url)
    assert metric_value(producer_metrics, "kvstash_pd_handoffs_total", path="direct") >= 2
    assert metric_value(producer_metrics, "kvstash_pd_handoffs_total", path="shared") == 0
    assert "by the direct path" in direct.consumer.log()
    # the consumer said it was done with each hand-over: the producer unpinned them (no expiry)
    assert wait_until(
        lambda: metric_value(metrics(direct.producer.url), "kvstash_pd_direct_held_offers") == 0
    )
    producer_metrics = metrics(direct.producer.url)
    assert metric_value(producer_metrics, "kvstash_pd_direct_released_offers_total", by="done") >= 2
    assert metric_value(producer_metrics, "kvstash_pd_direct_released_offers_total", by="expired") == 0


def test_a_prefix_the_consumer_holds_is_its_own_and_only_the_rest_comes_from_the_producer(direct, server):
    answer(direct.proxy.url, ROUTE, completion_body(ROUTE, 60, False), AUTH)
    longer = completion_body(ROUTE, 60, False) | {"prompt": prompt(60) + prompt(61)[:300]}
    num_before = tier_hits(direct.consumer.url, "nixl")
    text, usage = answer(direct.proxy.url, ROUTE, longer, AUTH)
    reference, _ = answer(server.url, ROUTE, longer, None)
    assert text == reference
    hits = usage["kvstash"]
    # the first prompt's full blocks are in the consumer's prefix cache (592 tokens); of the
    # producer's four chunks (256, 256, 256, 132 tokens) only the last two hold the rest
    assert hits["gpu_hit_tokens"] == PROMPT_LEN // 16 * 16
    assert hits["external_hit_tokens"] == PROMPT_LEN + 300 - 1 - hits["gpu_hit_tokens"]
    assert tier_hits(direct.consumer.url, "nixl") - num_before == 2


def streamed_hand_over(url: str, body: dict) -> dict:
    """The `kv_transfer_params` of a producer's streamed answer (in its final chunk)."""
    with httpx.stream("POST", url + ROUTE, json=body, headers=AUTH, timeout=300) as response:
        assert response.status_code == 200, response.read()
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    (final,) = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["finish_reason"]]
    assert all("kv_transfer_params" not in chunk for chunk in chunks if chunk is not final)
    return final["kv_transfer_params"]


def test_a_streamed_producer_answer_carries_the_hand_over_in_its_final_chunk(direct, server):
    body = completion_body(ROUTE, 70, True, 1)
    params = streamed_hand_over(direct.producer.url, body)
    assert params["tier"] == "nixl" and params["num_chunks"] == 3 and params["num_tokens"] == PROMPT_LEN
    assert [chunk[3] for chunk in params["direct"]["chunks"]] == [256, 256, PROMPT_LEN - 512]
    decode = completion_body(ROUTE, 70, False) | {"kv_transfer_params": params}
    text, usage = answer(direct.consumer.url, ROUTE, decode, AUTH)
    reference, _ = answer(server.url, ROUTE, completion_body(ROUTE, 70, False), None)
    assert text == reference
    assert usage["kvstash"]["external_hit_tokens"] == PROMPT_LEN - 1


def test_a_producer_killed_before_the_consumer_reads_leaves_it_to_recompute(direct, server):
    produced = httpx.post(
        direct.producer.url + ROUTE, json=completion_body(ROUTE, 80, False, 1), headers=AUTH, timeout=300
    )
    assert produced.status_code == 200, produced.text
    params = produced.json()["kv_transfer_params"]
    assert params["num_chunks"] == 3
    direct.producer.close()  # killed: its chunks and its agent are gone
    before = metrics(direct.consumer.url)
    decode = completion_body(ROUTE, 80, False) | {"kv_transfer_params": params}
    text, usage = answer(direct.consumer.url, ROUTE, decode, AUTH)
    reference, _ = answer(server.url, ROUTE, completion_body(ROUTE, 80, False), None)
    assert text == reference
    assert usage["kvstash"]["external_hit_tokens"] == 0
    after = metrics(direct.consumer.url)
    num_fallbacks = sum(
        metric_value(after, "kvstash_pd_fallbacks_total", reason=reason)
        - metric_value(before, "kvstash_pd_fallbacks_total", reason=reason)
        for reason in ("missing", "fetch", "timeout")
    )
    assert num_fallbacks == 1
    assert "P/D direct: reading transfer" in direct.consumer.log()
    # through the proxy too: no producer answers, the consumer computes
    body = completion_body(ROUTE, 81, False)
    text, _ = answer(direct.proxy.url, ROUTE, body, AUTH)
    assert text == answer(server.url, ROUTE, body, None)[0]
