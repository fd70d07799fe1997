"""Loads sized by the prefill cap (issue #15, "a co-running decode's longest gap <= 50 ms
while another request's KV is fetched"): while a request decodes, a step loads only the
whole chunks of a CPU-tier hit or of a fetched tail that fit its time left, at least one;
the rest loads in the next steps, the request computing nothing until it is all in.
Without a cap (or with nothing decoding) a hit still loads in one step.

A real tiny engine (float32, greedy, CPU) through ``engine.LLM`` with real tiers (the CPU
tier; a disk folder for fetched hits). The CPU tier's load rate is measured once by a
warm-up load and then frozen (the planner's moving average with weight 0), so the
chunks a step's time holds are known exactly; the step-time model is a known one (no
fixed cost), so the step's time left is the cap's whole budget. Assertions count
tokens per step, never wall-clock time."""

from __future__ import annotations

import dataclasses

import pytest

from connector import OffloadConfig
from engine import SamplingParams
from engine.prefill_cap import STEP_TARGET_FRACTION
from engine.step_time import StepTimeModel
from tests.connector.kv_helpers import ANSWERED_LOOKUP_WAIT_S
from tests.connector.test_async_loads import close, connector_of, make_prompt, new_llm, write_to

CHUNK_SIZE = 32
PROMPT_LEN = 256  # a hit of 255 tokens: 8 chunks, the last one short of a token
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
#: the step's time budget, in chunks' worth of CPU-tier load time: two whole chunks fit
BUDGET_CHUNKS = 2.5
NUM_FIT = 2 * CHUNK_SIZE
#: what each step loads of the hit under the cap: two chunks, then the 63 tokens left
CAPPED_PIECES = [NUM_FIT, NUM_FIT, NUM_FIT, PROMPT_LEN - 1 - 3 * NUM_FIT]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def cpu_config(**fields) -> OffloadConfig:
    return OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=32 << 20, lookup_wait_s=ANSWERED_LOOKUP_WAIT_S, **fields
    )


def disk_config(path, *, pipelined_loads: bool = False) -> OffloadConfig:
    # pipelined loads off: the fetch ends before the request is admitted with all of it
    return cpu_config(disk_path=str(path), load_policy="always", pipelined_loads=pipelined_loads)


class CappedEngine:
    """An engine whose cap holds ``BUDGET_CHUNKS`` chunks' worth of CPU-tier load per step
    while a request decodes (``capped=False``: the cap off), recording what each step loads."""

    def __init__(
        self, model_dir, config: OffloadConfig, *, capped: bool = True, device: str = "cpu", **engine_args
    ) -> None:
        self.llm = new_llm(model_dir, config, max_decode_gap_ms=1.0, device=device, **engine_args)
        self.engine = self.llm.engine
        self.connector = connector_of(self.llm)
        planner = self.connector.planner
        assert "tier:cpu" not in planner.snapshot()  # not measured yet (its average is made below)
        planner.alpha = 0.0  # the CPU tier's rate: its first measurement, from then on
        warm = make_prompt(2 * CHUNK_SIZE + 1, 99)
        self.llm.generate([warm], PARAMS)
        self.llm.generate([warm], PARAMS)  # a CPU-tier hit: its load measures the rate
        assert planner.snapshot()["tier:cpu"] != planner.tier_priors["cpu"]
        self.budget_s = BUDGET_CHUNKS * self.connector.estimate_load_seconds(CHUNK_SIZE)
        scheduler = self.engine.scheduler
        scheduler.prefill_cap = dataclasses.replace(
            scheduler.prefill_cap,
            max_decode_gap_ms=self.budget_s / STEP_TARGET_FRACTION * 1e3 if capped else 0.0,
            step_times=StepTimeModel.from_parameters(step_s=0.0, tokens_per_s=1e9),
        )
        #: per step that loaded some of the hit: (tokens, whether the decode ran in it)
        self.hit_loads: list[tuple[int, bool]] = []
        schedule = scheduler.schedule

        def recording_schedule(*args, **kwargs):
            plan = schedule(*args, **kwargs)
            loads = plan.connector_meta.loads if plan.connector_meta is not None else []
            num_hit = sum(s.num_load_end - s.num_load_start for s in loads if s.request_id == "hit")
            if num_hit:
                self.hit_loads.append((num_hit, any(r.request_id == "decode" for r in plan.requests)))
            return plan

        scheduler.schedule = recording_schedule

    def start_decode(self) -> None:
        self.engine.add_request(
            "decode", make_prompt(20, 9), SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        )
        while not self.engine.step():
            pass  # its first token: it decodes from now on

    def step_until_partly_loaded(self, max_steps: int = 10_000):
        """Step until the hit runs with part of its KV loaded, the rest still to come."""
        request = self.engine.requests["hit"]
        for _ in range(max_steps):
            self.engine.step()
            if request.num_computed_tokens > 0 and not request.output_token_ids:
                return request
        raise AssertionError("the hit never ran partly loaded")

    def run_hit(self, max_steps: int = 10_000):
        for _ in range(max_steps):
            for output in self.engine.step():
                if output.request_id == "hit" and output.finished:
                    return output
        raise AssertionError("the hit did not finish")

    def cpu_pins(self) -> dict[str, int]:
        return self.engine.offload_cache_engine.tiers.cpu.pin_counts()

    def close(self) -> None:
        if "decode" in self.engine.requests:
            self.engine.abort_request("decode")
        close(self.llm)


