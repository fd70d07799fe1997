"""Asynchronous scheduling (engine.batch_queue) and the persistent batch
(engine.input_batch) end to end, issue #20 items 1 and 2: tiny float32 models on CPU,
tokens identical to the plain engine (synchronous steps, inputs built from scratch
every step) with stop strings, EOS, max_tokens, aborts mid-flight, preemption,
speculative decoding and offload hits.

On CPU the model runner finishes a step inside `submit`, but the engine still plans
step N+1 before it reads step N's tokens: `num_device_filled_input_ids` counts the
input ids that came from the previous step's samples instead of the host, so each
test checks that the overlap path really ran."""

from __future__ import annotations

import random

import numpy as np
import pytest

from connector import OffloadConfig
from engine import LLM, EngineArgs, EngineCore, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


def plain_llm(model_dir, **engine_args) -> LLM:
    """The engine as it was: synchronous steps, inputs rebuilt from the requests."""
    llm = LLM(model_dir, dtype="float32", device="cpu", **engine_args)
    llm.engine.runner.input_batch = None
    return llm


def async_llm(model_dir, **engine_args) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", async_scheduling=True, **engine_args)


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(prompts, params)]


def assert_clean(llm: LLM) -> None:
    """Nothing in flight, no request left, every block back in the pool."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


MIXED_PROMPTS = [make_prompt(n, seed) for seed, n in enumerate([5, 40, 17, 90, 3, 33, 61])]
MIXED_PARAMS = [
    SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in [1, 7, 12, 3, 20, 9, 2]
]


@pytest.mark.parametrize("budget", [8192, 24])
def test_async_tokens_equal_the_plain_engine_with_chunked_prefill_and_max_tokens(model_dir, budget):
    expected = token_ids(plain_llm(model_dir, max_num_batched_tokens=budget), MIXED_PROMPTS, MIXED_PARAMS)
    llm = async_llm(model_dir, max_num_batched_tokens=budget)
    outputs = llm.generate(MIXED_PROMPTS, MIXED_PARAMS)
    assert [o.token_ids for o in outputs] == expected
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in MIXED_PARAMS]
    assert all(o.finish_reason == "length" for o in outputs)
    # steps were planned before the previous step's tokens were read, and the steps in
    # flight after a request's last token computed outputs that were dropped
    assert llm.engine.runner.num_device_filled_input_ids > 0
    assert llm.engine._batch_queue.num_dropped_outputs > 0
    assert_clean(llm)


def test_sync_engine_with_the_persistent_batch_equals_the_plain_engine(model_dir):
    expected = token_ids(plain_llm(model_dir, max_num_batched_tokens=24), MIXED_PROMPTS, MIXED_PARAMS)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=24)
    assert token_ids(llm, MIXED_PROMPTS, MIXED_PARAMS) == expected
    assert llm.engine.runner.input_batch.num_rows_added >= len(MIXED_PROMPTS)
    assert llm.engine.runner.num_device_filled_input_ids == 0


def test_seeded_sampling_is_identical_with_async_scheduling(model_dir):
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)
    ]
    prompts = MIXED_PROMPTS[:3]
    assert token_ids(async_llm(model_dir), prompts, params) == token_ids(
        plain_llm(model_dir), prompts, params
    )


def test_stop_string_output_equals_the_plain_engine(model_dir):
    plain = plain_llm(model_dir)
    prompt = "KV blocks move between tiers"
    (full,) = plain.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    stop = next(
        full.text[i : i + 3]
        for i in range(4, len(full.text) - 3)
        if full.text[i : i + 3].strip() and full.text.find(full.text[i : i + 3]) == i
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    (expected,) = plain.generate([prompt], params)
    llm = async_llm(model_dir)
    (stopped,) = llm.generate([prompt], params)
    assert stopped.finish_reason == "stop" == expected.finish_reason
    assert (stopped.text, stopped.token_ids) == (expected.text, expected.token_ids)
    assert len(stopped.token_ids) < len(full.token_ids)  # the step in flight after the stop was dropped
    assert_clean(llm)


def test_eos_ends_the_request_and_the_step_in_flight_is_dropped(model_dir):
    prompt = make_prompt(20, seed=9)
    plain_tokens = token_ids(plain_llm(model_dir), [prompt], GREEDY)[0]
    eos = plain_tokens[4]
    engine = async_llm(model_dir).engine
    request = engine.add_request("stops", prompt, SamplingParams(max_tokens=12, temperature=0.0))
    request.eos_token_ids = frozenset({eos})
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "stops"]
    assert seen[-1].finish_reason == "stop"
    assert seen[-1].token_ids == plain_tokens[: plain_tokens.index(eos) + 1]
    assert sum(o.finished for o in seen) == 1  # nothing is shown after the end
    assert engine.runner.num_device_filled_input_ids > 0


def test_abort_mid_flight_drops_the_request_and_the_others_are_unchanged(model_dir):
    prompts = {f"r{i}": make_prompt(30 + 7 * i, seed=20 + i) for i in range(4)}
    expected = dict(
        zip(prompts, token_ids(plain_llm(model_dir), list(prompts.values()), GREEDY), strict=True)
    )
    engine = async_llm(model_dir).engine
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    finished, after_abort = {}, []
    aborted = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if aborted is not None:
            after_abort += [o for o in outputs if o.request_id == "r1"]
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
        running = engine.requests.get("r1")
        if aborted is None and running is not None and len(running.output_token_ids) >= 3:
            assert len(engine._batch_queue) == 1  # a step holding r1 is in flight
            aborted = engine.abort_request("r1")
    assert aborted.finish_reason == "abort" and aborted.token_ids == expected["r1"][: len(aborted.token_ids)]
    assert after_abort == []  # the step in flight's token for r1 never shows
    for request_id in ("r0", "r2", "r3"):
        assert finished[request_id].token_ids == expected[request_id]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_gives_identical_tokens(model_dir):
    prompts = [make_prompt(60 + 5 * i, seed=40 + i) for i in range(5)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = plain_llm(model_dir, num_gpu_blocks=24)
    expected = token_ids(plain, prompts, params)
    llm = async_llm(model_dir, num_gpu_blocks=24)
    assert token_ids(llm, prompts, params) == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.runner.input_batch.num_rows_added > len(prompts)  # resumed rows were re-added
    assert llm.engine._batch_queue.num_dropped_outputs > 0
    assert_clean(llm)


def test_speculative_decoding_falls_back_to_synchronous_steps(model_dir):
    rng = random.Random(7)
    text = [rng.randrange(10, 500) for _ in range(24)]
    prompts = [text * 3, text[:10] + make_prompt(27, 3) + text[:10]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = token_ids(plain_llm(model_dir), prompts, params)
    llm = async_llm(model_dir, speculative="ngram", num_speculative_tokens=3, ngram_min_n=1)
    assert token_ids(llm, prompts, params) == expected
    assert llm.engine._batch_queue is None
    assert llm.stats.spec_decode.num_accepted_tokens > 0
    assert_clean(llm)


def test_offload_hits_in_the_cpu_tier_give_identical_tokens(model_dir):
    prompts = [make_prompt(150, seed=60), make_prompt(130, seed=61)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = token_ids(plain_llm(model_dir), prompts, params)
    llm = async_llm(model_dir, kv_offload=OffloadConfig(chunk_size=32, cpu_bytes=32 << 20))
    assert token_ids(llm, prompts, params) == expected
    llm.flush_kv_offload()
    assert llm.reset_prefix_cache()
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.metrics.num_external_cached_tokens > 0 for o in outputs)
    assert llm.engine._batch_queue.num_sync_steps > 0  # the steps with loads ran alone
    assert llm.engine.runner.num_device_filled_input_ids > 0
    assert_clean(llm)


def test_a_failed_async_step_ends_only_its_failing_request(model_dir, monkeypatch):
    prompts = {f"r{i}": make_prompt(25 + i, seed=80 + i) for i in range(3)}
    expected = dict(
        zip(prompts, token_ids(plain_llm(model_dir), list(prompts.values()), GREEDY), strict=True)
    )
    engine = async_llm(model_dir).engine
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    runner = engine.runner
    submit = runner.submit

    def failing_submit(plan, while_device_runs=None):
        if any(r.request_id == "r1" and len(r.output_token_ids) >= 4 for r in plan.requests):
            raise RuntimeError("injected failure")
        return submit(plan, while_device_runs)

    monkeypatch.setattr(runner, "submit", failing_submit)
    monkeypatch.setattr(runner, "execute", lambda plan, hook=None: failing_submit(plan, hook).result())
    from engine.engine_core import EngineStepError

    finished = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except EngineStepError as error:
            outputs = error.outputs
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
    assert finished["r1"].finish_reason == "error"
    for request_id in ("r0", "r2"):
        assert finished[request_id].token_ids == expected[request_id]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "engine_args",
    [
        {"async_scheduling": True},
        {"speculative": "ngram", "num_speculative_tokens": 3, "ngram_min_n": 1},
    ],
    ids=["async", "ngram"],
)
def test_every_step_gathers_the_same_inputs_as_building_them_from_scratch(
    model_dir, monkeypatch, engine_args
):
    """The persistent batch against the from-scratch inputs, step by step, through
    chunked prefill, prefix hits, preemption, and async placeholders or drafts."""
    llm = LLM(
        model_dir, dtype="float32", device="cpu", num_gpu_blocks=16, max_num_batched_tokens=40, **engine_args
    )
    runner = llm.engine.runner
    batch = runner.input_batch
    prepare = runner._prepare
    num_compared = 0

    def compare(plan):
        nonlocal num_compared
        runner.input_batch = None
        reference = prepare(plan)
        runner.input_batch = batch
        host, logits_rows = prepare(plan)
        assert logits_rows == reference[1]
        for name, value in vars(reference[0]).items():
            other = getattr(host, name)
            if isinstance(value, np.ndarray):
                assert value.dtype == other.dtype and np.array_equal(value, other), name
            else:
                assert value == other, name
        num_compared += 1
        return host, logits_rows

    monkeypatch.setattr(runner, "_prepare", compare)
    rng = random.Random(5)
    shared = [rng.randrange(10, 500) for _ in range(16)] * 3  # repeats: n-gram drafts find matches
    prompts = [shared + make_prompt(20 + 9 * i, seed=91 + i) for i in range(5)]
    llm.generate(prompts, SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True))
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.scheduler.stats.num_prefix_hit_tokens > 0
    if "speculative" in engine_args:
        assert llm.stats.spec_decode.num_draft_tokens > 0
    else:
        assert runner.num_device_filled_input_ids > 0
    assert num_compared > 20


def test_engine_args_flag_and_the_cli_commands(model_dir):
    from click.testing import CliRunner

    from engine.cli import main

    assert EngineArgs().async_scheduling is False
    engine = EngineCore(model_dir, EngineArgs(dtype="float32", device="cpu", async_scheduling=True))
    assert engine._batch_queue is not None
    runner = CliRunner()
    for command in ("serve", "bench", "generate"):
        assert "--async-scheduling" in runner.invoke(main, [command, "--help"]).output
    args = [str(model_dir), "--prompt", "KV blocks move", "--max-tokens", "6", "--ignore-eos"]
    args += ["--device", "cpu", "--dtype", "float32"]
    plain = runner.invoke(main, ["generate", *args])
    overlapped = runner.invoke(main, ["generate", *args, "--async-scheduling"])
    assert plain.exit_code == 0 == overlapped.exit_code, overlapped.output
    assert overlapped.output == plain.output and plain.output.strip()


def test_async_decode_through_the_graph_path_fills_the_static_input_ids(tiny_model_dir):
    """The decode-graph path (static buffers; replay swapped for an eager call on CPU)
    takes the previous step's tokens into its static input ids before the replay."""
    from engine.attention import AttentionMetadata
    from tests.engine.test_decode_graphs import EagerReplay

    model_dir = tiny_model_dir("qwen2")
    prompts = [make_prompt(n, seed=300 + n) for n in (1, 20, 47, 130, 5)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 4, 8, 12, 6)]
    expected = token_ids(plain_llm(model_dir), prompts, params)
    llm = async_llm(model_dir)
    runner = llm.engine.runner
    runner.decode_graphs = EagerReplay(
        runner._forward_with_metadata,
        AttentionMetadata,
        runner.device,
        8,
        max_blocks_per_seq=16,
        max_seq_len=16 * runner.block_size,
    )
    assert token_ids(llm, prompts, params) == expected
    assert runner.decode_graphs.num_replays > 5
    assert runner.num_device_filled_input_ids > 0


