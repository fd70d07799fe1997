"""A failing engine step in-process (the async front end over a real `EngineCore` whose
forward pass raises for a marked request, see `step_faults.py`): exactly the requests of
that step fail, every other and every later request completes with `engine.LLM`'s tokens,
KV blocks and connector state return to their baseline, `/metrics` counts the step, the
log holds one traceback. A step of several requests that fails is retried in smaller
groups, so only the request that fails alone is ended; requests failing alone one after
another never stop the engine, steps failing whatever they run do (fail fast)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from engine import EngineArgs, EngineCore, OffloadConfig, SamplingParams
from engine.server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from tests.serving.server_process import MAX_NUM_SEQS, NUM_GPU_BLOCKS, metric_value
from tests.serving.step_faults import FAULT_MESSAGE, POISON_PREFIX, StepFault, is_poisoned

POISONED = [*POISON_PREFIX, 20, 21, 22]
UNRELATED = [[30, 31, 32, 33, 34], [40, 41, 42], [50, 51, 52, 53, 54, 55, 56], [60, 61]]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def outcome(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """The request's outputs, or the exception that ended it (with the outputs before it)."""
    outputs = []
    try:
        async for output in engine.generate(request_id, prompt, params):
            outputs.append(output)
    except RequestFailedError as error:
        return error, outputs
    return None, outputs


