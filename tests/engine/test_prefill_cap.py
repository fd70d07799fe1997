"""The prefill cap (engine.prefill_cap): while a request decodes, other prompts get
chunks sized from the engine's step-time model so that the decode is not held up by one
long step; `long_prefill_token_threshold` caps every prompt per step (vLLM's). Scheduler
rules without a model, then greedy tokens on a tiny model in float32 on CPU."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from connector.base import ConnectorMetadata, Grant, KVConnectorScheduler
from engine import LLM, EngineArgs, EngineCore, SamplingParams
from engine.block_manager import BlockManager
from engine.prefill_cap import CAP_PRIOR_TOKENS_PER_S, STEP_TARGET_FRACTION, PrefillCap
from engine.request import RequestStatus
from engine.scheduler import Scheduler
from engine.step_time import STEP_PRIOR_S, StepTimeModel
from tests.engine.hf_reference import random_prompt
from tests.engine.test_scheduler import BLOCK_SIZE, make_request


def make_scheduler(cap: PrefillCap, budget: int = 512) -> Scheduler:
    return Scheduler(BlockManager(512, BLOCK_SIZE, True), 8, budget, prefill_cap=cap)


def measured_rates(tokens_per_s: float) -> StepTimeModel:
    """A machine whose steps cost their prompt tokens only, at ``tokens_per_s``."""
    return StepTimeModel.from_parameters(step_s=0.0, tokens_per_s=tokens_per_s)


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedule once, feed back token 7 for every request the runner would sample; the plan."""
    output = scheduler.schedule()
    sampled = {
        r.request_id: 7
        for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)
        if r.num_computed_tokens + n == r.num_tokens
    }
    scheduler.update_from_output(output, sampled)
    return {r.request_id: n for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)}


def test_a_lone_prompt_keeps_its_full_chunk():
    scheduler = make_scheduler(
        PrefillCap(BLOCK_SIZE, max_decode_gap_ms=40.0, step_times=measured_rates(1000))
    )
    scheduler.add_request(make_request("long", 300))
    assert run_step(scheduler) == {"long": 300}


def test_prompt_chunks_are_capped_while_another_request_decodes_and_freed_after():
    # 1,000 tokens/s, 40 ms gap: 30 ms of prefill per step = 30 tokens, 28 on a block boundary
    scheduler = make_scheduler(
        PrefillCap(BLOCK_SIZE, max_decode_gap_ms=40.0, step_times=measured_rates(1000))
    )
    decode = make_request("decode", 10, max_tokens=6)
    scheduler.add_request(decode)
    assert run_step(scheduler) == {"decode": 10}  # alone: its whole prompt
    long = make_request("long", 200, first_token=500)
    scheduler.add_request(long)
    plans = [run_step(scheduler) for _ in range(5)]
    num_cap = int(40e-3 * STEP_TARGET_FRACTION * 1000) // BLOCK_SIZE * BLOCK_SIZE
    assert num_cap == 28
    # the decode gets its token every step; the prompt at most the cap, block-aligned
    assert plans == [{"decode": 1, "long": num_cap}] * 5
    assert decode.is_finished and long.num_computed_tokens == 5 * num_cap
    # nothing decodes any more: the rest of the prompt in one step
    assert run_step(scheduler) == {"long": 200 - 5 * num_cap}
    assert long.output_token_ids == [7]


def test_the_cap_is_shared_by_the_step_and_the_first_prompt_always_progresses():
    # 100 tokens/s: 3 tokens fit 30 ms; the first prompt of the step still gets a block
    scheduler = make_scheduler(PrefillCap(BLOCK_SIZE, max_decode_gap_ms=40.0, step_times=measured_rates(100)))
    scheduler.add_request(make_request("decode", 4, max_tokens=50))
    run_step(scheduler)
    scheduler.add_request(make_request("a", 40, first_token=100))
    scheduler.add_request(make_request("b", 40, first_token=300))
    assert run_step(scheduler) == {"decode": 1, "a": BLOCK_SIZE}  # b waits: the step's time is spent
    assert run_step(scheduler) == {"decode": 1, "a": BLOCK_SIZE}