def test_disk_tier_hits_fetched_in_the_background_give_identical_tokens(model_dir, tmp_path):
    """A hit below the CPU tier waits unadmitted while it is fetched: steps that schedule
    nothing (only fetches under way) and steps with loads run synchronously in the queue."""
    prompts = [make_prompt(200, seed=70), make_prompt(170, seed=71)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = token_ids(plain_llm(model_dir), prompts, params)
    config = OffloadConfig(chunk_size=32, cpu_bytes=32 << 20, disk_path=str(tmp_path), load_policy="always")
    writer = LLM(model_dir, dtype="float32", device="cpu", kv_offload=config)
    writer.generate(prompts, params)
    writer.flush_kv_offload()
    writer.engine.runner.connector.close()  # a disk folder takes one engine at a time
    llm = async_llm(model_dir, kv_offload=config, enable_prefix_caching=False)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.metrics.tier_to_loaded_tokens.get("disk", 0) > 0 for o in outputs)
    assert llm.engine._batch_queue.num_sync_steps > 0
    assert llm.engine.runner.num_device_filled_input_ids > 0
    assert_clean(llm)
    llm.engine.runner.connector.close()


def test_async_scheduling_switches_only_between_steps(model_dir):
    engine = EngineCore(model_dir, EngineArgs(dtype="float32", device="cpu"))
    engine.set_async_scheduling(True)
    engine.add_request("x", make_prompt(10, seed=1), GREEDY)
    engine.step()
    assert engine.num_steps_in_flight == 1 and engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="in flight"):
        engine.set_async_scheduling(False)
    spec = EngineCore(
        model_dir, EngineArgs(dtype="float32", device="cpu", speculative="ngram", num_speculative_tokens=2)
    )
    with pytest.raises(ValueError, match="speculative"):
        spec.set_async_scheduling(True)


