"""The async front end in-process (no HTTP): admission errors, cumulative outputs,
abort when a consumer stops early, shutdown, and speculative decoding counters
reaching /metrics."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineArgs, EngineCore, SamplingParams
from engine.server.async_engine import AsyncEngine, EngineDeadError
from tests.serving.server_process import metric_value


@pytest.fixture
def async_engine(serving_model_dir):
    engine = AsyncEngine(EngineCore(serving_model_dir, EngineArgs(num_gpu_blocks=64)))
    engine.start()
    yield engine
    engine.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams):
    return [output async for output in engine.generate(request_id, prompt, params)]


def test_outputs_are_cumulative_and_rejections_queue_nothing(async_engine) -> None:
    async def scenario():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(async_engine, "bad", [1, 2, 10**6], greedy(4))
        # The rejected id was never queued, so it is free to use.
        return await collect(async_engine, "bad", [5, 6, 7, 8, 9], greedy(4))

    outputs = asyncio.run(scenario())
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4]
    assert [o.finished for o in outputs] == [False, False, False, True]
    assert outputs[-1].finish_reason == "length"
    assert all(o.token_ids == outputs[-1].token_ids[: len(o.token_ids)] for o in outputs)
    text = async_engine.metrics.render().decode()
    assert metric_value(text, "kvstash_requests_total", finish_reason="length") == 1
    assert metric_value(text, "kvstash_generation_tokens_total") == 4


def test_consumer_stopping_early_aborts_the_request(async_engine) -> None:
    async def scenario():
        stream = async_engine.generate("long", [5, 6, 7, 8], greedy(500))
        first = await anext(stream)
        await stream.aclose()
        # Another request still runs to completion afterwards.
        return first, await collect(async_engine, "next", [9, 10, 11], greedy(3))

    first, outputs = asyncio.run(scenario())
    assert not first.finished and outputs[-1].finished
    text = async_engine.metrics.render().decode()
    assert metric_value(text, "kvstash_requests_total", finish_reason="abort") == 1
    assert not async_engine.engine.requests  # nothing left behind in the engine


def test_shutdown_then_requests_fail_clearly(async_engine) -> None:
    async_engine.shutdown()
    assert not async_engine.is_running
    with pytest.raises(EngineDeadError, match="not running"):
        asyncio.run(collect(async_engine, "late", [5, 6], greedy(2)))


def test_speculative_decoding_counters_reach_metrics(serving_model_dir) -> None:
    args = EngineArgs(num_gpu_blocks=64, speculative="ngram", num_speculative_tokens=3, ngram_min_n=1)
    engine = AsyncEngine(EngineCore(serving_model_dir, args))
    engine.start()
    try:
        outputs = asyncio.run(collect(engine, "spec", [5, 6, 7, 8] * 6, greedy(40)))
    finally:
        engine.shutdown()
    assert len(outputs[-1].token_ids) == 40
    spec = engine.engine.stats.spec_decode
    assert spec.num_draft_tokens > 0
    text = engine.metrics.render().decode()
    assert metric_value(text, "kvstash_spec_decode_draft_tokens_total") == spec.num_draft_tokens
    assert metric_value(text, "kvstash_spec_decode_accepted_tokens_total") == spec.num_accepted_tokens
    assert metric_value(text, "kvstash_spec_decode_acceptance_ratio") == pytest.approx(spec.acceptance_rate)