def test_an_unmeasured_engine_plans_with_the_low_prior():
    scheduler = make_scheduler(PrefillCap(BLOCK_SIZE, max_decode_gap_ms=40.0, step_times=StepTimeModel()))
    scheduler.add_request(make_request("decode", 4, max_tokens=50))
    run_step(scheduler)
    scheduler.add_request(make_request("long", 400, first_token=100))
    # the prior: a step's fixed cost STEP_PRIOR_S, then CAP_PRIOR_TOKENS_PER_S
    num_fit = int((40e-3 * STEP_TARGET_FRACTION - STEP_PRIOR_S) * CAP_PRIOR_TOKENS_PER_S)
    assert run_step(scheduler) == {"decode": 1, "long": num_fit // BLOCK_SIZE * BLOCK_SIZE}


def test_a_slower_machine_shrinks_the_cap():
    model = StepTimeModel()
    for _ in range(30):  # 1,000 tokens/s, no fixed cost
        model.observe_step([(100, 30)], 0.030)
        model.observe_step([(100, 10)], 0.010)
    scheduler = make_scheduler(PrefillCap(BLOCK_SIZE, max_decode_gap_ms=40.0, step_times=model))
    scheduler.add_request(make_request("decode", 4, max_tokens=80))
    run_step(scheduler)
    scheduler.add_request(make_request("long", 4000, first_token=100))
    # 30 tokens fit 30 ms (28 on a block boundary; the fit from two shapes is close, not exact)
    assert 24 <= run_step(scheduler)["long"] <= 28
    for _ in range(30):  # the machine slows down to 250 tokens/s
        model.observe_step([(100, 30)], 0.120)
        model.observe_step([(100, 10)], 0.040)
    assert run_step(scheduler)["long"] <= 8  # 7.5 tokens fit 30 ms


class LoadingConnector(KVConnectorScheduler):
    """Grants ``num_promised`` tier tokens to waiting requests named "hit*", whose load from
    the CPU tier runs at 10,000 tokens/s; "split*" requests recompute a head up to 40, then
    load their tail [40, 120) (the scheduler's rules, without any tier)."""

    def __init__(self, num_promised: int) -> None:
        self.num_promised = num_promised

    def grant(self, request, num_computed_tokens, seconds_left):
        if request.request_id.startswith("split") and num_computed_tokens < 40:
            return Grant(num_computed_tokens, 0, 40 - num_computed_tokens)
        if request.request_id.startswith("split") and num_computed_tokens == 40:
            return Grant(num_computed_tokens, 80, None, 80 / 10_000)
        waiting = request.status is not RequestStatus.RUNNING
        num_load = self.num_promised if waiting and request.request_id.startswith("hit") else 0
        return Grant(num_computed_tokens, num_load, None, num_load / 10_000)

    def update_state_after_alloc(self, request, block_ids, grant):
        pass

    def build_connector_meta(self, scheduled):
        return ConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False


H100_EAGER = dict(step_s=0.007, eager_step_s=0.045, tokens_per_s=90_000.0, seconds_per_pair=2e-10)


def test_an_eager_step_dearer_than_the_budget_still_gets_a_worthwhile_chunk():
    """The H100 case: a decode-only step (a CUDA graph) takes 7 ms, a step with prompt
    tokens runs eagerly and pays ~45 ms more whatever its tokens. No chunk fits a 50 ms
    gap (37.5 ms aimed at); the old rate model planned chunks of a few tokens that each cost
    a whole eager pass (a 16k prompt took 14-40 s). Now the chunk's tokens make at least a
    third of the step (26 ms of tokens on 52 ms of fixed costs: ~2,300 tokens near the
    start), and a lone prompt is not capped."""
    model = StepTimeModel.from_parameters(**H100_EAGER)
    step = PrefillCap(BLOCK_SIZE, max_decode_gap_ms=50.0, step_times=model).for_step(num_decoding=1)
    num_tokens = step.limit(272, 16384)
    fixed_s, tokens_s = model.split_seconds([(272, num_tokens)])
    assert fixed_s == pytest.approx(0.052) and tokens_s >= fixed_s / 2
    assert model.split_seconds([(272, num_tokens - BLOCK_SIZE)])[1] < fixed_s / 2  # the fewest such
    assert 2000 < num_tokens < 2600 and (272 + num_tokens) % BLOCK_SIZE == 0
    assert (
        PrefillCap(BLOCK_SIZE, max_decode_gap_ms=50.0, step_times=model)
        .for_step(num_decoding=0)
        .limit(272, 16384)
        == 16384
    )


def test_a_chunk_that_fits_a_cuda_graph_is_chosen_within_the_budget():
    """With graphs for steps of up to 512 tokens, a 512-token chunk costs 7 ms + its tokens
    (~13 ms): it fits the budget, a bigger (eager) one would not."""
    model = StepTimeModel.from_parameters(graph_token_limit=512, **H100_EAGER)
    step = PrefillCap(BLOCK_SIZE, max_decode_gap_ms=50.0, step_times=model).for_step(num_decoding=1)
    # the decode's token shares the graph: 511 prompt tokens, 508 on a block boundary
    assert step.limit(272, 16384) == 508
    deep = step.limit(16_000, 4000)  # deep in a prompt attention costs more: still a graph step
    assert 0 < deep <= 511 and model.step_seconds([(16_000, deep)]) <= 0.0375


def test_while_others_decode_a_prompt_stays_in_graph_sized_steps():
    """Even where the model says an eager chunk fits the budget (a generous 400 ms here),
    the cap keeps a prompt in graph-sized steps while others decode: an eager step's
    fixed cost is learned only from eager steps, and the first would overrun the budget.
    Two decoding requests and a chunk already in the step take their share of the graph."""
    model = StepTimeModel.from_parameters(graph_token_limit=512, **H100_EAGER)
    step = PrefillCap(BLOCK_SIZE, max_decode_gap_ms=400.0, step_times=model).for_step(num_decoding=2)
    assert model.step_seconds([(0, 8192)]) < 0.3  # an eager 8k chunk would fit
    assert step.limit(0, 8192) == 508  # 510 on a block boundary
    step.spend(0, 508)
    assert step.limit(0, 100) == 2  # the room left in the graph
    step.spend(0, 2)
    assert step.limit(0, 100) == 0  # the graph is full: the next prompt waits
    # nothing decoding: the full chunk
    assert (
        PrefillCap(BLOCK_SIZE, max_decode_gap_ms=400.0, step_times=model)
        .for_step(num_decoding=0)
        .limit(0, 8192)
        == 8192
    )


def test_a_low_fitted_token_rate_never_takes_the_first_chunk_out_of_the_graph():
    """The H100 case: a model whose fitted per-token cost is low (a 512-token chunk looks
    cheap beside the graph step's fixed cost, so "not worth its step") made the first capped
    chunk of a 16k prompt an eager one of 3,700-6,100 tokens that took 109-178 ms under a
    50 ms cap. With room in the graph, the chunk stays in it."""
    model = StepTimeModel.from_parameters(
        graph_token_limit=512, step_s=0.007, eager_step_s=0.045, tokens_per_s=400_000.0
    )
    step = PrefillCap(BLOCK_SIZE, max_decode_gap_ms=50.0, step_times=model).for_step(num_decoding=1)
    num_tokens = step.limit(0, 16384)
    assert 0 < num_tokens <= 511 and num_tokens % BLOCK_SIZE == 0
    assert model.step_seconds([(0, num_tokens)]) <= 0.05


def test_a_load_in_the_step_counts_against_the_prefill_time():
    cap = PrefillCap(BLOCK_SIZE, max_decode_gap_ms=40.0, step_times=measured_rates(1000))
    scheduler = Scheduler(
        BlockManager(512, BLOCK_SIZE, True), 8, 512, connector=LoadingConnector(80), prefill_cap=cap
    )
    scheduler.add_request(make_request("decode", 4, max_tokens=50))
    run_step(scheduler)
    scheduler.add_request(make_request("hit", 300, first_token=100))
    # 30 ms for the step: the 80 loaded tokens take 8 ms, 20 tokens of compute fit the rest
    # (28 without the load, test_prompt_chunks_are_capped_while_another_request_decodes...)
    assert run_step(scheduler) == {"decode": 1, "hit": 20}


def test_a_tail_loaded_in_the_step_counts_against_the_prefill_time():
    cap = PrefillCap(BLOCK_SIZE, max_decode_gap_ms=40.0, step_times=measured_rates(1000))
    scheduler = Scheduler(
        BlockManager(512, BLOCK_SIZE, True), 8, 512, connector=LoadingConnector(0), prefill_cap=cap
    )
    scheduler.add_request(make_request("decode", 4, max_tokens=50))
    run_step(scheduler)
    split = make_request("split", 300, first_token=100)
    scheduler.add_request(split)
    assert run_step(scheduler) == {"decode": 1, "split": 28}  # the head, capped
    assert run_step(scheduler) == {"decode": 1, "split": 12}  # up to the compute limit
    # the tail [40, 120) is loaded (8 ms) and 20 tokens computed after it: 30 ms in all
    assert run_step(scheduler) == {"decode": 1, "split": 20}
    assert split.num_computed_tokens == 140 and split.metrics.num_external_cached_tokens == 80


def test_long_prefill_token_threshold_caps_every_prompt_even_alone():
    scheduler = make_scheduler(PrefillCap(BLOCK_SIZE, long_prefill_token_threshold=32), budget=64)
    scheduler.add_request(make_request("a", 70))
    scheduler.add_request(make_request("b", 20, first_token=300))
    assert run_step(scheduler) == {"a": 32, "b": 20}
    assert run_step(scheduler) == {"a": 32, "b": 1}
    assert run_step(scheduler) == {"a": 6, "b": 1}


# ---- the engine: identical tokens, the cap held step by step --------------------------


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def run_staggered(engine: EngineCore) -> tuple[dict[str, list[int]], list[dict]]:
    """A short request decodes while three longer prompts arrive; per-step records of
    (prompt tokens, whether a decode ran)."""
    steps: list[dict] = []
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule(only=None):
        plan = schedule(only)
        decoding = [
            r
            for r, n in zip(plan.requests, plan.num_scheduled_tokens, strict=True)
            if r.output_token_ids and n == 1
        ]
        num_prompt = sum(
            n
            for r, n in zip(plan.requests, plan.num_scheduled_tokens, strict=True)
            if r.num_computed_tokens < r.num_prompt_tokens
        )
        steps.append({"num_prompt": num_prompt, "decoding": bool(decoding)})
        return plan

    scheduler.schedule = recording_schedule
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("short", random_prompt(20, seed=1), greedy)
    outputs: dict[str, list[int]] = {}
    arrivals = {2: ("p300", 300), 4: ("p150", 150), 5: ("p90", 90)}
    num_steps = 0
    while engine.has_unfinished_requests() or arrivals:
        if num_steps in arrivals:
            request_id, length = arrivals.pop(num_steps)
            engine.add_request(request_id, random_prompt(length, seed=length), greedy)
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.token_ids
        num_steps += 1
    return outputs, steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_tokens_are_identical_with_and_without_the_cap_and_the_cap_holds(llama_dir, device):
    common = dict(dtype="float32", device=device, max_num_batched_tokens=256, num_gpu_blocks=128)
    uncapped, uncapped_steps = run_staggered(LLM(llama_dir, max_decode_gap_ms=0, **common).engine)
    capped_engine = LLM(llama_dir, max_decode_gap_ms=1.0, **common).engine
    # The cap plans with a machine of known speed (40,000 tokens/s, no fixed cost: 30 tokens
    # fit 0.75 ms): on this CPU a tiny model's steps are mostly fixed cost, and the cap
    # would rightly give whole prompts. The engine's own model still learns (checked below).
    scheduler = capped_engine.scheduler
    scheduler.prefill_cap = dataclasses.replace(
        scheduler.prefill_cap, step_times=StepTimeModel.from_parameters(step_s=0.0, tokens_per_s=40_000.0)
    )
    capped, capped_steps = run_staggered(capped_engine)
    assert set(capped) == {"short", "p300", "p150", "p90"}
    assert capped == uncapped
    block_size = EngineArgs().block_size
    decode_steps = [s for s in capped_steps if s["decoding"] and s["num_prompt"]]
    assert decode_steps, "no prompt was computed while a request decoded"
    num_fit = int(1.0e-3 * STEP_TARGET_FRACTION * 40_000.0)  # 30 tokens in 0.75 ms
    for step in decode_steps:
        assert step["num_prompt"] <= max(block_size, num_fit), step
    # without the cap those steps held far more prompt tokens
    assert max(s["num_prompt"] for s in uncapped_steps if s["decoding"]) > max(block_size, num_fit)
    # the engine's steps fitted its step-time model
    assert capped_engine.step_times.num_prefill_steps > 0 and capped_engine.step_times.fixed_step_s > 0
    # nothing decodes in the first step: the lone prompt took its whole chunk
    assert capped_steps[0] == {"num_prompt": 20, "decoding": False}


def test_the_cap_with_async_scheduling_gives_identical_tokens(llama_dir):
    common = dict(dtype="float32", device="cpu", max_num_batched_tokens=256, num_gpu_blocks=128)
    plain, _ = run_staggered(LLM(llama_dir, max_decode_gap_ms=0, **common).engine)
    capped, steps = run_staggered(
        LLM(llama_dir, max_decode_gap_ms=1.0, async_scheduling=True, **common).engine
    )
    assert capped == plain
    assert any(s["decoding"] and s["num_prompt"] for s in steps)


def plans_of(engine: EngineCore, prompts: dict[str, int]) -> list[dict[str, int]]:
    """The prompts (request id -> length, all added at once) run to their end: per step, the
    tokens scheduled for each request."""
    plans: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule(only=None):
        plan = schedule(only)
        plans.append(dict(zip([r.request_id for r in plan.requests], plan.num_scheduled_tokens, strict=True)))
        return plan

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for request_id, length in prompts.items():
        engine.add_request(request_id, random_prompt(length, seed=len(request_id) * 1000 + length), params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.schedule = schedule
    return plans


def test_serves_default_cap_leaves_a_prompt_with_nothing_decoding_alone(llama_dir):
    """`kvstash serve`'s default cap (50 ms) on a machine where it would cut a prompt beside
    a decode to 32 tokens (1,000 tokens/s): a lone prompt, and prompts that arrive together
    while nothing decodes, get the steps they get with the cap off; a prompt's chunks are cut
    only in the steps where another request decodes (docs/serving.md, "Decode gaps")."""
    from engine.server.cli import SERVE_MAX_DECODE_GAP_MS

    common = dict(dtype="float32", device="cpu", max_num_batched_tokens=256, num_gpu_blocks=128)
    capped = LLM(llama_dir, max_decode_gap_ms=SERVE_MAX_DECODE_GAP_MS, **common).engine
    capped.scheduler.prefill_cap = dataclasses.replace(
        capped.scheduler.prefill_cap, step_times=measured_rates(1000)
    )
    uncapped = LLM(llama_dir, max_decode_gap_ms=0, **common).engine
    lone = [{"long": 256}, {"long": 256}, {"long": 88}, {"long": 1}, {"long": 1}]
    assert plans_of(capped, {"long": 600}) == plans_of(uncapped, {"long": 600}) == lone
    together = [{"a": 256}, {"a": 44, "b": 200}, {"a": 1, "b": 1}, {"a": 1, "b": 1}]
    assert plans_of(capped, {"a": 300, "b": 200}) == plans_of(uncapped, {"a": 300, "b": 200}) == together
    # "short" decodes from the second step on: "long" is capped (26 tokens to a block
    # boundary, then 32) until "short" is done, then has full chunks again
    assert plans_of(capped, {"short": 10, "longer": 600}) == [
        {"short": 10, "longer": 246},
        {"short": 1, "longer": 26},
        {"short": 1, "longer": 32},
        {"longer": 256},
        {"longer": 40},
        {"longer": 1},
        {"longer": 1},
    ]


def test_the_threshold_gives_identical_tokens(llama_dir):
    common = dict(
        dtype="float32", device="cpu", max_num_batched_tokens=256, num_gpu_blocks=128, max_decode_gap_ms=0
    )
    plain, _ = run_staggered(LLM(llama_dir, **common).engine)
    capped, steps = run_staggered(LLM(llama_dir, long_prefill_token_threshold=24, **common).engine)
    assert capped == plain
    assert max(s["num_prompt"] for s in steps) <= 3 * 24  # at most three prompts at once, 24 each


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be an integer >= 0"),
        ({"long_prefill_token_threshold": 2.5}, "long_prefill_token_threshold must be an integer >= 0"),
        ({"long_prefill_token_threshold": True}, "long_prefill_token_threshold must be an integer >= 0"),
        ({"max_decode_gap_ms": -5}, r"max_decode_gap_ms must be 0 \(off\) or a finite number"),
        ({"max_decode_gap_ms": 0.5}, r"max_decode_gap_ms must be 0 \(off\) or a finite number"),
        ({"max_decode_gap_ms": math.nan}, r"max_decode_gap_ms must be 0 \(off\) or a finite number"),
        ({"max_decode_gap_ms": math.inf}, r"max_decode_gap_ms must be 0 \(off\) or a finite number"),
        ({"max_decode_gap_ms": "50"}, r"max_decode_gap_ms must be 0 \(off\) or a finite number"),
    ],
)
def test_bad_cap_values_are_rejected_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).validate()


def test_the_cli_flags_reach_the_engine_and_bad_ones_are_reported(llama_dir):
    from click.testing import CliRunner

    from engine.cli import main

    result = CliRunner().invoke(
        main, ["generate", str(llama_dir), "--prompt", "hi", "--device", "cpu", "--max-decode-gap-ms", "-1"]
    )
    assert result.exit_code != 0
    assert "max_decode_gap_ms must be 0 (off)" in result.output
    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(llama_dir),
            "--prompt",
            "hi",
            "--device",
            "cpu",
            "--long-prefill-token-threshold",
            "-3",
        ],
    )
    assert result.exit_code != 0
    assert "long_prefill_token_threshold must be an integer >= 0" in result.output
    result = CliRunner().invoke(
        main,
        ["generate", str(llama_dir), "--prompt", "hi", "--device", "cpu", "--dtype", "float32"]
        + [
            "--max-tokens",
            "2",
            "--ignore-eos",
            "--long-prefill-token-threshold",
            "16",
            "--max-decode-gap-ms",
            "30",
        ],
    )
    assert result.exit_code == 0, result.output
