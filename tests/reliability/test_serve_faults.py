"""The engine server under a remote-tier outage: ``kvstash serve`` with offload to a real
cache server, streaming clients in flight, the cache server SIGKILLed and restarted.

Every streamed completion must succeed with the text of the offline no-offload
reference; /metrics counts the tier's errors; the server logs the incident once
(one "failing" and one "recovered" line); external hits come back after the
restart with no server restart.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx

from benchmarks.support.cache_server_process import CacheServerProcess
from tests.reliability.engine_stream import CHUNK_SIZE, PARAMS, RESUME_TIMEOUT_S, full_hits, make_prompts
from tests.serving.server_process import ServeProcess, metric_value

NUM_PROMPTS = 6


async def _stream_one(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[int, str]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": PARAMS.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    body["ignore_eos"] = True
    pieces = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, ""
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return 500, ""
                pieces.append(event["choices"][0]["text"])
    return 200, "".join(pieces)


def stream_all(url: str, prompts: list[list[int]]) -> list[tuple[int, str]]:
    """Stream every prompt at once; (status, text) per prompt."""

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(_stream_one(client, url, p) for p in prompts))

    return asyncio.run(run())


def external_hits(serve) -> float:
    return metric_value(serve.metrics_text(), "kvstash_external_hit_tokens_total")


def test_serve_survives_a_cache_server_kill(model_dir, reference, reliability_report):
    prompts = make_prompts(NUM_PROMPTS, seed=51)
    expected = [(200, output.text) for output in reference.outputs(prompts)]
    cache = CacheServerProcess("--memory-gb", "0.1").start()
    serve = None
    try:
        serve = ServeProcess(
            model_dir,
            *("--dtype", "float32", "--device", "cpu", "--no-enable-prefix-caching", "--max-num-seqs", "8"),
            *("--kv-offload", "--kv-offload-cpu-gb", "0", "--kv-offload-chunk-size", str(CHUNK_SIZE)),
            *("--kv-offload-remote", f"{cache.url}?timeout=5"),
            # lower-tier hits read inside the step (no staging area: it would keep the chunks it
            # fetched and serve them while the server is down): the scenario counts the
            # remote's own hits before the kill, none during it, and all of them after
            extra_env={"KVSTASH_KV_OFFLOAD_STAGING_BYTES": "0"},
        ).start()
        num_requests = 0

        def round_trip() -> float:
            """One round of every prompt; returns the external hit tokens it got."""
            nonlocal num_requests
            before = external_hits(serve)
            assert stream_all(serve.url, prompts) == expected
            num_requests += len(prompts)
            return external_hits(serve) - before

        def until_full_hits() -> int:
            deadline = time.monotonic() + RESUME_TIMEOUT_S
            num_rounds = 0
            while True:
                num_rounds += 1
                if round_trip() == sum(full_hits(prompts)):
                    return num_rounds
                if time.monotonic() > deadline:
                    raise AssertionError(f"external hits did not come back within {RESUME_TIMEOUT_S} s")
                time.sleep(0.25)  # write-through to the remote tier is asynchronous

        until_full_hits()
        cache.stop(signal.SIGKILL)
        fault_start = num_requests
        assert round_trip() == 0
        assert round_trip() == 0
        num_fault_requests = num_requests - fault_start
        tier_errors = metric_value(serve.metrics_text(), "kvstash_tier_errors_total", tier="grpc")
        assert tier_errors >= num_fault_requests
        cache.start()  # same port
        restarted_at = time.monotonic()
        num_rounds = until_full_hits()
        resume_seconds = time.monotonic() - restarted_at
        log = serve.log()
        assert log.count("tier grpc failing") == 1 and log.count("tier grpc recovered") == 1, log[-3000:]
        assert serve.process.poll() is None
    finally:
        if serve is not None:
            serve.close()
        cache.close()
    reliability_report.record(
        "engine server, cache server killed",
        "kvstash serve streaming with offload to a cache server that is SIGKILLed and restarted",
        num_requests=num_requests,
        num_requests_during_fault=num_fault_requests,
        num_failed=0,
        num_texts_differing=0,
        tier_errors_counted=int(tier_errors),
        incident_warnings=1,
        recovery_lines=1,
        rounds_until_hits_resumed=num_rounds,
        seconds_until_hits_resumed=round(resume_seconds, 2),
    )


def test_serve_survives_failing_engine_steps_with_offload_on(model_dir, reference, reliability_report):
    """Rounds of concurrent streaming completions with the CPU tier on; between rounds a
    request whose engine step raises (the model runner fails for its marked prompt, see
    `tests/serving/step_faults.py`), once plain and once streaming. Only the marked
    requests fail; every round's texts equal the reference and its prompts stay full hits."""
    from tests.serving.step_faults import FAULT_MESSAGE, POISON_PREFIX

    prompts = make_prompts(NUM_PROMPTS, seed=52)
    expected = [(200, output.text) for output in reference.outputs(prompts)]
    marked = [*POISON_PREFIX, *make_prompts(1, seed=53)[0]]
    serve = ServeProcess(
        model_dir,
        *("--dtype", "float32", "--device", "cpu", "--no-enable-prefix-caching", "--max-num-seqs", "8"),
        *("--kv-offload", "--kv-offload-cpu-gb", "0.05", "--kv-offload-chunk-size", str(CHUNK_SIZE)),
        cli_module="tests.serving.step_faults",
    ).start()
    try:
        baseline_used = metric_value(serve.metrics_text(), "kvstash_kv_blocks_used")
        num_requests = num_failed = 0
        round_hits = []
        for stream_marked in (False, True, None):
            before = external_hits(serve)
            assert stream_all(serve.url, prompts) == expected
            num_requests += len(prompts)
            round_hits.append(external_hits(serve) - before)
            if stream_marked is None:
                break
            if stream_marked:
                ((status, _),) = stream_all(serve.url, [marked])
            else:
                response = httpx.post(
                    f"{serve.url}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": marked,
                        "max_tokens": PARAMS.max_tokens,
                        "temperature": 0,
                    },
                    timeout=120,
                )
                status = response.status_code
                assert response.json()["error"]["type"] == "server_error"
                assert FAULT_MESSAGE not in response.text
            assert status == 500
            num_requests += 1
            num_failed += 1
            time.sleep(0.5)  # write-through of the round's saves is asynchronous
        assert round_hits[1:] == [sum(full_hits(prompts))] * 2
        metrics = serve.metrics_text()
        step_errors = metric_value(metrics, "kvstash_engine_step_errors_total")
        assert step_errors == 2
        assert metric_value(metrics, "kvstash_requests_total", finish_reason="error") == 2
        deadline = time.monotonic() + 10
        while metric_value(serve.metrics_text(), "kvstash_kv_blocks_used") != baseline_used:
            assert time.monotonic() < deadline, "KV blocks did not return to their baseline"
            time.sleep(0.2)
        log = serve.log()
        num_tracebacks = log.count("Traceback (most recent call last)")
        assert num_tracebacks == 2, log[-4000:]
        assert httpx.get(f"{serve.url}/health", timeout=30).status_code == 200
        assert serve.process.poll() is None
    finally:
        serve.close()
    reliability_report.record(
        "engine server, failing engine steps",
        "kvstash serve with the CPU tier; the model runner raises for a marked prompt (plain, then streaming)",
        num_requests=num_requests,
        num_failed=num_failed,
        num_failed_unmarked=0,
        num_texts_differing=0,
        step_errors_counted=int(step_errors),
        tracebacks_logged=num_tracebacks,
        external_hit_tokens_per_round=[int(h) for h in round_hits],
    )
