"""Scheduler and block-manager rules (DESIGN §3), without a model: one token budget
per step, chunked prefill, max_num_seqs, preemption by recompute, prefix hits."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from engine.block_manager import BlockManager, hash_block
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
    scheduler.finish_request(first, "abort")
    again = make_request("again", 12)
    scheduler.add_request(again)
    output, updated = run_step(scheduler)
    # the 3 blocks are cached, but only 2 are reused: the last token must run to give logits
    assert again.metrics.num_local_cached_tokens == 8
    assert plan_of(output) == {"again": 4}
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


def test_allocation_failure_changes_nothing():
    manager = BlockManager(2, BLOCK_SIZE, True)
    request = make_request("a", 20)
    assert manager.allocate_slots(request, 20) is False
    assert request.block_ids == [] and manager.num_free_blocks == 2


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0)])
def test_block_manager_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size, True)
