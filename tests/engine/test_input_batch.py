"""The persistent batch's row bookkeeping (engine.input_batch): rows added, patched
with only what changed, removed and compacted, rebuilt after a preemption."""

from __future__ import annotations

import numpy as np

from engine.config import SamplingParams
from engine.input_batch import InputBatch
from engine.request import Request

BLOCK_SIZE = 4


def make_request(request_id: str, num_prompt: int, block_ids: list[int]) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=[100 + i for i in range(num_prompt)],
        sampling_params=SamplingParams(max_tokens=50, temperature=0.0),
        eos_token_ids=frozenset(),
        max_model_len=4096,
    )
    request.block_ids = list(block_ids)
    request.num_admissions = 1
    return request


def assert_row_matches(batch: InputBatch, request: Request) -> None:
    row = batch.req_id_to_index[request.request_id]
    assert batch.req_ids[row] == request.request_id
    num_tokens = len(request.all_token_ids)
    assert batch.num_tokens[row] == num_tokens
    assert batch.token_ids[row, :num_tokens].tolist() == request.all_token_ids
    num_blocks = len(request.block_ids)
    assert batch.num_blocks[row] == num_blocks
    assert batch.block_table[row, :num_blocks].tolist() == request.block_ids
    assert not batch.block_table[row, num_blocks:].any()


def test_rows_are_added_in_order_and_patched_with_new_tokens_and_blocks():
    batch = InputBatch(BLOCK_SIZE)
    a, b = make_request("a", 5, [3, 4]), make_request("b", 3, [7])
    assert batch.update_states([a, b]) == [0, 1]
    a.append_output_token(9)
    b.append_output_token(8)
    b.append_output_token(6)
    b.block_ids.append(11)
    assert batch.update_states([b, a]) == [1, 0]  # rows stay, whatever the plan's order
    assert batch.num_rows_added == 2  # patched, not rebuilt
    assert_row_matches(batch, a)
    assert_row_matches(batch, b)


def test_removed_rows_are_compacted_from_the_end():
    batch = InputBatch(BLOCK_SIZE)
    requests = [make_request(f"r{i}", 2 + i, [10 + i, 20 + i]) for i in range(5)]
    batch.update_states(requests)
    kept = [requests[0], requests[3], requests[4]]  # r1 and r2 finished or were not scheduled
    rows = batch.update_states(kept)
    assert batch.num_rows == 3 and sorted(rows) == [0, 1, 2]
    assert batch.req_ids == ["r0", "r3", "r4"]  # the rows past the new end moved into the holes
    assert set(batch.req_id_to_index) == {"r0", "r3", "r4"}
    for request in kept:
        assert_row_matches(batch, request)
    assert not batch.block_table[3:5].any()  # freed rows are cleared
    assert batch.num_rows_added == 5


def test_a_request_not_scheduled_in_the_previous_step_is_added_again():
    batch = InputBatch(BLOCK_SIZE)
    a, b = make_request("a", 4, [1]), make_request("b", 4, [2])
    batch.update_states([a, b])
    batch.update_states([a])  # b skipped this step: its row goes
    assert "b" not in batch.req_id_to_index
    b.append_output_token(77)
    batch.update_states([a, b])
    assert batch.num_rows_added == 3
    assert_row_matches(batch, b)


def test_a_preempted_and_resumed_request_gets_a_fresh_row():
    batch = InputBatch(BLOCK_SIZE)
    a = make_request("a", 6, [1, 2])
    batch.update_states([a])
    # preempted and readmitted before the runner saw a step without it (a retried step):
    # other blocks, the same number of them, one more admission
    a.block_ids = [8, 9]
    a.num_admissions += 1
    batch.update_states([a])
    assert batch.num_rows_added == 2
    assert_row_matches(batch, a)


def test_a_reused_request_id_or_shrunk_tokens_rebuild_the_row():
    batch = InputBatch(BLOCK_SIZE)
    first = make_request("x", 5, [1, 2])
    batch.update_states([first])
    second = make_request("x", 3, [5])  # a new request under a finished one's id
    batch.update_states([second])
    assert_row_matches(batch, second)
    second.append_output_token(1)
    second.append_output_token(2)
    batch.update_states([second])
    del second.all_token_ids[-1:]  # a token taken back (a retried step)
    del second.output_token_ids[-1:]
    batch.update_states([second])
    assert_row_matches(batch, second)
    assert batch.num_rows_added == 3


def test_rows_grow_past_the_initial_capacity():
    batch = InputBatch(BLOCK_SIZE)
    requests = [make_request(f"r{i}", 300 + i, list(range(i, i + 80))) for i in range(20)]
    batch.update_states(requests)
    for request in requests:
        assert_row_matches(batch, request)


def test_gather_builds_flat_inputs_with_a_missing_token_and_cached_slots():
    batch = InputBatch(BLOCK_SIZE)
    decode = make_request("d", 6, [5, 6])
    decode.num_computed_tokens = 6  # its 7th token comes from the previous step, on the device
    decode.num_output_placeholders = 1
    prefill = make_request("p", 9, [1, 2, 3])
    prefill.num_cached_blocks = 2  # a full prefix hit recomputes its last token
    prefill.num_computed_tokens = 8
    gathered = batch.gather([decode, prefill], [1, 1], {})
    assert gathered.input_ids.tolist() == [0, 108]
    assert gathered.positions.tolist() == [6, 8]
    assert gathered.slot_mapping.tolist() == [6 * BLOCK_SIZE + 2, 3 * BLOCK_SIZE + 0]
    assert gathered.seq_lens.tolist() == [7, 9]
    assert gathered.query_start_loc.tolist() == [0, 1, 2]
    assert gathered.samples.tolist() == [True, True]
    assert gathered.missing_indices.tolist() == [0] and gathered.missing_request_ids == ("d",)
    assert np.array_equal(gathered.block_tables, np.array([[5, 6, 0], [1, 2, 3]], dtype=np.int32))
    cached = make_request("c", 9, [1, 2, 3])
    cached.num_cached_blocks = 3
    cached.num_computed_tokens = 8
    assert batch.gather([cached], [1], {}).slot_mapping.tolist() == [-1]  # shared block: never rewritten
