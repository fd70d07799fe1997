"""Asynchronous scheduling with pipeline parallelism (issue #21): an engine of 2 stages
(gloo on CPU, float32 tiny llama) keeps up to 2 micro-batches of disjoint requests in
flight, and gives the greedy tokens of one synchronous stage with different
max_tokens, a stop string, an abort while in flight, preemption and CPU-tier offload
hits; a micro-batch failing on the last stage ends only its failing request, and a
killed stage still ends the requests with an error and the engine exits.

One engine is shared by the module (each stage process imports torch: seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from connector import OffloadConfig
from engine import LLM, SamplingParams
from tests.engine.hf_reference import random_prompt
from tests.engine.test_pipeline_parallel import _FAULTY_STAGE_SCRIPT, _start

PROMPTS = [random_prompt(n, seed=300 + i) for i, n in enumerate([5, 40, 17, 90, 3, 33])]
PARAMS = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in [1, 7, 12, 3, 20, 9]]
#: 24 blocks of 16 = 384 tokens: the preemption test's 4 requests of 119 tokens do not fit
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(one synchronous stage, a PP=2 engine with async scheduling and a CPU tier)."""
    model_dir = tiny_model_dir("llama")
    one_stage = LLM(model_dir, dtype="float32", device="cpu")
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        pipeline_parallel_size=2,
        async_scheduling=True,
        num_gpu_blocks=NUM_BLOCKS,
        kv_offload=OffloadConfig(chunk_size=32, cpu_bytes=32 << 20),
        max_decode_gap_ms=0,
    )
    yield one_stage, llm
    llm.engine.shutdown()


def _run(engine, request_id_to_prompt: dict, params_of) -> tuple[dict, int, int]:
    """Step the engine until idle, checking at every step that the micro-batches in flight
    hold disjoint requests -> (finished outputs by id, the most steps in flight at once,
    the most requests in one micro-batch)."""
    for request_id, prompt in request_id_to_prompt.items():
        engine.add_request(request_id, prompt, params_of(request_id))
    finished, most_in_flight, largest = {}, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished  # nothing is shown after the end
                finished[output.request_id] = output
        in_flight = [r.request_id for step in engine._batch_queue._in_flight for r in step.plan.requests]
        assert len(in_flight) == len(set(in_flight)), in_flight
        most_in_flight = max(most_in_flight, engine.num_steps_in_flight)
        largest = max([largest] + [len(step.plan.requests) for step in engine._batch_queue._in_flight])
    return finished, most_in_flight, largest


def _assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_two_micro_batches_in_flight_give_the_tokens_of_one_stage(engines) -> None:
    one_stage, llm = engines
    expected = [o.token_ids for o in one_stage.generate(PROMPTS, PARAMS)]
    engine = llm.engine
    overlapped_before = engine.pipeline.num_overlapped_submits
    prompts = {f"mixed-{i}": p for i, p in enumerate(PROMPTS)}
    finished, most_in_flight, largest = _run(engine, prompts, lambda rid: PARAMS[int(rid.split("-")[1])])
    assert [finished[rid].token_ids for rid in prompts] == expected
    assert [finished[rid].finish_reason for rid in prompts] == ["length"] * len(PROMPTS)
    assert most_in_flight == 2  # one micro-batch per stage
    assert largest == len(PROMPTS) // 2  # half of the requests each
    assert engine.pipeline.num_overlapped_submits > overlapped_before
    assert engine._batch_queue.num_overlapped_steps > 0
    # the requests of a micro-batch in flight are never scheduled: no token from the device
    assert engine.pipeline.runner.num_device_filled_input_ids == 0
    _assert_clean(llm)


def test_seats_for_two_requests_are_shared_out_over_the_two_stages(engines) -> None:
    """max_num_seqs 2 with 6 requests queued: one request per micro-batch, both stages
    busy (not one micro-batch of 2 and a second stage waiting for a free seat)."""
    one_stage, llm = engines
    prompts = {f"seat-{i}": random_prompt(12 + 3 * i, seed=310 + i) for i in range(6)}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in one_stage.generate(list(prompts.values()), params)]
    scheduler = llm.engine.scheduler
    scheduler.max_num_seqs = 2
    try:
        finished, most_in_flight, largest = _run(llm.engine, prompts, lambda _: params)
    finally:
        scheduler.max_num_seqs = llm.engine.args.max_num_seqs
    assert [finished[rid].token_ids for rid in prompts] == expected
    assert (most_in_flight, largest) == (2, 1)
    _assert_clean(llm)


def test_one_request_runs_one_micro_batch_at_a_time(engines) -> None:
    one_stage, llm = engines
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (expected,) = one_stage.generate([PROMPTS[1]], params)
    finished, most_in_flight, _ = _run(llm.engine, {"alone": PROMPTS[1]}, lambda _: params)
    assert finished["alone"].token_ids == expected.token_ids
    assert most_in_flight == 1


