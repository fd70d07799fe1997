"""Scheduler bookkeeping of speculative decoding, without a model: drafts ride on decode
steps within the token budget and the request's limits, accepted drafts are appended,
rejected ones are rolled back, a stop inside the drafts ends the request there."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler
from engine.spec_decode import NgramProposer

BLOCK_SIZE = 4
EOS = 0
# A prompt that repeats itself: after "... 11 12" the proposer drafts "13 14 15 16".
PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12]


def make_request(request_id: str = "r", prompt=PROMPT, max_tokens: int = 32) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        eos_token_ids=frozenset({EOS}),
        max_model_len=1000,
    )


def make_scheduler(budget: int = 64, num_blocks: int = 64, k: int = 4) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        proposer=NgramProposer(k, min_n=1, max_n=3),
    )


def prefill(scheduler: Scheduler, request: Request, first_token: int = 12) -> None:
    """Run the prompt through and sample `first_token` (repeating the prompt's pattern)."""
    scheduler.add_request(request)
    plan = scheduler.schedule()
    assert plan.request_id_to_spec_token_ids == {}  # a prompt step carries no drafts
    scheduler.update_from_output(plan, {request.request_id: first_token})


def test_decode_step_carries_drafts_as_extra_tokens():
    scheduler = make_scheduler()
    request = make_request(prompt=PROMPT[:-1])  # ... 10 11, then the first output is 12
    prefill(scheduler, request)
    plan = scheduler.schedule()
    assert plan.request_id_to_spec_token_ids == {"r": [13, 14, 15, 16]}
    assert plan.num_scheduled_tokens == [1 + 4]
    # blocks cover the drafts' slots too: 11 + 4 = 15 tokens
    assert len(request.block_ids) == 4


def test_accepted_drafts_are_appended_and_rejected_ones_rolled_back():
    scheduler = make_scheduler()
    request = make_request(prompt=PROMPT[:-1])
    prefill(scheduler, request)
    plan = scheduler.schedule()
    num_blocks_before = len(request.block_ids)
    # two drafts accepted, the third rejected: the recovered token 99 follows them
    updated = scheduler.update_from_output(plan, {"r": 99}, request_id_to_accepted_draft_ids={"r": [13, 14]})
    assert updated == [request]
    assert request.output_token_ids == [12, 13, 14, 99]
    # KV is valid for 10 prompt tokens + 12, 13, 14; the recovered token is computed next step
    assert request.num_computed_tokens == 13 == request.num_tokens - 1
    # the rejected drafts' slots are simply overwritten next step: no block is added or lost
    plan = scheduler.schedule()
    assert len(request.block_ids) >= num_blocks_before
    assert plan.num_scheduled_tokens == [1 + len(plan.request_id_to_spec_token_ids.get("r", []))]


def test_all_drafts_accepted_appends_the_bonus_token():
    scheduler = make_scheduler()
    request = make_request(prompt=PROMPT[:-1])
    prefill(scheduler, request)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"r": 17}, request_id_to_accepted_draft_ids={"r": [13, 14, 15, 16]})
    assert request.output_token_ids == [12, 13, 14, 15, 16, 17]
    assert request.num_computed_tokens == request.num_tokens - 1


def test_drafts_fit_the_token_budget_max_tokens_and_never_preempt():
    # budget 3 = the decode token + 2 drafts
    scheduler = make_scheduler(budget=3)
    request = make_request(prompt=PROMPT[:-1])
    scheduler.add_request(request)
    for num_computed in (0, 3, 6):  # the prompt is chunked by the small budget
        plan = scheduler.schedule()
        assert request.num_computed_tokens == num_computed and plan.num_scheduled_tokens == [3]
        assert plan.request_id_to_spec_token_ids == {}
        scheduler.update_from_output(plan, {})
    # The prompt's last token is the only one left: it may carry drafts like a decode step.
    plan = scheduler.schedule()
    assert plan.request_id_to_spec_token_ids == {"r": [12, 13]}

    # max_tokens 3 with one output so far: at most 1 draft (it and the next token end the request)
    scheduler = make_scheduler()
    request = make_request(prompt=PROMPT[:-1], max_tokens=3)
    prefill(scheduler, request)
    plan = scheduler.schedule()
    assert plan.request_id_to_spec_token_ids == {"r": [13]}
    scheduler.update_from_output(plan, {"r": 14}, request_id_to_accepted_draft_ids={"r": [13]})
    assert request.output_token_ids == [12, 13, 14] and request.finish_reason == "length"

    # 3 blocks of 4 = 12 slots: 11 tokens fit, 11 + 4 drafts do not; the step runs without drafts
    scheduler = make_scheduler(num_blocks=3)
    request = make_request(prompt=PROMPT[:-1])
    prefill(scheduler, request)
    plan = scheduler.schedule()
    assert plan.request_id_to_spec_token_ids == {} and plan.num_scheduled_tokens == [1]
    assert plan.preempted_request_ids == []


def test_stop_inside_accepted_drafts_drops_the_rest():
    scheduler = make_scheduler()
    request = make_request(prompt=[10, 11, 12, 13, EOS, 15, 16, 17, 10, 11])
    prefill(scheduler, request)
    plan = scheduler.schedule()
    assert plan.request_id_to_spec_token_ids == {"r": [13, EOS, 15, 16]}
    # every draft is accepted, but the EOS among them ends generation there
    scheduler.update_from_output(plan, {"r": 17}, request_id_to_accepted_draft_ids={"r": [13, EOS, 15, 16]})
    assert request.output_token_ids == [12, 13, EOS]
    assert request.finish_reason == "stop" and request.is_finished
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_drafts_leave_a_block_for_each_request_behind():
    """6 blocks: a (11 tokens, 3 blocks) and b (9 tokens, 2 blocks, needs a 3rd for its next
    token). a's drafts would take the last free block and force b out: a runs without them."""
    scheduler = make_scheduler(num_blocks=6)
    a = make_request("a", prompt=PROMPT[:-1])
    b = make_request("b", prompt=list(range(50, 58)))
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"a": 12, "b": 99})
    plan = scheduler.schedule()
    assert plan.request_id_to_spec_token_ids == {}
    assert plan.num_scheduled_tokens == [1, 1] and plan.preempted_request_ids == []
    assert scheduler.block_manager.num_free_blocks == 0


def test_finished_requests_leave_no_cached_tokens_in_the_proposer():
    scheduler = make_scheduler()
    request = make_request(prompt=PROMPT[:-1], max_tokens=3)
    prefill(scheduler, request)
    plan = scheduler.schedule()
    assert scheduler.proposer.cached_request_ids == {"r"}
    scheduler.update_from_output(plan, {"r": 14}, request_id_to_accepted_draft_ids={"r": [13]})
    assert request.is_finished
    assert scheduler.proposer.cached_request_ids == set()
