"""One step's model inputs built on the host: token ids, positions, slots, block tables and
sequence lengths as flat numpy arrays (`HostInputs`), before they go to the device.

Called by the model runner once per step (`ModelRunner._prepare`, which picks the
sequences that take the dense whole-prompt path and their order): `gather_host_inputs`
through the persistent batch (`engine.input_batch`, whose rows it updates), else
`build_host_inputs` from the requests themselves. Reads the plan and its requests and
changes neither; tokens the previous step samples (async scheduling) are left as
placeholders with their indices, for the runner to fill on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.input_batch import InputBatch
from engine.scheduler import SchedulerOutput


@dataclass
class HostInputs:
    """One step's model inputs, built on the host before they go to the device."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    seq_lens: np.ndarray  # int32 [num_seqs]
    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    max_query_len: int  # over the paged sequences (all of them when no span is dense)
    max_seq_len: int
    num_paged_seqs: int  # the first sequences; the others are whole-prompt prefills
    dense_spans: tuple[tuple[int, int], ...]  # their [begin, end) token ranges
    #: flat indices of the input ids that the previous step samples (async scheduling),
    #: and whose sampled token each one is; filled on the device before the pass
    missing_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    missing_request_ids: tuple[str, ...] = ()


def build_host_inputs(
    plan: SchedulerOutput, order: list[int], dense: list[bool], num_paged_seqs: int, block_size: int
) -> tuple[HostInputs, list[int]]:
    """The step's inputs from the requests themselves (no persistent batch): the sequences
    in ``order`` (the paged ones first, then the ``dense`` whole-prompt prefills), and the
    logits row of each request in plan order (-1 when it samples nothing)."""
    bs = block_size
    num_requests = len(plan.requests)
    missing_indices: list[int] = []
    missing_request_ids: list[str] = []
    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_rows = [-1] * num_requests
    dense_spans: list[tuple[int, int]] = []
    max_blocks = max(len(r.block_ids) for r in plan.requests)
    block_tables = np.zeros((num_requests, max_blocks), dtype=np.int32)
    for row, i in enumerate(order):
        request, num_new = plan.requests[i], plan.num_scheduled_tokens[i]
        start = request.num_computed_tokens
        end = start + num_new
        spec_token_ids = plan.request_id_to_spec_token_ids.get(request.request_id, [])
        input_ids.extend(request.all_token_ids[start : end - len(spec_token_ids)])
        # tokens the previous step samples (async scheduling): filled on the device
        for _ in range(end - len(spec_token_ids) - max(start, request.num_tokens)):
            missing_indices.append(len(input_ids))
            missing_request_ids.append(request.request_id)
            input_ids.append(0)
        input_ids.extend(spec_token_ids)
        pos = np.arange(start, end, dtype=np.int64)
        block_ids = np.asarray(request.block_ids, dtype=np.int64)
        positions.append(pos)
        slot = block_ids[pos // bs] * bs + pos % bs
        if start < request.num_cached_blocks * bs:
            # Blocks registered in the prefix cache may be shared and already hold these
            # tokens' KV (the last token of a fully cached prompt): never rewrite them.
            slot[pos < request.num_cached_blocks * bs] = -1
        slots.append(slot)
        block_tables[row, : len(block_ids)] = block_ids
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + num_new)
        if dense[i]:
            dense_spans.append((query_start_loc[-2], query_start_loc[-1]))
        if end == request.num_tokens + request.num_output_placeholders + len(spec_token_ids):
            logits_rows[i] = query_start_loc[-1] - 1
    paged_query_lens = [plan.num_scheduled_tokens[i] for i in order[:num_paged_seqs]]
    host = HostInputs(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        positions=np.concatenate(positions),
        slot_mapping=np.concatenate(slots),
        block_tables=block_tables,
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        query_start_loc=np.asarray(query_start_loc, dtype=np.int32),
        max_query_len=max(paged_query_lens, default=1),
        max_seq_len=max(seq_lens),
        num_paged_seqs=num_paged_seqs,
        dense_spans=tuple(dense_spans),
        missing_indices=np.asarray(missing_indices, dtype=np.int64),
        missing_request_ids=tuple(missing_request_ids),
    )
    return host, logits_rows


def gather_host_inputs(
    input_batch: InputBatch, plan: SchedulerOutput, order: list[int], dense: list[bool], num_paged_seqs: int
) -> tuple[HostInputs, list[int]]:
    """`build_host_inputs` through the persistent batch: the same inputs, gathered from rows
    kept across steps."""
    requests = [plan.requests[i] for i in order]
    gathered = input_batch.gather(
        requests, [plan.num_scheduled_tokens[i] for i in order], plan.request_id_to_spec_token_ids
    )
    qsl = gathered.query_start_loc
    logits_rows = [-1] * len(order)
    for row, i in enumerate(order):
        if gathered.samples[row]:
            logits_rows[i] = int(qsl[row + 1]) - 1
    num_new = np.diff(qsl)
    dense_spans = tuple((int(qsl[row]), int(qsl[row + 1])) for row, i in enumerate(order) if dense[i])
    host = HostInputs(
        input_ids=gathered.input_ids,
        positions=gathered.positions,
        slot_mapping=gathered.slot_mapping,
        block_tables=gathered.block_tables,
        seq_lens=gathered.seq_lens,
        query_start_loc=qsl,
        max_query_len=int(num_new[:num_paged_seqs].max(initial=1)),
        max_seq_len=int(gathered.seq_lens.max()),
        num_paged_seqs=num_paged_seqs,
        dense_spans=dense_spans,
        missing_indices=gathered.missing_indices,
        missing_request_ids=gathered.missing_request_ids,
    )
    return host, logits_rows