def test_async_scheduling_with_weights_streamed_from_cpu_memory(model_dir):
    """Issue #20's items together: async scheduling over a model whose last layer is
    offloaded (cpu_offload_gb), chunked prefill, identical tokens."""
    from tests.engine.test_weight_offload import layer_gib

    expected = token_ids(plain_llm(model_dir, max_num_batched_tokens=24), MIXED_PROMPTS, MIXED_PARAMS)
    llm = async_llm(model_dir, max_num_batched_tokens=24, cpu_offload_gb=layer_gib(model_dir, 1))
    assert llm.engine.model.weight_offloader.offloaded_layer_ids
    assert token_ids(llm, MIXED_PROMPTS, MIXED_PARAMS) == expected
    assert llm.engine.runner.num_device_filled_input_ids > 0


def run_with_failing_forward(engine, monkeypatch, should_fail) -> tuple[dict, int]:
    """Step ``engine`` until it is idle (at most 300 steps: a leak fails, never hangs) while
    its forward raises for each plan ``should_fail(plan)`` accepts: inside the runner, as a
    real forward fails, with the step's connector metadata bound. -> (request id -> its
    final output, number of failures injected)."""
    run_model = engine.runner._run_model
    num_failures = 0

    def failing_forward(plan, host):
        nonlocal num_failures
        if should_fail(plan, num_failures):
            num_failures += 1
            raise RuntimeError("injected failure")
        return run_model(plan, host)

    monkeypatch.setattr(engine.runner, "_run_model", failing_forward)
    return step_until_idle(engine), num_failures