def make_source(name: str, model_dir, tmp_path, device: str = "cpu"):
    """Where the hit's KV is, and a factory of capped engines that find it there. "cpu": in
    the engine's CPU tier, loaded at admission; "disk": in a disk folder, fetched into the
    CPU tier first, then loaded once the fetch ended; "disk-pipelined": the same, loading
    what arrived while the rest is read (how much arrived by a step depends on timing)."""
    prompt = make_prompt(PROMPT_LEN, 31)
    if name == "cpu":
        config = cpu_config()

        def make(**kwargs) -> CappedEngine:
            capped = CappedEngine(model_dir, config, device=device, **kwargs)
            capped.llm.generate([prompt], PARAMS)  # now in its CPU tier
            return capped

        return "cpu", prompt, make
    config = disk_config(tmp_path, pipelined_loads=name == "disk-pipelined")
    writer = new_llm(model_dir, config, device=device)  # the KV of the device that loads it
    writer.generate([prompt], PARAMS)
    writer.flush_kv_offload()
    close(writer)
    return "disk", prompt, lambda **kwargs: CappedEngine(model_dir, config, device=device, **kwargs)


@pytest.fixture(params=["cpu", "disk"])
def source(request, model_dir, tmp_path):
    return make_source(request.param, model_dir, tmp_path)


def assert_each_piece_fits(engine: CappedEngine, pieces: list[int]) -> None:
    """Each step loaded whole chunks that fit its time, or one chunk, or the last piece."""
    assert sum(pieces) == PROMPT_LEN - 1
    num_done = 0
    for num in pieces:
        assert engine.connector.estimate_load_seconds(num) <= engine.budget_s or num <= CHUNK_SIZE, pieces
        assert num >= min(CHUNK_SIZE, PROMPT_LEN - 1 - num_done), pieces
        num_done += num


