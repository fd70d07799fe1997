"""Scheduler and block-manager rules (docs/architecture.md, Engine), without a model: one token budget
per step, chunked prefill, max_num_seqs, preemption by recompute, prefix hits."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from connector.base import ConnectorMetadata, Grant, KVConnectorScheduler
from engine.block_manager import LOOKUP_BATCH_BLOCKS, BlockManager, hash_block, root_hash
from engine.config import SamplingParams
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

BLOCK_SIZE = 4


def make_request(
    request_id: str, num_prompt_tokens: int, first_token: int = 10, max_tokens: int = 8
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + num_prompt_tokens)),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        eos_token_ids=frozenset({0}),
        max_model_len=1000,
    )


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=16, prefix_caching=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK_SIZE, prefix_caching), max_num_seqs, budget)


def plan_of(output) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)}


def run_step(scheduler: Scheduler, token: int = 7):
    """Schedule once and feed back `token` for every request the runner would sample."""
    output = scheduler.schedule()
    sampled = {
        r.request_id: token
        for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)
        if r.num_computed_tokens + n == r.num_tokens
    }
    updated = scheduler.update_from_output(output, sampled)
    return output, updated


def test_long_prompt_is_chunked_and_stays_running_without_output():
    scheduler = make_scheduler(budget=16)
    request = make_request("a", 40)
    scheduler.add_request(request)
    for step, expected_computed in enumerate([16, 32]):
        output, updated = run_step(scheduler)
        assert plan_of(output) == {"a": 16}, f"step {step}"
        assert updated == [] and request.output_token_ids == []  # non-final chunk: no token
        assert request.status is RequestStatus.RUNNING and scheduler.running == [request]
        assert request.num_computed_tokens == expected_computed
    output, updated = run_step(scheduler)
    assert plan_of(output) == {"a": 8}  # the last chunk, then one sampled token
    assert updated == [request] and request.output_token_ids == [7]
    output, _ = run_step(scheduler)
    assert plan_of(output) == {"a": 1}  # decode: one token per step


def test_requests_share_the_budget_running_first():
    scheduler = make_scheduler(budget=16)
    a, b = make_request("a", 10), make_request("b", 30, first_token=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    output, updated = run_step(scheduler)
    # a's whole prompt, then b gets what is left of the budget as its first chunk
    assert plan_of(output) == {"a": 10, "b": 6}
    assert [r.request_id for r in updated] == ["a"]
    output, _ = run_step(scheduler)
    assert plan_of(output) == {"a": 1, "b": 15}  # running requests in arrival order
    output, updated = run_step(scheduler)
    assert plan_of(output) == {"a": 1, "b": 9}
    assert {r.request_id for r in updated} == {"a", "b"}
    assert b.num_computed_tokens == 30 and b.output_token_ids == [7]


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2, budget=100)
    requests = [make_request(str(i), 5, first_token=20 * i + 1) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert set(plan_of(output)) == {"0", "1"}
    assert list(scheduler.waiting) == [requests[2]]


def test_preemption_frees_blocks_and_recomputes_from_the_front_of_waiting():
    # 6 blocks of 4 tokens; two requests of 8 tokens take 4 blocks, each grows to 20 tokens (5 blocks)
    scheduler = make_scheduler(num_blocks=6, budget=64, prefix_caching=False)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, first_token=50, max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(10):
        output, _ = run_step(scheduler)
        if output.preempted_request_ids:
            break
    assert output.preempted_request_ids == ["b"]  # the latest arrival goes first
    # b keeps its generated tokens and will recompute prompt + outputs from 0
    assert b.status is RequestStatus.PREEMPTED and b.output_token_ids
    assert b.num_computed_tokens == 0 and b.block_ids == [] and scheduler.waiting[0] is b
    assert plan_of(output) == {"a": 1}
    assert a.status is RequestStatus.RUNNING
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert len(a.output_token_ids) == len(b.output_token_ids) == 12
    assert scheduler.block_manager.num_free_blocks == 6


def test_prefix_hit_leaves_the_last_token_to_compute():
    scheduler = make_scheduler(budget=64)
    first = make_request("first", 12)  # exactly 3 full blocks
    scheduler.add_request(first)
    run_step(scheduler)
    first_block_ids = list(first.block_ids)
    scheduler.finish_request(first, "abort")
    again = make_request("again", 12)
    scheduler.add_request(again)
    output, updated = run_step(scheduler)
    # all 3 blocks are reused; the last token still runs to give logits, reading its KV
    # from the shared block (the runner leaves that block unwritten)
    assert again.metrics.num_local_cached_tokens == 11
    assert again.block_ids == first_block_ids and again.num_cached_blocks == 3
    assert plan_of(output) == {"again": 1}
    assert updated == [again]


def test_prefix_hit_shares_blocks_and_lru_keeps_them_until_reused():
    manager = BlockManager(8, BLOCK_SIZE, True)
    scheduler = Scheduler(manager, 8, 64)
    a = make_request("a", 9)
    scheduler.add_request(a)
    run_step(scheduler)
    a_blocks = list(a.block_ids)
    b = make_request("b", 9)  # same tokens as a
    scheduler.add_request(b)
    run_step(scheduler)
    assert b.block_ids[:2] == a_blocks[:2]  # the two full blocks are shared
    assert manager.ref_counts[a_blocks[0]] == 2
    scheduler.finish_request(a, "abort")
    scheduler.finish_request(b, "abort")
    assert manager.num_free_blocks == 8
    # freed blocks with cached contents are evicted last: a new request takes the others first
    c = make_request("c", 12, first_token=300)
    scheduler.add_request(c)
    run_step(scheduler)
    assert not set(c.block_ids) & set(a_blocks[:2])
    assert manager.find_cached_prefix(make_request("d", 9)) == a_blocks[:2]


def test_block_hash_is_a_blake2b_chain_over_little_endian_int64():
    tokens = [1, 2, 3, 70000]
    parent = b"p" * 16
    expected = hashlib.blake2b(parent + np.array(tokens, dtype="<i8").tobytes(), digest_size=16).digest()
    assert hash_block(parent, tokens) == expected
    assert hash_block(parent, tokens) != hash_block(b"q" * 16, tokens)


def test_request_block_hashes_are_the_hash_block_chain_also_when_extended():
    manager = BlockManager(64, BLOCK_SIZE, True)
    request = make_request("a", 3 * BLOCK_SIZE + 2, first_token=65530)  # ids past 2**16
    manager.hash_blocks(request)
    request.all_token_ids.extend(range(7, 7 + 2 * BLOCK_SIZE))  # decoded tokens: two more blocks
    manager.hash_blocks(request)
    tokens = request.all_token_ids
    parent, expected = root_hash(None), []
    for start in range(0, len(tokens) // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE):
        parent = hash_block(parent, tokens[start : start + BLOCK_SIZE])
        expected.append(parent)
    assert len(expected) == 5
    assert request.block_hashes == expected


def test_a_prefix_search_hashes_only_as_far_as_it_goes():
    manager = BlockManager(256, BLOCK_SIZE, True)
    num_blocks = 3 * LOOKUP_BATCH_BLOCKS + 5
    miss = make_request("miss", num_blocks * BLOCK_SIZE + 1)
    assert manager.find_cached_prefix(miss) == []
    assert len(miss.block_hashes) == LOOKUP_BATCH_BLOCKS  # one batch, not the whole chain
    manager.hash_blocks(miss)
    assert len(miss.block_hashes) == num_blocks

    # a cached prefix longer than several batches is still found whole
    owner = make_request("owner", num_blocks * BLOCK_SIZE + 1)
    assert manager.allocate_slots(owner, owner.num_tokens)
    owner.num_computed_tokens = owner.num_tokens
    manager.cache_computed_blocks(owner)
    twin = make_request("twin", num_blocks * BLOCK_SIZE + 1)
    assert twin.all_token_ids == owner.all_token_ids
    assert manager.find_cached_prefix(twin) == owner.block_ids[:num_blocks]
    assert twin.block_hashes == owner.block_hashes[: len(twin.block_hashes)]


def test_allocation_failure_changes_nothing():
    manager = BlockManager(2, BLOCK_SIZE, True)
    request = make_request("a", 20)
    assert manager.allocate_slots(request, 20) is False
    assert request.block_ids == [] and manager.num_free_blocks == 2


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0)])
def test_block_manager_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size, True)


class RecordingConnector(KVConnectorScheduler):
    """A scheduler-side connector that grants `num_promised` external tokens to waiting
    requests and records the engine's calls (the call contract, without any tier)."""

    def __init__(self, num_promised: int, delay_free: bool = False) -> None:
        self.num_promised = num_promised
        self.delay_free = delay_free
        self.calls: list[tuple] = []

    def grant(self, request, num_computed_tokens, seconds_left):
        self.calls.append(("ask", request.request_id, num_computed_tokens))
        if request.status is RequestStatus.RUNNING:
            return Grant(num_computed_tokens)
        return Grant(num_computed_tokens, self.num_promised)

    def update_state_after_alloc(self, request, block_ids, grant):
        self.calls.append(("alloc", request.request_id, len(block_ids), grant))

    def build_connector_meta(self, scheduled):
        self.calls.append(
            ("meta", [(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in scheduled])
        )
        return ConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, len(block_ids)))
        return self.delay_free


