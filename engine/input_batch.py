"""The model runner's persistent batch (vLLM's InputBatch / `update_states`).

Each running request owns one row that outlives the step: its token ids, its block
table and how much of each the row holds. A step applies only what changed since
the previous one (the tokens sampled since, the blocks allocated since) and then
gathers the flat model inputs for all rows at once with numpy, instead of walking
every request's token and block lists again.

Row rules (`update_states`, once per step, called by the model runner only):
- a request scheduled this step whose row is missing is added: first step, resumed
  after a preemption, or not scheduled in the previous step;
- a row whose request is not scheduled this step is removed (finished, preempted or
  skipped), and the rows are compacted: the rows past the new end move, in order, into
  the holes below it, so rows `0 .. num_rows - 1` are always in use;
- a row is rebuilt when its request changed under it (another admission of the same
  request, a request id reused by a new request, tokens or blocks that shrank).

Not thread-safe; it never touches the scheduler's state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from engine.request import Request

_INITIAL_ROWS = 8
_INITIAL_TOKENS = 256
_INITIAL_BLOCKS = 16


class GatheredInputs(NamedTuple):
    """One step's flat inputs, sequences in the order `gather` was given."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    seq_lens: np.ndarray  # int32 [num_seqs]
    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    #: sequences (in the given order) whose last scheduled position is sampled
    samples: np.ndarray  # bool [num_seqs]
    #: flat indices of input ids the host does not know yet (async scheduling: the token
    #: the previous step samples), and the request id whose sampled token goes there
    missing_indices: np.ndarray  # int64 [M]
    missing_request_ids: tuple[str, ...]