@pytest.mark.parametrize(
    ("name", "device"),
    [
        ("cpu", "cpu"),
        ("disk", "cpu"),
        ("disk-pipelined", "cpu"),
        pytest.param("cpu", "cuda", marks=pytest.mark.gpu),
        pytest.param("disk", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_a_hit_loads_over_several_steps_within_the_cap_with_identical_tokens(
    model_dir, tmp_path, name, device
):
    tier, prompt, make = make_source(name, model_dir, tmp_path, device)
    baseline = new_llm(model_dir, None, device=device).generate([prompt], PARAMS)[0].token_ids
    for capped in (True, False):
        engine = make(capped=capped)
        engine.start_decode()
        engine.engine.add_request("hit", prompt, PARAMS)
        output = engine.run_hit()
        assert output.token_ids == baseline
        assert output.metrics.tier_to_loaded_tokens == {tier: PROMPT_LEN - 1}
        assert output.metrics.num_external_cached_tokens == PROMPT_LEN - 1
        pieces = [num for num, _ in engine.hit_loads]
        if capped:
            # Each step loads what its time holds (two whole chunks), at least a chunk,
            # while the decode gets its token in it; then the rest.
            assert_each_piece_fits(engine, pieces)
            assert len(pieces) >= 4
            if name != "disk-pipelined":
                assert pieces == CAPPED_PIECES
            assert all(decoded for _, decoded in engine.hit_loads)
        elif name != "disk-pipelined":
            assert pieces == [PROMPT_LEN - 1]  # as before: the whole hit in one step
        assert engine.connector.request_stats("hit").num_loaded_tokens == PROMPT_LEN - 1
        engine.close()
        assert engine.cpu_pins() == {}


@pytest.mark.parametrize("name", ["cpu", "disk"])
def test_capped_loads_with_async_scheduling_give_identical_tokens(model_dir, tmp_path, name):
    """The batch queue schedules step N+1 while step N runs: the next piece is planned
    from the position the piece in flight loads to."""
    tier, prompt, make = make_source(name, model_dir, tmp_path)
    baseline = new_llm(model_dir, None).generate([prompt], PARAMS)[0].token_ids
    engine = make(async_scheduling=True)
    engine.start_decode()
    engine.engine.add_request("hit", prompt, PARAMS)
    output = engine.run_hit()
    assert output.token_ids == baseline
    assert output.metrics.tier_to_loaded_tokens == {tier: PROMPT_LEN - 1}
    assert [num for num, _ in engine.hit_loads] == CAPPED_PIECES
    engine.close()
    assert engine.cpu_pins() == {}


def test_at_least_one_chunk_loads_per_step_when_none_fits(model_dir, source):
    tier, prompt, make = source
    engine = make()
    scheduler = engine.engine.scheduler
    # a budget with no time for loads at all
    scheduler.prefill_cap = dataclasses.replace(scheduler.prefill_cap, max_decode_gap_ms=1e-9)
    engine.start_decode()
    engine.engine.add_request("hit", prompt, PARAMS)
    output = engine.run_hit()
    assert [num for num, _ in engine.hit_loads] == [CHUNK_SIZE] * 7 + [CHUNK_SIZE - 1]
    assert output.metrics.tier_to_loaded_tokens == {tier: PROMPT_LEN - 1}
    engine.close()
    assert engine.cpu_pins() == {}


def _partly_loaded_hit(model_dir, source):
    """-> (recomputed tokens of the source's prompt, its engine with a decode running and
    the hit partly loaded, the hit's request)."""
    _, prompt, make = source
    baseline = new_llm(model_dir, None).generate([prompt], PARAMS)[0].token_ids
    engine = make()
    engine.start_decode()
    engine.engine.add_request("hit", prompt, PARAMS)
    return baseline, engine, engine.step_until_partly_loaded()


def test_abort_while_partly_loaded_releases_everything(model_dir, source):
    prompt = source[1]
    baseline, engine, request = _partly_loaded_hit(model_dir, source)
    assert request.num_computed_tokens == NUM_FIT and request.block_ids
    assert engine.cpu_pins()  # the rest is held for it
    engine.engine.abort_request("hit")
    engine.engine.abort_request("decode")
    assert engine.connector.registry.get("hit") is None
    assert not engine.engine.has_unfinished_requests()
    block_manager = engine.engine.scheduler.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert engine.cpu_pins() == {}
    assert engine.engine.offload_cache_engine.tiers.num_pinned() == 0
    assert engine.llm.generate([prompt], PARAMS)[0].token_ids == baseline
    close(engine.llm)


def test_preempted_while_partly_loaded_the_request_starts_over_with_identical_tokens(model_dir, source):
    tier = source[0]
    baseline, engine, request = _partly_loaded_hit(model_dir, source)
    assert request.num_computed_tokens == NUM_FIT
    scheduler = engine.engine.scheduler
    scheduler.running.remove(request)
    scheduler._preempt(request)  # as when blocks run out
    output = engine.run_hit()
    assert output.token_ids == baseline
    # readmitted, its hit is in the CPU tier now, and loads in capped pieces again
    assert [num for num, _ in engine.hit_loads] == [NUM_FIT, *CAPPED_PIECES]
    # the first piece came from where the hit was, the rest from the CPU tier after it
    expected = (
        {"disk": NUM_FIT, "cpu": PROMPT_LEN - 1} if tier == "disk" else {"cpu": NUM_FIT + PROMPT_LEN - 1}
    )
    assert engine.connector.request_stats("hit").tier_to_loaded_tokens == expected
    engine.close()
    assert engine.cpu_pins() == {}


def test_a_cpu_prefix_cut_short_then_a_head_recomputed_while_the_tail_is_fetched(model_dir, tmp_path):
    """The planner's split: the CPU tier's chunks loaded at admission, a head recomputed
    while the disk's chunks after it are fetched, those loaded at the head's end. Under the
    cap the CPU part loads over two steps computing nothing, then the head is computed,
    then the fetched tail loads in pieces that fit."""
    prompt = make_prompt(PROMPT_LEN, 41)
    baseline = new_llm(model_dir, None).generate([prompt], PARAMS)[0].token_ids
    config = cpu_config(disk_path=str(tmp_path), tier_probe_interval_s=0.0)
    write_to(model_dir, config, [prompt])
    engine = CappedEngine(model_dir, config)
    planner = engine.connector.planner
    # The planner's view: recomputing runs at 1,000 tokens/s, the disk reads 1 MB/s (a
    # chunk in 16 ms): the best plan recomputes chunk 4 while chunks 5-7 are fetched.
    planner.step_times = StepTimeModel.from_parameters(step_s=0.0, tokens_per_s=1_000.0)
    with planner.forced_loading():  # its first four chunks read into the CPU tier
        engine.llm.generate([prompt[: 4 * CHUNK_SIZE] + [7]], PARAMS)
    planner.observe_read("disk", 1_000_000, 1.0)  # after that fetch's own measurement: the latest
    engine.start_decode()
    engine.engine.add_request("hit", prompt, PARAMS)
    request = engine.engine.requests["hit"]
    computed_after_step = []
    output = None
    while output is None:
        output = next((o for o in engine.engine.step() if o.request_id == "hit" and o.finished), None)
        computed_after_step.append(request.num_computed_tokens)
    assert output.token_ids == baseline
    assert output.metrics.tier_to_loaded_tokens["cpu"] == 4 * CHUNK_SIZE
    plan = engine.connector.request_stats("hit").plan
    assert "recompute=33" in plan, plan  # chunk 4 and the last token
    # two steps load the CPU part, computing nothing; the head follows
    assert computed_after_step[:3] == [NUM_FIT, 2 * NUM_FIT, 5 * CHUNK_SIZE], computed_after_step
    pieces = [num for num, _ in engine.hit_loads]
    assert pieces[:2] == [NUM_FIT, NUM_FIT]
    for num in pieces:
        assert engine.connector.estimate_load_seconds(num) <= engine.budget_s or num <= CHUNK_SIZE, pieces
    engine.close()
    assert engine.cpu_pins() == {}


@pytest.mark.parametrize("name", ["cpu", "disk"])
def test_with_nothing_decoding_a_hit_still_loads_in_one_step(model_dir, tmp_path, name):
    tier, prompt, make = make_source(name, model_dir, tmp_path)
    engine = make()  # the cap is on, but only applies while another request decodes
    engine.engine.add_request("hit", prompt, PARAMS)
    output = engine.run_hit()
    assert [num for num, _ in engine.hit_loads] == [PROMPT_LEN - 1]
    assert output.metrics.tier_to_loaded_tokens == {tier: PROMPT_LEN - 1}
    engine.close()
    assert engine.cpu_pins() == {}


def test_fit_load_tokens_takes_whole_chunks_within_the_time_and_at_least_the_first():
    import torch

    from connector import create_kv_connector

    scheduler, worker = create_kv_connector(
        cpu_config(),
        model_id="fit-load-tokens",
        dtype=torch.float32,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=16,
        device=torch.device("cpu"),
        step_times=StepTimeModel(),
    )
    # a CPU tier that loads 1,000 tokens per second (its prior: nothing measured yet)
    scheduler.planner.tier_priors["cpu"] = 1_000 * scheduler.index.geometry.bytes_per_token
    assert scheduler.estimate_load_seconds(500) == pytest.approx(0.5)
    fit = scheduler.fit_load_tokens
    assert fit(0, 500, None) == 500  # no time cap: all of it
    assert fit(0, 500, 0.5) == 500  # it all fits
    assert fit(0, 500, 0.1) == 3 * CHUNK_SIZE  # 100 tokens fit: three whole chunks
    assert fit(48, 500, 0.1) == 128 - 48  # from mid-chunk: up to a chunk boundary (148 fit)
    assert fit(0, 500, 0.0) == CHUNK_SIZE  # nothing fits: the first chunk
    assert fit(48, 500, 0.0) == 64 - 48  # the rest of the first chunk
    assert fit(48, 10, 0.0) == 10  # all it has is within its first chunk
    assert fit(0, 0, 0.0) == 0
    worker.close()
