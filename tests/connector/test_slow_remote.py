"""A slow remote never stalls the engine, whatever the tier set-up (issue 31): a real
redis-server behind a real TCP proxy that throttles what Redis sends, with a CPU tier and
without one (fetched chunks then land in the staging area).

While one request decodes, a prompt whose KV sits only in Redis arrives. Its fetch runs
aside: the decode's longest gap stays within 150 ms of its gap while a fresh prompt of
that length is recomputed, and the hit's first token comes within 1.5x that recompute's
plus 100 ms (the fetch's deadline bounds the wait; what did not arrive is recomputed).
Once the proxy stops throttling, the tier is measured again in the background and the
next hit loads from Redis. Outputs equal an engine without offload throughout."""

from __future__ import annotations

import time

import pytest

from benchmarks.support.delay_proxy import DelayProxy
from connector import OffloadConfig
from engine import SamplingParams
from engine.step_time import StepTimeModel
from tests.connector.test_async_loads import PARAMS, make_prompt, new_llm, write_to

CHUNK_SIZE = 32
PROMPT_LEN = 1024
#: bytes/s the proxy passes per connection and direction while throttled: a 16 KiB chunk
#: takes 1.6 s, the 1,024-token hit (512 KiB over 8 connections) ~6.5 s
THROTTLED_BYTES_PER_S = 10_000
DECODE = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def first_token_while_decoding(engine, request_id: str, prompt: list[int]) -> tuple[float, float]:
    """Submit ``prompt`` while the "decode" request runs; step until its first token.
    Returns (its TTFT, the decode's longest gap between two tokens meanwhile), seconds."""
    engine.add_request(request_id, prompt, PARAMS)
    submitted = last_decode = time.perf_counter()
    longest_gap = 0.0
    while True:
        outputs = engine.step()
        now = time.perf_counter()
        if any(o.request_id == "decode" for o in outputs):
            longest_gap = max(longest_gap, now - last_decode)
            last_decode = now
        if any(o.request_id == request_id and o.token_ids for o in outputs):
            return now - submitted, max(longest_gap, now - last_decode)


def finish(engine, request_id: str):
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.05)


@pytest.mark.parametrize("cpu_bytes", [0, 64 << 20], ids=["no-cpu-tier", "cpu-tier"])
def test_a_slow_remote_stalls_nothing_and_is_used_again_once_fast(model_dir, redis_server, cpu_bytes):
    redis_server.flushall()
    hit, later_hit, *fresh = (make_prompt(PROMPT_LEN, seed) for seed in (71, 72, 73, 74))
    reference = new_llm(model_dir, None).generate([hit, later_hit], PARAMS)
    with DelayProxy(redis_server.port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}"
        write_to(
            model_dir,
            OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=32 << 20, remote_url=url),
            [hit, later_hit],
        )
        config = OffloadConfig(
            chunk_size=CHUNK_SIZE, cpu_bytes=cpu_bytes, remote_url=url, tier_probe_interval_s=0.5
        )
        llm = new_llm(model_dir, config)
        engine = llm.engine
        connector = engine.scheduler.connector
        planner = connector.planner
        prober = connector.prober
        assert engine.offload_cache_engine.tiers.cpu.staging is (cpu_bytes == 0)
        wait_until(lambda: prober.tier_to_num_probes.get("redis", 0) >= 1, 30, "the opening measurement")

        engine.add_request("decode", make_prompt(16, 9), DECODE)
        while not engine.step():
            pass
        # the recompute baseline: the worst of two fresh prompts of that length
        recompute_ttft, recompute_gap = 0.0, 0.0
        for index, prompt in enumerate(fresh):
            ttft, gap = first_token_while_decoding(engine, f"fresh-{index}", prompt)
            recompute_ttft, recompute_gap = max(recompute_ttft, ttft), max(recompute_gap, gap)
            finish(engine, f"fresh-{index}")

        proxy.rate_bytes_per_s = THROTTLED_BYTES_PER_S
        hit_ttft, hit_gap = first_token_while_decoding(engine, "hit", hit)
        output = finish(engine, "hit")
        assert output.token_ids == reference[0].token_ids
        assert hit_gap <= recompute_gap + 0.150, (hit_gap, recompute_gap)
        assert hit_ttft <= 1.5 * recompute_ttft + 0.100, (hit_ttft, recompute_ttft)

        # From here on recompute is taken to run at 1,000 tokens/s (the tiny model's real rate
        # on a busy 2-core machine may beat a loopback read): a tier that answers at more than
        # 0.5 MB/s beats it. Redis, measured at what the cut fetch got, does not; once the
        # proxy passes everything, a background measurement finds it fast again.
        planner.step_times = StepTimeModel.from_parameters(step_s=0.0, tokens_per_s=1_000.0)
        break_even = planner.bytes_per_token * 1_000.0
        assert prober.probe("redis")  # measured while throttled (as the background would)
        assert planner.tier_rate("redis", planner.reads_in_flight_for("redis")) < break_even, (
            planner.snapshot()
        )
        proxy.rate_bytes_per_s = None
        wait_until(
            lambda: planner.tier_rate("redis", planner.reads_in_flight_for("redis")) > break_even,
            30,
            f"redis measured fast again ({planner.snapshot()})",
        )
        engine.add_request("later", later_hit, PARAMS)
        output = finish(engine, "later")
        assert output.token_ids == reference[1].token_ids
        stats = connector.request_stats("later")
        assert output.metrics.tier_to_loaded_tokens.get("redis", 0) > 0, (stats, planner.snapshot())
        engine.abort_request("decode")
        llm.engine.runner.connector.close()


def test_a_probe_write_that_outlasts_close_leaves_no_value_behind(redis_server):
    """The prober's opening write to a slow remote can outlast ``close()`` (which waits 1 s
    for the prober's thread, so a dead tier cannot hang exit). The value must not stay in
    the shared tier: the thread deletes it once its write lands (a CI run found the probe
    key as a seventh key in a cache server's Redis)."""
    import redis
    import torch

    from connector.planner import LoadPlanner
    from connector.tier_probe import PROBE_KEY_SUFFIX, TierProber
    from connector.token_db import KV_LAYOUT
    from storage_backends import create_backend

    redis_server.flushall()
    chunk_shape = (2, 2, 32, 2, 16)  # 8 KiB of float32: ~2 s through the proxy below
    with DelayProxy(redis_server.port, rate_bytes_per_s=4_000) as proxy:
        tier = create_backend(f"redis://127.0.0.1:{proxy.port}")
        prober = TierProber(
            LoadPlanner(bytes_per_token=1024, step_times=StepTimeModel()),
            {"redis": tier},
            key=f"test-namespace:{PROBE_KEY_SUFFIX}",
            chunk_shape=chunk_shape,
            dtype=torch.float32,
            layout=KV_LAYOUT,
            connections=2,
            interval_s=60.0,
        )
        prober.start()
        time.sleep(0.2)  # the write is under way
        prober.close()
        assert prober._thread.is_alive()  # close returned while the write was in flight
        prober._thread.join(timeout=30)
        assert not prober._thread.is_alive()
        with redis.Redis(port=redis_server.port) as client:
            # this prober's key only (an engine of another test may still be measuring)
            left = list(client.scan_iter(f"*test-namespace:{PROBE_KEY_SUFFIX}"))
        assert left == []
        assert prober.tier_to_num_probes == {}  # closed before it measured anything
        tier.close()
