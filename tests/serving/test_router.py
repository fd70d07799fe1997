"""`kvstash router` in front of two real `kvstash serve` replicas, each publishing its KV
events on loopback ports and holding a small CPU tier (issue 33, item 2). The session's
plain `kvstash serve` (`server`) is the reference: greedy answers through the router must
equal its answers. A second turn must go to the replica that holds its first turn (read
from that replica's own prefix-cache hits and from the router's log line), a tenant's
prefix must never count for another tenant, and a killed replica must cost no request.
The ranking itself (`choice`) is checked without processes first."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from benchmarks.support.serving_stack import free_ports
from engine.server.router.choice import MAX_IMBALANCE, Candidate, choose
from engine.server.router.costs import costs_from_metrics
from engine.server.router.index import ReplicaIndex
from engine.server.router.matching import PrefixMatch, PromptHashes, SharedTiers, match_prefix
from engine.server.upstream.pool import Engine
from kv_events.follower import EngineKV
from tests.serving.server_process import FrontProcess, ServeProcess, answer, metric_value

KEY = "router-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: the replicas' block size (the engine's default) and chunk size (the offload default)
BLOCK_SIZE, CHUNK_SIZE = 16, 256


def tokens(seed: int, length: int) -> list[int]:
    return [(31 * i + 17 * seed + 5) % 470 + 20 for i in range(length)]


# ---- the ranking, without processes ---------------------------------------------------


def test_the_replica_holding_the_prefix_wins_until_its_queue_costs_more():
    a, b = Engine("http://a", "replica"), Engine("http://b", "replica")
    held = PrefixMatch(gpu=1024)
    decision = choose([Candidate(a, PrefixMatch()), Candidate(b, held)], 1100)
    assert decision.order == [b, a] and decision.reason == "prefix"
    assert decision.tokens_at(b) == 76 and decision.tokens_at(a) == 1100
    b.num_in_flight, b.queued_tokens = 1, 2000.0  # a long prompt computing there
    assert choose([Candidate(a, PrefixMatch()), Candidate(b, held)], 1100).order[0] is a
    # a CPU-tier hit saves less than a GPU one, but more than nothing
    decision = choose([Candidate(a, PrefixMatch(cpu=512)), Candidate(b, PrefixMatch(disk=512))], 600)
    assert decision.order[0] is a and decision.tokens_at(b) > decision.tokens_at(a) > 88


def test_no_replica_takes_more_than_the_bound_of_requests_in_flight():
    engines = [Engine(f"http://{name}", "replica") for name in "abc"]
    engines[0].num_in_flight = 4  # it holds every prompt, but has 4 in flight against 0 and 1
    engines[2].num_in_flight = 1
    candidates = [Candidate(engines[0], PrefixMatch(gpu=100_000))] + [
        Candidate(e, PrefixMatch()) for e in engines[1:]
    ]
    decision = choose(candidates, 100_010)
    assert engines[0].num_in_flight + 1 > MAX_IMBALANCE * (5 + 1) / 3 + 1
    assert decision.order[0] is engines[1] and decision.reason == "imbalance"
    assert decision.order[-1] is engines[0]  # still tried last when the others fail


def test_a_tenant_s_prefix_matches_only_that_tenant():
    prompt = tokens(0, 600)
    head = "kvstash-0123456789abcdef:"
    holder = EngineKV(block_size=BLOCK_SIZE, chunk_size=CHUNK_SIZE)
    salted = PromptHashes(prompt, "tenant-a")
    holder.medium_to_keys = {
        "gpu": set(salted.block_hashes(BLOCK_SIZE)),
        "cpu": {key for _, _, key in salted.chunk_spans(head, CHUNK_SIZE)},
    }
    heads = {"cpu": head}
    shared = SharedTiers([holder], [heads])
    assert match_prefix(salted, holder, heads, shared, CHUNK_SIZE) == PrefixMatch(gpu=592, cpu=8)
    for other in ("tenant-b", None):
        assert match_prefix(PromptHashes(prompt, other), holder, heads, shared, CHUNK_SIZE) == PrefixMatch()
    # a shared tier's chunks count for every replica of the namespace, and only for the tenant
    writer = EngineKV(block_size=BLOCK_SIZE, chunk_size=CHUNK_SIZE)
    writer.medium_to_keys = {"redis": holder.medium_to_keys["cpu"]}
    shared = SharedTiers([writer], [{"redis": head}])
    empty = EngineKV(block_size=BLOCK_SIZE, chunk_size=CHUNK_SIZE)
    assert match_prefix(salted, empty, {}, shared, CHUNK_SIZE) == PrefixMatch(shared=600)
    assert match_prefix(PromptHashes(prompt, "tenant-b"), empty, {}, shared, CHUNK_SIZE) == PrefixMatch()


def test_the_index_of_a_real_engine_names_its_blocks_and_chunks_as_the_router_hashes(tiny_model_dir):
    """A real engine's events, followed by a `ReplicaIndex` thread: the router's hashes of
    a prompt find its GPU blocks, then (once the prefix cache is reset) its CPU chunks under
    the key head learned from the events; another salt finds nothing."""
    from connector import OffloadConfig
    from engine import LLM, SamplingParams

    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_offload=OffloadConfig(chunk_size=32, cpu_bytes=8 << 20),
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    publisher = llm.engine.kv_events
    index = ReplicaIndex("http://replica", publisher.endpoint, publisher.replay_endpoint)
    index.start()

    def matched(salt: str | None) -> PrefixMatch:
        state, heads = index.state, index.key_heads
        return match_prefix(PromptHashes(prompt, salt), state, heads, SharedTiers([state], [heads]), 0)

    def until(expected: PrefixMatch) -> None:
        deadline = time.monotonic() + 15
        while matched("t") != expected:
            assert time.monotonic() < deadline, (matched("t"), index.state)
            time.sleep(0.02)

    try:
        prompt = tokens(6, 100)
        llm.generate(
            [{"prompt_token_ids": prompt, "cache_salt": "t"}], SamplingParams(max_tokens=1, temperature=0)
        )
        llm.flush_kv_offload()
        until(PrefixMatch(gpu=96, cpu=4))  # 6 full blocks, then the partial chunk's 4 tokens
        assert llm.reset_prefix_cache()
        until(PrefixMatch(cpu=100))  # 3 full chunks of 32 and the partial one
        assert matched("u") == matched(None) == PrefixMatch()
        index.drop()
        assert index.state is None
        until(PrefixMatch(cpu=100))  # a snapshot after the drop
    finally:
        index.close()
        llm.engine.shutdown()


# ---- two replicas and the router -------------------------------------------------------


@dataclass
class Cluster:
    replicas: list[ServeProcess]
    router: FrontProcess

    def holder_of(self, before: list[float]) -> ServeProcess:
        """The replica whose finished requests grew since ``before`` (one did)."""
        after = self.finished()
        grown = [r for r, old, new in zip(self.replicas, before, after, strict=True) if new > old]
        assert len(grown) == 1, (before, after)
        return grown[0]

    def finished(self) -> list[float]:
        return [finished_requests(replica) for replica in self.replicas]


def metrics(url: str) -> str:
    response = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def finished_requests(replica: ServeProcess) -> float:
    text = metrics(replica.url)
    return sum(metric_value(text, "kvstash_requests_total", finish_reason=r) for r in ("stop", "length"))


@pytest.fixture(scope="module")
def cluster(serving_model_dir) -> Iterator[Cluster]:
    """Two replicas and the router, all three started at once (the router learns of the
    replicas' ports before they listen: until they do, its index threads keep asking)."""
    replicas, urls, events, ports = [], [], [], iter(free_ports(6))
    for name in ("a", "b"):
        port = next(ports)
        endpoints = (f"tcp://127.0.0.1:{next(ports)}", f"tcp://127.0.0.1:{next(ports)}")
        flags = ("--port", str(port), "--num-gpu-blocks", "256", "--max-num-seqs", "16", "--api-key", KEY)
        flags += ("--kv-offload", "--kv-offload-cpu-gb", "0.05", "--engine-id", f"replica-{name}")
        flags += ("--kv-events-endpoint", endpoints[0], "--kv-events-replay-endpoint", endpoints[1])
        replicas.append(ServeProcess(serving_model_dir, *flags))
        urls += ["--replica", f"http://127.0.0.1:{port}"]
        events += ["--replica-events", ",".join(endpoints)]
    tokenizer = ("--tokenizer", str(serving_model_dir))
    router = FrontProcess(
        "router",
        *urls,
        *events,
        *tokenizer,
        "--api-key",
        KEY,
        "--retry-after-s",
        "60",
        "--costs-interval-s",
        "0.5",
    )
    try:
        with ThreadPoolExecutor(3) as starting:
            list(starting.map(lambda process: process.start(), [*replicas, router]))
    except BaseException:
        for process in (router, *replicas):
            process.close()
        raise
    try:
        yield Cluster(replicas, router)
    finally:
        for process in (router, *replicas):
            process.close()


def completion(prompt: list[int], *, salt: str | None = None, stream: bool = False) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body["stream"] = stream
    if salt is not None:
        body["cache_salt"] = salt
    return body


def ask(cluster: Cluster, route: str, body: dict, request_id: str) -> tuple[str, dict]:
    return answer(cluster.router.url, route, body, AUTH | {"x-request-id": request_id})


def route_line(cluster: Cluster, request_id: str) -> str:
    lines = [line for line in cluster.router.log().splitlines() if f"route {request_id} -> " in line]
    assert len(lines) >= 1, cluster.router.log()
    return lines[0]


def indexed_blocks(cluster: Cluster) -> list[float]:
    """GPU blocks the router's index holds per replica."""
    text = metrics(cluster.router.url)
    return [
        metric_value(text, "kvstash_router_index_keys", url=r.url, medium="gpu") for r in cluster.replicas
    ]


def wait_indexed(cluster: Cluster, before: list[float], blocks: int, timeout_s: float = 15.0) -> None:
    """Wait until the router's index of some replica holds ``blocks`` more GPU blocks than
    ``before`` (the blocks of a request it just answered: its events travel on their own)."""
    deadline = time.monotonic() + timeout_s
    while not any(new >= old + blocks for old, new in zip(before, indexed_blocks(cluster), strict=True)):
        assert time.monotonic() < deadline, metrics(cluster.router.url)
        time.sleep(0.05)


def test_a_second_turn_goes_to_the_replica_holding_its_first(cluster, server):
    first = {seed: tokens(seed, 300) for seed in (1, 2)}
    holders = {}
    for seed, prompt in first.items():
        before, blocks = cluster.finished(), indexed_blocks(cluster)
        text, _ = ask(cluster, "/v1/completions", completion(prompt), f"first-{seed}")
        assert text == answer(server.url, "/v1/completions", completion(prompt))[0]
        holders[seed] = cluster.holder_of(before)
        wait_indexed(cluster, blocks, 300 // BLOCK_SIZE)
    for seed, prompt in first.items():
        holder = holders[seed]
        hits = metric_value(metrics(holder.url), "kvstash_gpu_prefix_hit_tokens_total")
        second = prompt + tokens(seed + 10, 80)
        body = completion(second, stream=seed == 2)
        text, usage = ask(cluster, "/v1/completions", body, f"second-{seed}")
        assert text == answer(server.url, "/v1/completions", completion(second))[0]
        line = route_line(cluster, f"second-{seed}")
        assert f"-> {holder.url} (" in line and "matched gpu=288 " in line, line
        assert metric_value(metrics(holder.url), "kvstash_gpu_prefix_hit_tokens_total") - hits == 288
        if usage is not None:
            assert usage["prompt_tokens_details"]["cached_tokens"] == 288
    router_metrics = metrics(cluster.router.url)
    for holder in holders.values():
        assert (
            metric_value(router_metrics, "kvstash_router_matched_tokens_total", url=holder.url, tier="gpu")
            >= 288
        )
    # a chat's next turn too, streamed, through the chat template the replicas apply
    turn = [{"role": "user", "content": " ".join(f"w{t}" for t in tokens(3, 120))}]
    chat = {
        "model": "tiny",
        "messages": turn,
        "max_completion_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    before, blocks = cluster.finished(), indexed_blocks(cluster)
    reply, _ = ask(cluster, "/v1/chat/completions", chat | {"stream": True}, "chat-1")
    assert reply == answer(server.url, "/v1/chat/completions", chat | {"stream": False})[0]
    holder = cluster.holder_of(before)
    wait_indexed(cluster, blocks, 8)
    chat["messages"] = turn + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and then?"},
    ]
    reply, _ = ask(cluster, "/v1/chat/completions", chat | {"stream": True}, "chat-2")
    assert reply == answer(server.url, "/v1/chat/completions", chat | {"stream": False})[0]
    line = route_line(cluster, "chat-2")
    assert f"-> {holder.url} (prefix)" in line and "matched gpu=0 " not in line, line


def test_a_tenant_s_prefix_counts_for_no_other_tenant(cluster):
    prompt = tokens(4, 300)
    before, blocks = cluster.finished(), indexed_blocks(cluster)
    ask(cluster, "/v1/completions", completion(prompt, salt="tenant-a"), "tenant-a-1")
    holder = cluster.holder_of(before)
    wait_indexed(cluster, blocks, 300 // BLOCK_SIZE)
    for salt, request_id in (("tenant-b", "tenant-b-1"), (None, "unsalted-1")):
        _, usage = ask(cluster, "/v1/completions", completion(prompt, salt=salt), request_id)
        assert "matched gpu=0 cpu=0 disk=0 shared=0" in route_line(cluster, request_id)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # wherever it went
    _, usage = ask(cluster, "/v1/completions", completion(prompt + [21, 22], salt="tenant-a"), "tenant-a-2")
    line = route_line(cluster, "tenant-a-2")
    assert f"-> {holder.url} (prefix)" in line and "matched gpu=288 " in line, line
    assert usage["prompt_tokens_details"]["cached_tokens"] == 288


def test_the_router_asks_for_its_key_and_answers_models_and_health(cluster):
    no_key = httpx.post(f"{cluster.router.url}/v1/completions", json=completion([5, 6, 7]), timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{cluster.router.url}/metrics", timeout=30).status_code == 401
    models = httpx.get(f"{cluster.router.url}/v1/models", headers=AUTH, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    health = httpx.get(f"{cluster.router.url}/health", timeout=30)  # no key needed
    assert health.status_code == 200
    assert [(e["up"], e["index"]) for e in health.json()["replicas"]] == [(True, "synced")] * 2
    bad = httpx.post(f"{cluster.router.url}/v1/completions", headers=AUTH, content=b"[1]", timeout=30)
    assert bad.status_code == 400  # no JSON object: answered by the router itself
    headers = AUTH | {"x-request-id": "no-prompt"}
    refused = httpx.post(
        f"{cluster.router.url}/v1/completions", headers=headers, json={"model": "tiny"}, timeout=30
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"  # the replica's answer
    assert "(untokenized): prompt ? tokens" in route_line(cluster, "no-prompt")


def test_the_router_prices_tiers_with_each_replica_s_measured_rates(cluster):
    """A replica that loaded from its CPU tier measured that tier's rate: the router reads it
    from the replica's /metrics and prices a CPU-tier token with it, the other tiers (and a
    replica that measured nothing) at the default ratios."""
    replica = cluster.replicas[0]
    prompt = tokens(7, 300)
    answer(replica.url, "/v1/completions", completion(prompt), AUTH)
    for seed in range(8, 13):  # push the prompt out of the replica's 256-block GPU prefix cache
        answer(replica.url, "/v1/completions", completion(tokens(seed, 1000)), AUTH)
    answer(replica.url, "/v1/completions", completion(prompt), AUTH)
    costs = costs_from_metrics(metrics(replica.url))
    assert costs is not None and "cpu" in costs.tier_to_bytes_per_s, "the replica loaded from its CPU tier"
    expected = costs.tier_cost(8192)
    deadline = time.monotonic() + 15
    while True:
        text = metrics(cluster.router.url)
        measured = metric_value(
            text, "kvstash_router_tier_cost", url=replica.url, tier="cpu", source="measured"
        )
        if measured > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert measured == pytest.approx(expected["cpu"], rel=1e-3) and 0 < measured <= 1
    assert (
        metric_value(text, "kvstash_router_tier_cost", url=replica.url, tier="disk", source="default") == 0.3
    )


def test_a_killed_replica_costs_no_request(cluster, server):
    """Last in this module: it kills a replica while a request runs there (the router sent
    it there: it held the prompt's prefix). Nothing of the answer had come, so the router
    sends it to the other replica, and the requests after go there too: every one is answered
    with the single engine's tokens."""
    prompt = tokens(5, 300)
    before, blocks = cluster.finished(), indexed_blocks(cluster)
    ask(cluster, "/v1/completions", completion(prompt), "before-kill")
    holder = cluster.holder_of(before)
    survivor = next(r for r in cluster.replicas if r is not holder)
    wait_indexed(cluster, blocks, 300 // BLOCK_SIZE)
    long_answer = completion(prompt + [29]) | {"max_tokens": 800}
    with ThreadPoolExecutor(1) as running:
        in_flight = running.submit(ask, cluster, "/v1/completions", long_answer, "killed-mid-run")
        deadline = time.monotonic() + 30
        while (
            metric_value(metrics(holder.url), "kvstash_generation_tokens_total") < 50 and not in_flight.done()
        ):
            assert time.monotonic() < deadline, cluster.router.log()
            time.sleep(0.02)
        holder.process.kill()
        holder.process.wait()
        text, usage = in_flight.result()
    assert usage["completion_tokens"] == 800
    assert text == answer(server.url, "/v1/completions", long_answer)[0]
    for number, stream in enumerate((True, False)):
        body = completion(prompt + [30 + number], stream=stream)
        text, _ = ask(cluster, "/v1/completions", body, f"after-kill-{number}")
        assert text == answer(server.url, "/v1/completions", completion(prompt + [30 + number]))[0]
    log = cluster.router.log()
    assert f"route killed-mid-run -> {holder.url} (prefix)" in log
    assert f"route killed-mid-run -> {survivor.url} (retry)" in log
    assert f"route after-kill-0 -> {survivor.url} (load)" in log  # the dead one is out
    router_metrics = metrics(cluster.router.url)
    assert (
        metric_value(router_metrics, "kvstash_router_engine_failures_total", role="replica", url=holder.url)
        == 1
    )
    assert metric_value(router_metrics, "kvstash_router_engine_up", role="replica", url=holder.url) == 0
    assert metric_value(router_metrics, "kvstash_router_index_synced", url=holder.url) == 0  # dropped
    assert metric_value(router_metrics, "kvstash_router_index_synced", url=survivor.url) == 1
    assert (
        metric_value(router_metrics, "kvstash_router_requests_total", route="/v1/completions", status="200")
        >= 4
    )
    assert (
        metric_value(router_metrics, "kvstash_router_engine_in_flight", role="replica", url=holder.url) == 0
    )
    health = httpx.get(f"{cluster.router.url}/health", timeout=30)
    assert health.status_code == 200, health.text
    assert [entry["up"] for entry in health.json()["replicas"]] == [r is survivor for r in cluster.replicas]