def test_stop_string_and_abort_while_in_flight(engines) -> None:
    one_stage, llm = engines
    long_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = "KV blocks move between tiers"
    (full,) = one_stage.generate([prompt], long_params)
    stop = next(
        full.text[i : i + 3]
        for i in range(4, len(full.text) - 3)
        if full.text[i : i + 3].strip() and full.text.find(full.text[i : i + 3]) == i
    )
    stop_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    (expected_stop,) = one_stage.generate([prompt], stop_params)
    others = {f"o{i}": random_prompt(20 + 9 * i, seed=320 + i) for i in range(3)}
    expected = dict(zip(others, one_stage.generate(list(others.values()), long_params), strict=True))
    engine = llm.engine
    dropped_before = engine._batch_queue.num_dropped_outputs
    engine.add_request("stops", list(llm.tokenizer.encode(prompt)), stop_params)
    for request_id, other in others.items():
        engine.add_request(request_id, other, long_params)
    finished, after_abort, aborted = {}, [], None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if aborted is not None:
            after_abort += [o for o in outputs if o.request_id == "o1"]
        for output in outputs:
            if output.finished:
                assert output.request_id not in finished
                finished[output.request_id] = output
        in_flight = {r.request_id for step in engine._batch_queue._in_flight for r in step.plan.requests}
        running = engine.requests.get("o1")
        if aborted is None and "o1" in in_flight and len(running.output_token_ids) >= 3:
            aborted = engine.abort_request("o1")
    assert finished["stops"].finish_reason == "stop" == expected_stop.finish_reason
    assert (finished["stops"].text, finished["stops"].token_ids) == (
        expected_stop.text,
        expected_stop.token_ids,
    )
    assert aborted is not None and aborted.finish_reason == "abort"
    assert aborted.token_ids == expected["o1"].token_ids[: len(aborted.token_ids)]
    assert after_abort == []  # the micro-batch in flight's token for o1 never shows
    assert engine._batch_queue.num_dropped_outputs > dropped_before
    for request_id in ("o0", "o2"):
        assert finished[request_id].token_ids == expected[request_id].token_ids
    _assert_clean(llm)


def test_preemption_and_offload_hits_give_the_tokens_of_one_stage(engines) -> None:
    one_stage, llm = engines
    # 4 prompts of 5 blocks, 2 micro-batches of 2: all 24 blocks are taken at the 81st
    # token, so at the 97th the first micro-batch's requests preempt the last running
    # request, which is in the micro-batch in flight
    prompts = [random_prompt(79, seed=340 + i) for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in one_stage.generate(prompts, params)]
    preemptions_before = llm.engine.scheduler.stats.num_preemptions
    dropped_before = llm.engine._batch_queue.num_dropped_outputs
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.scheduler.stats.num_preemptions > preemptions_before
    # a request preempted while its micro-batch was in flight: that output was dropped
    assert llm.engine._batch_queue.num_dropped_outputs > dropped_before
    _assert_clean(llm)
    # the same prompts again from the CPU tier (steps with loads run alone)
    llm.flush_kv_offload()
    assert llm.reset_prefix_cache()
    sync_before = llm.engine._batch_queue.num_sync_steps
    outputs = llm.generate(prompts[:2], params)
    assert [o.token_ids for o in outputs] == expected[:2]
    assert all(o.metrics.num_external_cached_tokens > 0 for o in outputs)
    assert llm.engine._batch_queue.num_sync_steps > sync_before
    _assert_clean(llm)


_KILLABLE_ASYNC_SCRIPT = textwrap.dedent(
    """
    import sys
    from engine import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(
            sys.argv[1], dtype="float32", device="cpu", pipeline_parallel_size=2, async_scheduling=True
        )
        print("pids", *llm.engine.pipeline.stage_pids, flush=True)
        params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)
        print("done", *[o.finish_reason for o in outputs], flush=True)
        print("dead", llm.engine.device_error(), flush=True)
    """
)


def test_a_killed_stage_with_micro_batches_in_flight_ends_the_requests(
    tiny_model_dir, subprocess_env
) -> None:
    process, (stage_pid,) = _start(_KILLABLE_ASYNC_SCRIPT, tiny_model_dir("llama"), subprocess_env)
    try:
        time.sleep(1.0)  # both requests are decoding, one micro-batch each
        os.kill(stage_pid, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=10)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    done = stdout.splitlines()
    assert done[0] == "done error error", stdout + stderr
    assert done[1] == f"dead pipeline stage 1 (pid {stage_pid}) was killed by signal 9", stdout


def test_a_micro_batch_failing_on_the_last_stage_ends_only_its_failing_request(
    tiny_model_dir, subprocess_env, tmp_path
) -> None:
    """The failed micro-batch raises when collected; the one behind it is abandoned (its
    replies dropped by the next collect) and every request is retried in smaller groups:
    only the request that fails alone ends with an error."""
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(20, seed=210), random_prompt(13, seed=211), random_prompt(30, seed=212)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]
    script = tmp_path / "faulty_stage_async.py"
    script.write_text(
        _FAULTY_STAGE_SCRIPT.replace(
            "pipeline_parallel_size=2)", "pipeline_parallel_size=2, async_scheduling=True)"
        )
    )
    assert "async_scheduling=True" in script.read_text()
    result = subprocess.run(
        [sys.executable, str(script), str(model_dir), json.dumps(prompts)],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    outputs = json.loads(result.stdout.splitlines()[-1])
    assert [reason for reason, _ in outputs] == ["length", "error", "length"]
    assert [outputs[0][1], outputs[2][1]] == [expected[0], expected[2]]
    assert "injected fault on the last stage" in result.stderr