def test_connector_calls_follow_the_contract_and_external_tokens_count_as_computed():
    connector = RecordingConnector(num_promised=8)
    scheduler = Scheduler(BlockManager(16, BLOCK_SIZE, True), 8, 64, connector=connector)
    request = make_request("a", 12, max_tokens=1)
    scheduler.add_request(request)
    output, updated = run_step(scheduler)
    # 8 tokens come from the tiers: only the last 4 run; blocks cover all 12
    assert connector.calls[:3] == [("ask", "a", 0), ("alloc", "a", 3, Grant(0, 8)), ("meta", [("a", 8, 4)])]
    assert plan_of(output) == {"a": 4} and request.metrics.num_external_cached_tokens == 8
    assert updated == [request] and request.is_finished
    assert connector.calls[3] == ("finished", "a", 3)


def test_an_over_promising_connector_still_leaves_the_last_token_to_compute():
    scheduler = Scheduler(
        BlockManager(16, BLOCK_SIZE, True), 8, 64, connector=RecordingConnector(num_promised=50)
    )
    request = make_request("a", 12)
    scheduler.add_request(request)
    output, updated = run_step(scheduler)
    assert plan_of(output) == {"a": 1} and updated == [request]


def test_load_failure_rolls_back_to_the_valid_length_and_drops_the_output():
    scheduler = Scheduler(
        BlockManager(16, BLOCK_SIZE, True), 8, 64, connector=RecordingConnector(num_promised=8)
    )
    request = make_request("a", 12)
    scheduler.add_request(request)
    output = scheduler.schedule()
    updated = scheduler.update_from_output(output, {"a": 7}, load_failures={"a": 4})
    assert updated == [] and request.output_token_ids == []
    assert request.num_computed_tokens == 4 and request.metrics.num_external_cached_tokens == 4
    output, updated = run_step(scheduler)
    assert plan_of(output) == {"a": 8} and updated == [request]  # recomputed from token 4