def run_all(engine: AsyncEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    async def scenario():
        results = await asyncio.gather(*(outcome(engine, rid, p, sp) for rid, (p, sp) in requests.items()))
        return dict(zip(requests, results, strict=True))

    return asyncio.run(scenario())


def reference_tokens(reference_llm, prompt: list[int], params: SamplingParams) -> list[int]:
    return reference_llm.generate([prompt], params)[0].token_ids


def wait_idle(engine_core: EngineCore, timeout_s: float = 30.0) -> None:
    """Until the engine thread has nothing left (finished requests' saves may still hold blocks)."""
    deadline = time.monotonic() + timeout_s
    while engine_core.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise AssertionError("the engine still has unfinished requests (something leaked)")
        time.sleep(0.05)


def step_error_records(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "engine.server.async_engine" and r.levelno >= logging.ERROR and r.exc_info
    ]


def make_engine(model_dir, **args) -> AsyncEngine:
    engine_args = EngineArgs(**{"num_gpu_blocks": NUM_GPU_BLOCKS, "max_num_seqs": MAX_NUM_SEQS, **args})
    return AsyncEngine(EngineCore(model_dir, engine_args))


@pytest.fixture
def started():
    engines = []

    def start(engine: AsyncEngine) -> AsyncEngine:
        engine.start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.shutdown()


def test_a_failing_step_fails_only_its_request_and_serving_goes_on(
    serving_model_dir, reference_llm, started, monkeypatch, caplog
) -> None:
    caplog.set_level(logging.INFO)
    # One seat: the poisoned request runs alone while the others wait, in flight.
    engine = make_engine(serving_model_dir, max_num_seqs=1)
    fault = StepFault(after_tokens=2).install(engine.engine, monkeypatch)
    started(engine)
    baseline_used = engine.engine.block_manager.num_blocks - engine.engine.block_manager.num_free_blocks
    requests = {"poisoned": (POISONED, greedy(8))}
    requests |= {f"unrelated-{i}": (prompt, greedy(6)) for i, prompt in enumerate(UNRELATED)}

    results = run_all(engine, requests)

    assert fault.failed_step_request_ids == [{"poisoned"}]
    error, outputs = results.pop("poisoned")
    assert isinstance(error, RequestFailedError)
    assert FAULT_MESSAGE not in str(error) and "server log" in str(error)
    assert [len(o.token_ids) for o in outputs] == [1, 2]  # streamed until its step failed
    for request_id, (error, outputs) in results.items():
        assert error is None, request_id
        prompt, params = requests[request_id]
        assert outputs[-1].token_ids == reference_tokens(reference_llm, prompt, params), request_id
    # Later requests are served as usual.
    later = run_all(engine, {"later": (UNRELATED[0], greedy(5))})["later"]
    assert later[0] is None
    assert later[1][-1].token_ids == reference_tokens(reference_llm, UNRELATED[0], greedy(5))
    assert engine.is_running

    wait_idle(engine.engine)
    block_manager = engine.engine.block_manager
    assert block_manager.num_blocks - block_manager.num_free_blocks == baseline_used
    assert not engine.engine.requests
    text = engine.metrics.render().decode()
    assert metric_value(text, "kvstash_engine_step_errors_total") == 1
    assert metric_value(text, "kvstash_requests_total", finish_reason="error") == 1
    assert metric_value(text, "kvstash_requests_total", finish_reason="length") == len(UNRELATED) + 1
    assert metric_value(text, "kvstash_kv_blocks_used") == baseline_used
    records = step_error_records(caplog)
    assert len(records) == 1
    assert str(records[0].exc_info[1]) == FAULT_MESSAGE
    assert "poisoned" in records[0].getMessage()


def test_a_failing_step_of_many_requests_fails_only_the_request_that_causes_it(
    serving_model_dir, reference_llm, started, monkeypatch, caplog
) -> None:
    # Many seats: requests share steps. The step that fails holds the poisoned request and
    # others; they are retried in halves until the poisoned one fails alone.
    caplog.set_level(logging.INFO)
    engine = make_engine(serving_model_dir)
    fault = StepFault(after_tokens=2).install(engine.engine, monkeypatch)
    started(engine)
    requests = {"poisoned": (POISONED, greedy(8))}
    requests |= {f"short-{i}": (prompt, greedy(3 + i)) for i, prompt in enumerate(UNRELATED)}
    requests["long"] = (UNRELATED[0], greedy(12))

    results = run_all(engine, requests)

    first_failed_step = fault.failed_step_request_ids[0]
    assert len(first_failed_step) > 2  # the poisoned request shared the step
    assert fault.failed_step_request_ids[-1] == {"poisoned"}
    failed_ids = {rid for rid, (error, _) in results.items() if error is not None}
    assert failed_ids == {"poisoned"}
    for request_id in requests.keys() - failed_ids:
        prompt, params = requests[request_id]
        assert results[request_id][1][-1].token_ids == reference_tokens(reference_llm, prompt, params)
    wait_idle(engine.engine)
    assert engine.engine.block_manager.num_free_blocks == engine.engine.block_manager.num_blocks
    assert engine.engine.stats.num_step_errors == len(fault.failed_step_request_ids)
    assert engine.engine.stats.num_probe_failures == 0
    assert engine.is_running
    # one traceback, for the request that was ended; the retries are warning lines
    records = step_error_records(caplog)
    assert len(records) == 1 and "poisoned" in records[0].getMessage()
    retries = [r for r in caplog.records if "retrying them in smaller groups" in r.getMessage()]
    assert len(retries) == len(fault.failed_step_request_ids) - 1


def test_requests_retried_after_a_step_failed_late_sample_what_they_would_have(
    serving_model_dir, reference_llm, started, monkeypatch
) -> None:
    # The step fails after sampling (the seeded generators advanced) and before the
    # tokens were appended: a retried request must restart from its state before that step.
    engine = make_engine(serving_model_dir)
    engine_core = engine.engine
    unpatched = engine_core.scheduler.update_from_output

    def update_from_output(plan, *args, **kwargs):
        if any(is_poisoned(r) and len(r.output_token_ids) >= 2 for r in plan.requests):
            raise RuntimeError(FAULT_MESSAGE)
        return unpatched(plan, *args, **kwargs)

    monkeypatch.setattr(engine_core.scheduler, "update_from_output", update_from_output)
    started(engine)
    seeded = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True) for seed in (11, 12, 13)
    ]
    requests = {"poisoned": (POISONED, greedy(8))}
    requests |= {f"seeded-{i}": (UNRELATED[i], params) for i, params in enumerate(seeded)}

    results = run_all(engine, requests)

    assert isinstance(results["poisoned"][0], RequestFailedError)
    for i, params in enumerate(seeded):
        error, outputs = results[f"seeded-{i}"]
        assert error is None
        assert outputs[-1].token_ids == reference_tokens(reference_llm, UNRELATED[i], params)
        # the tokens streamed before the failure are a prefix of the final ones (nothing resent differently)
        for output in outputs:
            assert output.token_ids == outputs[-1].token_ids[: len(output.token_ids)]
    assert engine_core.stats.num_requests_retried >= len(requests)
    wait_idle(engine_core)
    assert engine_core.block_manager.num_free_blocks == engine_core.block_manager.num_blocks