def step_until_idle(engine) -> dict:
    """Step ``engine`` until it is idle, at most 300 steps (a leak fails, never hangs),
    through failed steps -> request id -> its final output."""
    from engine.engine_core import EngineStepError

    finished = {}
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except EngineStepError as error:
            outputs = error.outputs
        finished.update((output.request_id, output) for output in outputs if output.finished)
    return finished


def test_a_failed_async_step_leaves_no_cpu_tier_slot_reserved_or_pinned(model_dir, monkeypatch):
    """The steps in flight that a failed step makes the engine give up still report the
    CPU-tier slots they filled and read: the scheduler side applies those facts, so the
    tier does not shrink by a failure (issue 36: the scheduler side owns the index)."""
    from connector import OffloadConfig

    prompts = {f"r{i}": make_prompt(40 + 9 * i, seed=90 + i) for i in range(4)}
    config = OffloadConfig(cpu_bytes=8 << 20, chunk_size=16)
    expected = dict(
        zip(prompts, token_ids(plain_llm(model_dir), list(prompts.values()), GREEDY), strict=True)
    )
    llm = async_llm(model_dir, kv_offload=config)
    engine = llm.engine
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    finished, num_failures = run_with_failing_forward(
        engine,
        monkeypatch,
        lambda plan, _: any(r.request_id == "r1" and len(r.output_token_ids) >= 3 for r in plan.requests),
    )
    assert not engine.has_unfinished_requests()
    assert num_failures > 0 and finished["r1"].finish_reason == "error"
    for request_id in ("r0", "r2", "r3"):
        assert finished[request_id].token_ids == expected[request_id]
    llm.flush_kv_offload()
    index = engine.scheduler.connector.grants.index
    gauges = index.gauges()
    assert gauges["num_keys"] > 0  # the prompts' chunks were stored
    assert gauges["num_used_slots"] == gauges["num_keys"], gauges  # no reservation left
    assert gauges["num_pinned"] == 0 and not any(index.pin_counts().values()), index.pin_counts()