def test_delayed_free_keeps_blocks_until_the_save_finishes():
    manager = BlockManager(16, BLOCK_SIZE, True)
    scheduler = Scheduler(manager, 8, 64, connector=RecordingConnector(num_promised=0, delay_free=True))
    request = make_request("a", 12, max_tokens=1)
    scheduler.add_request(request)
    run_step(scheduler)
    assert request.is_finished and manager.num_free_blocks == 16 - 3
    assert scheduler.has_unfinished_requests()  # blocks still read by the save
    output = scheduler.schedule()
    assert output.finished_request_ids == {"a"}
    scheduler.update_from_output(output, {}, finished_sending_ids={"a"})
    assert manager.num_free_blocks == 16 and not scheduler.has_unfinished_requests()


class PartialFetchConnector(RecordingConnector):
    """A connector whose fetch for "a" delivers ``ready_ends`` tokens, one entry per step
    (pipelined loads): admitted at the first, then loads up to each next one computing
    nothing, until the last, which is final. The scheduler's rules, without any tier."""

    def __init__(self, ready_ends: list[int]) -> None:
        super().__init__(num_promised=0)
        self.ready_ends = ready_ends
        self.loaded_end = None  # the request's compute limit once admitted

    def grant(self, request, num_computed_tokens, seconds_left):
        self.calls.append(("ask", request.request_id, num_computed_tokens))
        if self.loaded_end is None:  # admitted to load the first part, computing nothing
            return Grant(num_computed_tokens, self.ready_ends[0] - num_computed_tokens, 0)
        if len(self.ready_ends) == 1:
            return Grant(num_computed_tokens)  # all loaded: no limit
        if num_computed_tokens < self.loaded_end:
            return Grant(num_computed_tokens, 0, self.loaded_end - num_computed_tokens)
        self.ready_ends.pop(0)
        final = len(self.ready_ends) == 1
        return Grant(num_computed_tokens, self.ready_ends[0] - num_computed_tokens, None if final else 0)

    def update_state_after_alloc(self, request, block_ids, grant):
        super().update_state_after_alloc(request, block_ids, grant)
        if grant.num_load_tokens:
            self.loaded_end = grant.num_load_end


def test_a_partly_fetched_request_loads_in_steps_that_compute_nothing_and_a_failed_piece_rolls_back():
    connector = PartialFetchConnector([4, 8, 11])
    scheduler = Scheduler(BlockManager(16, BLOCK_SIZE, True), 8, 64, connector=connector)
    request = make_request("a", 12, max_tokens=1)
    scheduler.add_request(request)
    # Admitted to load its first 4 tokens: running, blocks for them, nothing computed.
    output, updated = run_step(scheduler)
    assert output.requests == [] and output.load_only_requests == [request] and updated == []
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 4
    assert len(request.block_ids) == 1 and scheduler.step_requests == [request]
    assert connector.calls[:2] == [("ask", "a", 0), ("alloc", "a", 1, Grant(0, 4, 0))]
    # The next piece (4..8) loads in a step that computes nothing, and fails after token 6.
    output = scheduler.schedule()
    assert output.requests == [] and output.load_only_requests == [request]
    assert connector.calls[-2] == ("alloc", "a", 2, Grant(4, 4, 0))
    assert request.num_computed_tokens == 8 and request.metrics.num_external_cached_tokens == 8
    scheduler.update_from_output(output, {}, load_failures={"a": 6})
    assert request.num_computed_tokens == 6 and request.metrics.num_external_cached_tokens == 6
    assert scheduler.stats.num_load_failures == 1
    # Below its compute limit (8) again: it recomputes tokens 6..8, then loads the rest (final).
    output, _ = run_step(scheduler)
    assert plan_of(output) == {"a": 2} and output.load_only_requests == []
    output, updated = run_step(scheduler)
    assert connector.calls[-3] == ("alloc", "a", 3, Grant(8, 3))
    assert plan_of(output) == {"a": 1} and updated == [request] and request.is_finished
    assert request.metrics.num_external_cached_tokens == 9