def test_requests_that_fail_alone_in_a_row_never_stop_the_engine(
    serving_model_dir, reference_llm, started, monkeypatch
) -> None:
    # The attack of issue #17: bad requests one after another. Each fails alone, the
    # probe step after it passes, so none of them counts towards stopping the engine.
    engine = make_engine(serving_model_dir)
    StepFault(after_tokens=0).install(engine.engine, monkeypatch)
    started(engine)
    for i in range(engine.max_consecutive_step_errors + 2):
        error, _ = run_all(engine, {f"bad-{i}": ([*POISON_PREFIX, 20 + i], greedy(3))})[f"bad-{i}"]
        assert isinstance(error, RequestFailedError)
    assert engine.is_running
    error, outputs = run_all(engine, {"after": (UNRELATED[0], greedy(4))})["after"]
    assert error is None
    assert outputs[-1].token_ids == reference_tokens(reference_llm, UNRELATED[0], greedy(4))
    stats = engine.engine.stats
    assert stats.num_probe_steps == engine.max_consecutive_step_errors + 2
    assert stats.num_probe_failures == 0


def test_a_failing_step_with_offload_leaks_no_save_and_stores_nothing(
    serving_model_dir, reference_llm, started, monkeypatch
) -> None:
    # Fails the poisoned request's first step, whose prompt saves the connector had planned.
    offload = OffloadConfig(chunk_size=16, cpu_bytes=64 << 20)
    engine = make_engine(serving_model_dir, kv_offload=offload)
    StepFault(after_tokens=0).install(engine.engine, monkeypatch)
    started(engine)
    poisoned = [*POISONED, *range(100, 140)]  # 49 tokens: three full chunks to save
    unrelated = list(range(200, 240))
    results = run_all(engine, {"poisoned": (poisoned, greedy(4))})
    assert isinstance(results["poisoned"][0], RequestFailedError)
    wait_idle(engine.engine)  # a save left pending would hold the request's blocks forever
    engine_core = engine.engine
    assert not engine_core.scheduler.request_id_to_sending
    assert engine_core.block_manager.num_free_blocks == engine_core.block_manager.num_blocks
    cache_engine = engine_core.offload_cache_engine
    assert cache_engine.lookup(tuple(poisoned)) == 0  # nothing of the failed forward was stored
    # The connector goes on storing and loading for other requests.
    for _ in range(2):
        error, outputs = run_all(engine, {"unrelated": (unrelated, greedy(4))})["unrelated"]
        assert error is None
        assert outputs[-1].token_ids == reference_tokens(reference_llm, unrelated, greedy(4))
        engine_core.flush_kv_offload()
    assert cache_engine.lookup(tuple(unrelated)) == len(unrelated)