class InputBatch:
    """Rows of the requests of the latest step. `req_id_to_index` maps a request id to
    its row; `req_ids[row]` is the inverse."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        #: the Request object of each row (a reused id is a new request)
        self._requests: list[Request] = []
        #: request.num_admissions when the row was filled (a readmission rebuilds it)
        self._num_admissions: list[int] = []
        #: int32 (token ids fit): rows may grow to the model's context, once per row
        self.token_ids = np.zeros((_INITIAL_ROWS, _INITIAL_TOKENS), dtype=np.int32)
        #: tokens of `all_token_ids` copied into each row (Python ints: read per request
        #: per step, where numpy scalars cost more than the work)
        self.num_tokens: list[int] = []
        self.block_table = np.zeros((_INITIAL_ROWS, _INITIAL_BLOCKS), dtype=np.int32)
        #: blocks of `block_ids` copied into each row
        self.num_blocks: list[int] = []
        #: rows added (re-added) over the batch's life, for tests and benchmarks
        self.num_rows_added = 0

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    # --- capacity ---------------------------------------------------------------------

    def _ensure_rows(self, num_rows: int) -> None:
        capacity = self.token_ids.shape[0]
        if num_rows <= capacity:
            return
        new = max(num_rows, 2 * capacity)
        self.token_ids = _grow(self.token_ids, (new, self.token_ids.shape[1]))
        self.block_table = _grow(self.block_table, (new, self.block_table.shape[1]))

    def _ensure_tokens(self, num_tokens: int) -> None:
        capacity = self.token_ids.shape[1]
        if num_tokens > capacity:
            self.token_ids = _grow(self.token_ids, (self.token_ids.shape[0], max(num_tokens, 2 * capacity)))

    def _ensure_blocks(self, num_blocks: int) -> None:
        capacity = self.block_table.shape[1]
        if num_blocks > capacity:
            shape = (self.block_table.shape[0], max(num_blocks, 2 * capacity))
            self.block_table = _grow(self.block_table, shape)

    # --- rows -------------------------------------------------------------------------

    def update_states(self, requests: Sequence[Request]) -> list[int]:
        """Bring the rows in line with one step's scheduled `requests` (see the module
        docstring) -> each request's row, in the order given."""
        scheduled = {request.request_id: request for request in requests}
        removed = [row for row, req_id in enumerate(self.req_ids) if scheduled.get(req_id) is None]
        if removed:
            self._remove_rows(removed)
        rows = []
        for request in requests:
            row = self.req_id_to_index.get(request.request_id)
            if row is None:
                row = self._add_row(request)
            elif not self._apply_changes(row, request):
                self._fill_row(row, request)
            rows.append(row)
        return rows

    def _add_row(self, request: Request) -> int:
        row = self.num_rows
        self._ensure_rows(row + 1)
        self.req_ids.append(request.request_id)
        self._requests.append(request)
        self._num_admissions.append(request.num_admissions)
        self.num_tokens.append(0)
        self.num_blocks.append(0)
        self.req_id_to_index[request.request_id] = row
        self._fill_row(row, request)
        return row

    def _fill_row(self, row: int, request: Request) -> None:
        """(Re)write a row from scratch from the request."""
        token_ids, block_ids = request.all_token_ids, request.block_ids
        self._ensure_tokens(len(token_ids))
        self._ensure_blocks(len(block_ids))
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.block_table[row, : len(block_ids)] = block_ids
        self.block_table[row, len(block_ids) :] = 0
        self.num_blocks[row] = len(block_ids)
        self._requests[row] = request
        self._num_admissions[row] = request.num_admissions
        self.num_rows_added += 1

    def _apply_changes(self, row: int, request: Request) -> bool:
        """Append the tokens and blocks the request gained since the row was written.
        False when the row cannot be patched (the caller rebuilds it)."""
        if self._requests[row] is not request or self._num_admissions[row] != request.num_admissions:
            return False
        num_known = self.num_tokens[row]
        token_ids = request.all_token_ids
        num_tokens = len(token_ids)
        if num_tokens < num_known:
            return False  # tokens were taken back (a stop string, a retried step)
        if num_tokens > num_known:
            self._ensure_tokens(num_tokens)
            if num_tokens == num_known + 1:  # a decode step's token: a scalar write is cheapest
                self.token_ids[row, num_known] = token_ids[num_known]
            else:
                self.token_ids[row, num_known:num_tokens] = token_ids[num_known:]
            self.num_tokens[row] = num_tokens
        num_blocks = self.num_blocks[row]
        block_ids = request.block_ids
        if len(block_ids) < num_blocks:
            return False
        if len(block_ids) > num_blocks:
            self._ensure_blocks(len(block_ids))
            self.block_table[row, num_blocks : len(block_ids)] = block_ids[num_blocks:]
            self.num_blocks[row] = len(block_ids)
        return True

    def _remove_rows(self, rows: list[int]) -> None:
        """Drop `rows` and compact: the surviving rows at or past the new end move into
        the holes below it (only those are copied)."""
        removed = set(rows)
        for row in rows:
            del self.req_id_to_index[self.req_ids[row]]
        num_left = self.num_rows - len(rows)
        holes = [row for row in rows if row < num_left]
        movers = [row for row in range(num_left, self.num_rows) if row not in removed]
        for hole, source in zip(holes, movers, strict=True):
            num_tokens, num_blocks = self.num_tokens[source], self.num_blocks[source]
            self.token_ids[hole, :num_tokens] = self.token_ids[source, :num_tokens]
            self.num_tokens[hole] = num_tokens
            self.block_table[hole] = self.block_table[source]
            self.num_blocks[hole] = num_blocks
            self.req_ids[hole] = self.req_ids[source]
            self._requests[hole] = self._requests[source]
            self._num_admissions[hole] = self._num_admissions[source]
            self.req_id_to_index[self.req_ids[hole]] = hole
        del self.req_ids[num_left:]
        del self._requests[num_left:]
        del self._num_admissions[num_left:]
        del self.num_tokens[num_left:]
        del self.num_blocks[num_left:]
        self.block_table[num_left : num_left + len(rows)] = 0

    def write_tokens(self, row: int, start: int, token_ids: Sequence[int]) -> None:
        """Write tokens that are not the request's own yet (speculative drafts) at
        `start`; the row's own token count is unchanged, later tokens overwrite them."""
        self._ensure_tokens(start + len(token_ids))
        self.token_ids[row, start : start + len(token_ids)] = token_ids

    # --- the step's inputs --------------------------------------------------------------

    def gather(
        self,
        requests: Sequence[Request],
        num_scheduled_tokens: Sequence[int],
        request_id_to_spec_token_ids: Mapping[str, Sequence[int]],
    ) -> GatheredInputs:
        """`update_states(requests)`, then the flat inputs of the step in which
        `requests[i]` computes `num_scheduled_tokens[i]` tokens from its
        `num_computed_tokens` (the last ones its drafts, when it has any). A position at
        or past `len(all_token_ids)` and before the drafts is the token the previous step
        samples (at most `num_output_placeholders` of them): its input id is left 0
        and listed in `missing_*`. A position below the request's cached blocks gets
        slot -1 (those shared blocks already hold its KV)."""
        bs = self.block_size
        rows = np.asarray(self.update_states(requests), dtype=np.int64)
        num_new = np.asarray(num_scheduled_tokens, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in requests), np.int64, len(requests))
        num_known = np.fromiter((len(r.all_token_ids) for r in requests), np.int64, len(requests))
        num_pending = np.fromiter((r.num_output_placeholders for r in requests), np.int64, len(requests))
        num_cached = np.fromiter((r.num_cached_blocks for r in requests), np.int64, len(requests)) * bs
        num_drafts = np.zeros(len(requests), dtype=np.int64)
        if request_id_to_spec_token_ids:
            for i, request in enumerate(requests):
                drafts = request_id_to_spec_token_ids.get(request.request_id)
                if drafts:
                    num_drafts[i] = len(drafts)
                    self.write_tokens(int(rows[i]), int(starts[i] + num_new[i]) - len(drafts), drafts)
        ends = starts + num_new
        query_start_loc = np.zeros(len(requests) + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        row_of_token = np.repeat(rows, num_new)
        positions = np.repeat(starts - query_start_loc[:-1], num_new) + np.arange(total, dtype=np.int64)
        self._ensure_tokens(int(ends.max(initial=0)))
        input_ids = self.token_ids[row_of_token, positions].astype(np.int64)
        missing = (positions >= np.repeat(num_known, num_new)) & (
            positions < np.repeat(ends - num_drafts, num_new)
        )
        missing_indices = np.flatnonzero(missing)
        missing_request_ids: tuple[str, ...] = ()
        if missing_indices.size:
            input_ids[missing_indices] = 0
            owners = np.searchsorted(query_start_loc, missing_indices, side="right") - 1
            missing_request_ids = tuple(requests[i].request_id for i in owners)
        slot_mapping = self.block_table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        # Blocks registered in the prefix cache may be shared and already hold these
        # tokens' KV (the last token of a fully cached prompt): never rewrite them.
        slot_mapping[positions < np.repeat(num_cached, num_new)] = -1
        max_blocks = max((self.num_blocks[row] for row in rows.tolist()), default=0)
        return GatheredInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=self.block_table[rows, :max_blocks],
            seq_lens=ends.astype(np.int32),
            query_start_loc=query_start_loc,
            samples=ends == num_known + num_pending + num_drafts,
            missing_indices=missing_indices,
            missing_request_ids=missing_request_ids,
        )


def _grow(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    grown = np.zeros(shape, dtype=array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown
