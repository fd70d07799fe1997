"""The remote tier fails while the engine serves: the cache server is SIGKILLed and
restarted on the same port, Redis is stopped and restarted, and either remote
answers slower than the client's timeout (a real TCP delay proxy in between).

Each scenario runs one engine throughout (no restart) with only the remote tier
(``cpu_bytes=0``), so every hit comes from the remote. It checks: every request
completes with the reference's token ids; during the fault there are no hits and
the connector counts the failures; the failure is logged once per incident (one
"failing" warning, one "recovered" line, nothing per request); full hits come
back once the remote does.
"""

from __future__ import annotations

import logging
import signal
import time

import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.delay_proxy import DelayProxy
from connector import OffloadConfig
from tests.reliability.engine_stream import (
    CHUNK_SIZE,
    StreamTally,
    full_hits,
    incident_logs,
    make_prompts,
    new_llm,
    run_until_full_hits,
    tier_errors,
    tiers_of,
    warnings_other_than_incidents,
)

NUM_PROMPTS = 6
NUM_FAULT_ROUNDS = 2


def remote_config(url: str) -> OffloadConfig:
    return OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=0, staging_bytes=0, remote_url=url)


def outage_scenario(llm, tier_name, prompts, reference, caplog, inject, heal) -> dict:
    """Healthy round trip, ``inject()``, serve ``NUM_FAULT_ROUNDS`` rounds, ``heal()``,
    serve until full hits are back. Returns the scenario's figures (asserting as it goes)."""
    tally = StreamTally()
    tally.run(llm, prompts, reference)
    tiers_of(llm).flush()
    hits_before = tally.run(llm, prompts, reference)
    assert hits_before == full_hits(prompts), "the healthy remote should serve every stored chunk"
    caplog.clear()
    inject()
    num_requests_before = tally.num_requests
    started = time.monotonic()
    for _ in range(NUM_FAULT_ROUNDS):
        hits_during = tally.run(llm, prompts, reference)
        assert hits_during == [0] * len(prompts)
    tiers_of(llm).flush()
    fault_seconds = time.monotonic() - started
    num_fault_requests = tally.num_requests - num_requests_before
    num_errors = tier_errors(llm, tier_name)
    assert num_errors >= num_fault_requests, "every request's lookup failed and must be counted"
    assert incident_logs(caplog, tier_name) == (1, 0), "one warning per incident, not one per request"
    assert warnings_other_than_incidents(caplog) == []
    heal()
    healed_at = time.monotonic()
    num_rounds = run_until_full_hits(tally, llm, prompts, reference)
    resume_seconds = time.monotonic() - healed_at
    assert incident_logs(caplog, tier_name) == (1, 1)
    tally.assert_clean()
    return {
        "num_requests": tally.num_requests,
        "num_requests_during_fault": num_fault_requests,
        "num_failed": tally.num_failed,
        "num_tokens_compared": tally.num_tokens_compared,
        "num_tokens_differing": tally.num_tokens_differing,
        "tier_errors_counted": num_errors,
        "incident_warnings": 1,
        "recovery_lines": 1,
        "rounds_until_hits_resumed": num_rounds,
        "seconds_until_hits_resumed": round(resume_seconds, 2),
        "fault_seconds": round(fault_seconds, 2),
    }


def test_cache_server_sigkill_and_restart(model_dir, reference, reliability_report, caplog):
    server = CacheServerProcess("--memory-gb", "0.1").start()
    try:
        llm = new_llm(model_dir, remote_config(server.url + "?timeout=5"))
        with caplog.at_level(logging.INFO):
            figures = outage_scenario(
                llm,
                "grpc",
                make_prompts(NUM_PROMPTS, seed=11),
                reference,
                caplog,
                inject=lambda: server.stop(signal.SIGKILL),
                heal=server.start,  # same port: the engine's URL stays valid
            )
        reliability_report.record(
            "cache server killed", "SIGKILL of the cache server, restart on the same port (empty)", **figures
        )
    finally:
        server.close()


def test_redis_stopped_and_restarted(model_dir, reference, reliability_report, caplog, restartable_redis):
    llm = new_llm(model_dir, remote_config(restartable_redis.url + "?timeout=2"))
    with caplog.at_level(logging.INFO):
        figures = outage_scenario(
            llm,
            "redis",
            make_prompts(NUM_PROMPTS, seed=12),
            reference,
            caplog,
            inject=restartable_redis.stop,
            heal=restartable_redis.start,
        )
    reliability_report.record(
        "redis restarted", "redis-server stopped, started again on the same port (empty)", **figures
    )


@pytest.fixture
def cache_server_process():
    server = CacheServerProcess("--memory-gb", "0.1").start()
    yield server
    server.close()


@pytest.mark.parametrize("remote", ["redis", "grpc"])
def test_remote_slower_than_its_timeout(model_dir, reference, reliability_report, caplog, remote, request):
    timeout_s, delay_s = 0.25, 0.75
    if remote == "redis":
        server = request.getfixturevalue("redis_server")
        request.getfixturevalue("redis_url")  # flushed
        target_port = server.port
    else:
        target_port = request.getfixturevalue("cache_server_process").port
    with DelayProxy(target_port) as proxy:
        scheme_path = "redis://127.0.0.1:{}/0" if remote == "redis" else "grpc://127.0.0.1:{}"
        llm = new_llm(model_dir, remote_config(scheme_path.format(proxy.port) + f"?timeout={timeout_s}"))

        def heal() -> None:
            proxy.delay_s = 0.0

        with caplog.at_level(logging.INFO):
            figures = outage_scenario(
                llm,
                remote,
                make_prompts(NUM_PROMPTS, seed=13),
                reference,
                caplog,
                inject=lambda: setattr(proxy, "delay_s", delay_s),
                heal=heal,
            )
    name = "slow redis" if remote == "redis" else "slow cache server"
    reliability_report.record(
        name, f"TCP proxy adding {delay_s} s latency, client timeout {timeout_s} s, then no delay", **figures
    )