def test_a_step_failing_behind_one_that_saved_loses_none_of_its_saves(model_dir, monkeypatch):
    """A step fails while the step before it is still in flight, and that step's worker
    report says saves read their blocks: the engine gives the in-flight step up but applies
    its report, so its requests are not left waiting for saves that were reported already
    (they would hold their blocks, and the engine would never be idle)."""
    from connector import OffloadConfig

    prompts = {f"r{i}": make_prompt(40 + 9 * i, seed=70 + i) for i in range(4)}
    expected = dict(
        zip(prompts, token_ids(plain_llm(model_dir), list(prompts.values()), GREEDY), strict=True)
    )
    llm = async_llm(model_dir, kv_offload=OffloadConfig(cpu_bytes=8 << 20, chunk_size=16))
    engine = llm.engine
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)

    def behind_a_step_that_saved(plan, num_failures: int) -> bool:
        in_flight_reports = [step.future.connector_report for step in engine._batch_queue._in_flight]
        return num_failures == 0 and any(report is not None and report.saves for report in in_flight_reports)

    finished, num_failures = run_with_failing_forward(engine, monkeypatch, behind_a_step_that_saved)
    assert num_failures == 1
    assert not engine.has_unfinished_requests(), dict(engine.scheduler.request_id_to_sending)
    assert {request_id: output.token_ids for request_id, output in finished.items()} == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_requests", [1, 3])
def test_a_step_failing_before_the_runner_bound_its_metadata_leaves_nothing_pending(
    model_dir, monkeypatch, async_scheduling, num_requests
):
    """A step raises after it was planned and before the model runner bound its connector
    metadata (here: as the runner's ``submit`` starts). The worker side ends that metadata
    as a failed step's: its saves are not left pending (the engine goes idle, every block
    comes back) and the CPU-tier slots granted to them are given back. One request alone is
    ended with an error; several are retried and complete with the plain engine's tokens."""
    prompts = {f"r{i}": make_prompt(40 + 9 * i, seed=50 + i) for i in range(num_requests)}
    expected = dict(
        zip(prompts, token_ids(plain_llm(model_dir), list(prompts.values()), GREEDY), strict=True)
    )
    config = OffloadConfig(cpu_bytes=8 << 20, chunk_size=16)
    llm = LLM(model_dir, dtype="float32", device="cpu", async_scheduling=async_scheduling, kv_offload=config)
    engine = llm.engine
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    submit = engine.runner.submit
    num_failures = 0

    def failing_submit(plan, *args, **kwargs):
        nonlocal num_failures
        if num_failures == 0 and plan.connector_meta is not None and plan.connector_meta.saves:
            num_failures += 1
            raise RuntimeError("injected failure before the step's metadata is bound")
        return submit(plan, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "submit", failing_submit)
    finished = step_until_idle(engine)
    assert num_failures == 1
    assert not engine.has_unfinished_requests(), dict(engine.scheduler.request_id_to_sending)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if num_requests == 1:
        assert finished["r0"].finish_reason == "error"
    else:
        assert {request_id: output.token_ids for request_id, output in finished.items()} == expected
    llm.flush_kv_offload()
    index = engine.scheduler.connector.grants.index
    gauges = index.gauges()
    assert gauges["num_used_slots"] == gauges["num_keys"], gauges  # no reservation left
    assert gauges["num_pinned"] == 0 and not any(index.pin_counts().values()), index.pin_counts()