def test_steps_failing_in_a_row_stop_the_engine_and_fail_fast(
    serving_model_dir, started, monkeypatch
) -> None:
    engine = AsyncEngine(
        EngineCore(serving_model_dir, EngineArgs(num_gpu_blocks=64)), max_consecutive_step_errors=2
    )
    StepFault(every_step=True).install(engine.engine, monkeypatch)
    started(engine)
    for request_id in ("first", "second"):
        error, _ = run_all(engine, {request_id: (UNRELATED[0], greedy(3))})[request_id]
        assert isinstance(error, RequestFailedError)
    engine._thread.join(10)
    assert not engine.is_running
    with pytest.raises(EngineDeadError, match="not running") as raised:
        run_all(engine, {"late": (UNRELATED[1], greedy(3))})
    assert FAULT_MESSAGE not in str(raised.value)
    assert engine.engine.stats.num_step_errors == 2
    assert engine.engine.stats.num_probe_failures == 2  # nothing ran without the failed requests
    assert not engine.engine.requests


def test_max_consecutive_step_errors_is_validated(serving_model_dir) -> None:
    with pytest.raises(ValueError, match="max_consecutive_step_errors"):
        AsyncEngine(
            EngineCore(serving_model_dir, EngineArgs(num_gpu_blocks=8)), max_consecutive_step_errors=0
        )


def test_a_step_failing_while_scheduling_ends_the_request_and_drops_its_load(
    serving_model_dir, reference_llm, started, monkeypatch
) -> None:
    # The connector raises after it recorded the poisoned request's load from the tiers:
    # the request was taken from the waiting queue but never reached the running one.
    offload = OffloadConfig(chunk_size=16, cpu_bytes=64 << 20)
    engine = make_engine(serving_model_dir, kv_offload=offload)
    engine_core = engine.engine
    connector = engine_core.scheduler.connector
    armed = False
    unpatched = connector.update_state_after_alloc

    def update_state_after_alloc(request, block_ids, grant):
        unpatched(request, block_ids, grant)
        if armed and grant.num_load_tokens > 0:
            raise RuntimeError(FAULT_MESSAGE)

    monkeypatch.setattr(connector, "update_state_after_alloc", update_state_after_alloc)
    started(engine)
    prompt = list(range(100, 150))
    unrelated = list(range(200, 240))
    assert run_all(engine, {"store": (prompt, greedy(2))})["store"][0] is None
    engine_core.flush_kv_offload()
    assert engine_core.reset_prefix_cache()  # the next run of the prompt loads from the CPU tier
    armed = True

    error, _ = run_all(engine, {"loads": (prompt, greedy(2))})["loads"]

    assert isinstance(error, RequestFailedError)
    wait_idle(engine_core)
    assert engine_core.block_manager.num_free_blocks == engine_core.block_manager.num_blocks
    hits_before = metric_value(engine.metrics.render().decode(), "kvstash_tier_hit_chunks_total", tier="cpu")
    error, outputs = run_all(engine, {"unrelated": (unrelated, greedy(4))})["unrelated"]
    assert error is None
    assert outputs[-1].token_ids == reference_tokens(reference_llm, unrelated, greedy(4))
    # The ended request's load never ran (it would have written into freed blocks).
    assert metric_value(engine.metrics.render().decode(), "kvstash_tier_hit_chunks_total", tier="cpu") == (
        hits_before
    )
    assert engine_core.stats.num_step_errors == 1


def test_llm_generate_ends_only_the_failing_request(serving_model_dir, reference_llm, monkeypatch) -> None:
    from engine import LLM

    llm = LLM(str(serving_model_dir), num_gpu_blocks=NUM_GPU_BLOCKS, max_num_seqs=MAX_NUM_SEQS)
    StepFault(after_tokens=1).install(llm.engine, monkeypatch)
    prompts = [UNRELATED[0], POISONED, UNRELATED[1]]
    outputs = llm.generate(prompts, greedy(5))
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    for prompt, output in zip(prompts[::2], outputs[::2], strict=True):
        assert output.token_ids == reference_tokens(reference_llm, prompt, greedy(5))
    assert not llm.engine.has_unfinished_requests()
    # sampling values the sampler cannot use are refused before anything is queued,
    # also when set after construction
    params = greedy(5)
    params.top_p = 1e-300
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([UNRELATED[0]], params)
    assert not llm.engine.has_unfinished_requests()
