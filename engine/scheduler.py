"""The scheduler (vLLM V1 style): a waiting and a running queue and one token
budget per step. There is no prefill or decode phase: each scheduled request
advances `num_computed_tokens` by some tokens; a prompt longer than the budget
is split over steps, the request staying in the running queue, and only the
step that reaches the end of its known tokens samples a token.

Called by the engine core once per step (`schedule`, then `update_from_output`).
Never touches tensors. Calls the connector's scheduler side, when present, at
admission (`get_num_new_matched_tokens`, `update_state_after_alloc`), once per
step (`build_connector_meta`) and when a request finishes (`request_finished`).
A request whose KV the connector must first fetch from a lower tier waits aside in
WAITING_FOR_REMOTE_KVS (`request_id_to_remote_wait`, no blocks held) and is put back
at the front of the waiting queue when the worker reports the fetch finished, or (pipelined
loads) when part of it arrived: it is then admitted with zero tokens to compute, loads
that part (a load-only request of the step, `load_only_requests`) and stays running at its
compute limit, loading the rest as it arrives, until the fetch ended and it computes; one
whose lookup is not answered yet is skipped for the step. Neither holds up the
requests behind it. While a request decodes, the prompt tokens of a step are capped
(`prefill_cap`, engine.prefill_cap) so that the decode's next token is not held up by
a long prefill step, and so are its loads from the CPU tier: an admission's load or a
tail takes the whole chunks that fit the step's time left (`fit_load_tokens`, at least
one), the rest is loaded in the following steps, the request computing nothing until
it is all in.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from connector.base import ConnectorMetadata, KVConnectorScheduler, ScheduledRequest
from engine.block_manager import BlockManager
from engine.prefill_cap import PrefillCap
from engine.request import Request, RequestStatus
from engine.spec_decode import NgramProposer, draft_slots_leave_room, propose_drafts

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """One step's plan. `num_scheduled_tokens[i]` new tokens of `requests[i]` start at
    `requests[i].num_computed_tokens` (already counting prefix hits and loads); for a
    request in `request_id_to_spec_token_ids` the last of them are its draft tokens."""

    requests: list[Request]
    num_scheduled_tokens: list[int]
    preempted_request_ids: list[str]
    #: requests finished since the previous step (for the connector worker's get_finished)
    finished_request_ids: set[str]
    connector_meta: ConnectorMetadata | None = None
    #: speculative drafts to verify this step (requests without drafts are absent)
    request_id_to_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    #: running requests that only load this step (pipelined loads: a part of their fetch
    #: that arrived) and compute nothing; not in `requests`
    load_only_requests: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_external_hit_tokens: int = 0
    num_load_failures: int = 0


@dataclass
class Scheduler:
    block_manager: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    connector: KVConnectorScheduler | None = None
    #: drafts speculative decoding verifies in decode steps (None: no speculation)
    proposer: NgramProposer | None = None
    #: prompt tokens per step while others decode, and per long prompt (None: only the budget)
    prefill_cap: PrefillCap | None = None
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    #: finished requests whose blocks an async connector save still reads
    request_id_to_sending: dict[str, Request] = field(default_factory=dict)
    #: requests whose KV the connector fetches in the background (no blocks held), in arrival order
    request_id_to_remote_wait: dict[str, Request] = field(default_factory=dict)
    #: the requests of the latest `schedule` call's plan; while it runs, also the one it is
    #: working on. A step that raises ends these (`EngineCore.step`).
    step_requests: list[Request] = field(default_factory=list)
    _finished_request_ids: set[str] = field(default_factory=set)
    #: running requests the latest `schedule` skipped because their tail is being fetched
    _num_tail_waits: int = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(
            self.waiting or self.running or self.request_id_to_sending or self.request_id_to_remote_wait
        )

    def waits_only_for_transfers(self, plan: SchedulerOutput) -> bool:
        """Whether `plan` runs nothing (no request, no load) while requests wait for the
        connector's background fetches: the engine then sleeps until one progresses
        instead of spinning through empty steps."""
        if plan.requests or self.connector is None:
            return False
        if plan.connector_meta is not None and plan.connector_meta.loads:
            return False
        return bool(self.request_id_to_remote_wait) or self._num_tail_waits > 0

    def schedule(
        self,
        only: Collection[Request] | None = None,
        *,
        exclude: Collection[Request] = (),
        max_num_requests: int | None = None,
    ) -> SchedulerOutput:
        """Plan one step. With `only`, the step holds none but those requests (the engine
        core retrying the requests of a failed step in smaller groups); the others wait,
        and running ones may still be preempted to make room. `exclude`: running requests
        that this step skips (pipeline micro-batches in flight hold them; they may still
        be preempted). `max_num_requests`: at most that many requests in the step (the
        batch queue splits the requests over pipeline micro-batches)."""
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        num_scheduled: list[int] = []
        load_only: list[Request] = []  # requests that load a part of their fetch, computing nothing
        self._num_tail_waits = 0
        preempted: list[Request] = []
        request_id_to_spec_token_ids: dict[str, list[int]] = {}
        self.step_requests = []
        step_cap = None
        if self.prefill_cap is not None:
            step_cap = self.prefill_cap.for_step(
                sum(_is_decoding(r) for r in self.running if only is None or r in only)
            )

        # 1. Running requests first, in arrival order; preempt from the back when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            if max_num_requests is not None and len(scheduled) >= max_num_requests:
                break
            request = self.running[index]
            if (only is not None and request not in only) or request in exclude:
                index += 1
                continue
            self.step_requests.append(request)
            # (with async scheduling, the tokens that steps in flight will sample count too)
            num_new = min(
                request.num_tokens + request.num_output_placeholders - request.num_computed_tokens, budget
            )
            num_tail = None  # tokens loaded at the connector's compute limit (its tail fetch)
            tail = None
            loads_only = False  # it loads a part of its fetch that arrived and computes nothing
            if self.connector is not None and request.num_computed_tokens < request.num_prompt_tokens:
                limit = self.connector.get_compute_limit(request)
                if limit is not None and request.num_computed_tokens >= limit:
                    tail = self.connector.get_num_tail_tokens(request)
                    num_tail = 0 if tail is None else tail.num_tokens
                    num_tail = max(0, min(num_tail, request.num_tokens - 1 - request.num_computed_tokens))
                    if tail is None or (not tail.final and num_tail == 0):
                        self._num_tail_waits += 1
                        index += 1  # its tail is still being fetched: the others go on
                        continue
                    loads_only = not tail.final  # more is coming (pipelined loads)
                    num_new = min(request.num_tokens - request.num_computed_tokens - num_tail, budget)
                    num_new = 0 if loads_only else num_new
                elif limit is not None:
                    num_new = min(num_new, limit - request.num_computed_tokens)
            num_loaded = num_tail or 0
            prefilling = step_cap is not None and not _is_decoding(request)
            if prefilling:
                if num_loaded:  # the tail's copy runs in this step too: what fits the step's time
                    num_fit = self.connector.fit_load_tokens(
                        request.num_computed_tokens, num_loaded, step_cap.time_left_s
                    )
                    if num_fit < num_loaded:
                        # the rest in the next steps; it computes nothing until all is in
                        num_tail = num_loaded = num_fit
                        tail = tail._replace(final=False)
                        loads_only, num_new = True, 0
                    step_cap.spend_seconds(self.connector.estimate_load_seconds(num_loaded))
                if not loads_only:
                    num_new = step_cap.limit(request.num_computed_tokens + num_loaded, num_new)
                    if num_new == 0:
                        index += 1  # the step's prefill time is spent: it goes on next step
                        continue
            spec_token_ids = (
                [] if self.proposer is None or loads_only else propose_drafts(self.proposer, request, budget)
            )
            num_with_drafts = request.num_computed_tokens + num_new + len(spec_token_ids)
            # Drafts ride along only on blocks nobody behind needs: never preempt for a draft.
            if (
                spec_token_ids
                and draft_slots_leave_room(
                    self.block_manager, request, num_with_drafts, len(self.running) - index - 1
                )
                and self.block_manager.allocate_slots(request, num_with_drafts)
            ):
                request_id_to_spec_token_ids[request.request_id] = spec_token_ids
                num_new += len(spec_token_ids)
            while not self.block_manager.allocate_slots(
                request, request.num_computed_tokens + num_loaded + num_new
            ):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                if tail is not None:
                    self.connector.update_state_after_tail_alloc(
                        request, list(request.block_ids), tail._replace(num_tokens=num_tail)
                    )
                    request.num_computed_tokens += num_tail
                    request.metrics.num_external_cached_tokens += num_tail
                    self.stats.num_external_hit_tokens += num_tail
                    if loads_only:
                        load_only.append(request)
                        index += 1
                        continue
                if prefilling:
                    step_cap.spend(request.num_computed_tokens, num_new)
                scheduled.append(request)
                num_scheduled.append(num_new)
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: nothing behind it is left

        # 2. Admit waiting requests while budget, seats and blocks last (not after a preemption).
        # A request whose lookup a lower tier has not answered yet is skipped (asked next step);
        # one whose KV must first be fetched waits aside, holding no blocks.
        skipped: list[Request] = []
        candidates = self.waiting if only is None else deque(r for r in self.waiting if r in only)
        while (
            not preempted
            and candidates
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and (max_num_requests is None or len(scheduled) < max_num_requests)
        ):
            request = candidates[0]
            self.step_requests.append(request)
            cached_block_ids = self.block_manager.find_cached_prefix(request)
            # A prompt whose every block is cached still computes its last token.
            num_gpu_hit = min(len(cached_block_ids) * self.block_manager.block_size, request.num_tokens - 1)
            num_external = 0
            if self.connector is not None:
                # Asked even on a full GPU hit: its answer tells the connector which chunks
                # the tiers hold already, so they are not stored again.
                num_matched, load_async = self.connector.get_num_new_matched_tokens(request, num_gpu_hit)
                if num_matched is None:
                    self._take_waiting(request, candidates, only)
                    skipped.append(request)
                    continue
                if load_async:
                    self._take_waiting(request, candidates, only)
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.request_id_to_remote_wait[request.request_id] = request
                    self.connector.update_state_after_alloc(request, [], num_matched)
                    continue
                # at least the last token runs, so this step's logits belong to this request
                num_external = max(0, min(num_matched, request.num_tokens - 1 - num_gpu_hit))
            num_computed = num_gpu_hit + num_external
            num_new = min(request.num_tokens - num_computed, budget)
            only_loads = False
            if self.connector is not None:
                # A head recomputed while the connector fetches the tail stops where the tail starts.
                limit = self.connector.get_compute_limit(request)
                if limit is not None and limit > num_computed:
                    num_new = min(num_new, limit - num_computed)
                elif limit is not None and limit == num_computed and num_external:
                    # Part of its fetch arrived: it loads that and computes nothing until the
                    # rest is in (pipelined loads); it runs from now on, at its compute limit.
                    num_new, only_loads = 0, True
            if step_cap is not None:
                if num_external:  # its load from the CPU tier runs in this step too: what fits
                    num_fit = self.connector.fit_load_tokens(num_gpu_hit, num_external, step_cap.time_left_s)
                    if num_fit < num_external:
                        # The connector keeps the rest for the next steps (at its compute
                        # limit, as a tail); it computes nothing until all is in.
                        num_external, num_new, only_loads = num_fit, 0, True
                        num_computed = num_gpu_hit + num_external
                    step_cap.spend_seconds(self.connector.estimate_load_seconds(num_external))
                if not only_loads:
                    num_new = step_cap.limit(num_computed, num_new)
                    if num_new == 0:
                        break  # the step's prefill time is spent: admitted next step
            if not self.block_manager.allocate_slots(request, num_computed + num_new, cached_block_ids):
                break
            self._take_waiting(request, candidates, only)
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, list(request.block_ids), num_external)
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            request.num_admissions += 1
            if request.num_admissions == 1:
                request.metrics.num_local_cached_tokens = min(num_gpu_hit, request.num_prompt_tokens)
                request.metrics.num_external_cached_tokens = num_external
            self.stats.num_prefix_hit_tokens += num_gpu_hit
            self.stats.num_external_hit_tokens += num_external
            self.running.append(request)
            if only_loads:
                load_only.append(request)
                continue
            if step_cap is not None:
                step_cap.spend(request.num_computed_tokens, num_new)
            scheduled.append(request)
            num_scheduled.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        output = SchedulerOutput(
            requests=scheduled,
            num_scheduled_tokens=num_scheduled,
            preempted_request_ids=[r.request_id for r in preempted],
            finished_request_ids=self._finished_request_ids,
            request_id_to_spec_token_ids=request_id_to_spec_token_ids,
            load_only_requests=load_only,
        )
        self._finished_request_ids = set()
        # a step that raises ends (or rolls back) the requests whose loads it held, too
        self.step_requests = scheduled + load_only
        if self.connector is not None:
            output.connector_meta = self.connector.build_connector_meta(
                [
                    ScheduledRequest(
                        request_id=r.request_id,
                        token_ids=r.all_token_ids,
                        block_ids=list(r.block_ids),
                        num_computed_tokens=r.num_computed_tokens,
                        num_scheduled_tokens=n,
                        num_prompt_tokens=r.num_prompt_tokens,
                    )
                    for r, n in zip(scheduled, num_scheduled, strict=True)
                    if r.num_computed_tokens < r.num_prompt_tokens
                ]
            )
        return output

    def hash_blocks_of(self, requests: Iterable[Request]) -> None:
        """Finish the prefix-cache hashes of a step's requests. The engine core has the
        model runner call it once the step's device work is queued, while the device
        runs: admission hashed only as far as its GPU-cache search went, and the rest is
        needed once the step's blocks are registered (`update_from_output`)."""
        for request in requests:
            if self.block_manager.enable_prefix_caching:
                self.block_manager.hash_blocks(request)

    def roll_back(self, request: Request) -> None:
        """Send a request of a step that raised back to the front of the waiting queue, as
        a preemption does: its blocks are freed (the failed step's KV is never reused) and
        it is recomputed, its output tokens kept. The caller restores its other state."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.connector is not None:
            self.connector.request_rolled_back(request)
        self._preempt(request)

    def _take_waiting(self, request: Request, candidates: deque[Request], only) -> None:
        """Remove the head candidate `request` from the waiting queue."""
        candidates.popleft()
        if only is not None:
            self.waiting.remove(request)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and put it back at the front of the waiting
        queue; it is recomputed (its prefix may still hit the cache)."""
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1
        logger.debug("preempted request %s", request.request_id)

    def update_from_output(
        self,
        output: SchedulerOutput,
        request_id_to_token: dict[str, int],
        load_failures: dict[str, int] | None = None,
        finished_sending_ids: Iterable[str] = (),
        request_id_to_accepted_draft_ids: Mapping[str, list[int]] | None = None,
        finished_recving_ids: Iterable[str] = (),
    ) -> list[Request]:
        """Advance every scheduled request; append sampled tokens of requests that
        reached the end of their known tokens; finish on EOS/max_tokens/context.
        `load_failures` maps a request id to the number of leading tokens truly in
        its paged cache: that request's output is dropped and it recomputes from there.
        A request that verified drafts appends its accepted drafts before its sampled
        token; its rejected drafts' slots fall out of `num_computed_tokens` (the next
        step overwrites them; their blocks stay with the request).
        Requests in `finished_recving_ids` (their background fetch ended) go back to the
        front of the waiting queue, in arrival order, to be admitted with what arrived.
        Returns the requests that got a new token (finished ones included)."""
        load_failures = load_failures or {}
        request_id_to_accepted_draft_ids = request_id_to_accepted_draft_ids or {}
        updated: list[Request] = []
        for request, num_new in zip(output.requests, output.num_scheduled_tokens, strict=True):
            if request.is_finished:  # aborted during the step
                continue
            if request.request_id in load_failures:
                valid = load_failures[request.request_id]
                lost = request.num_computed_tokens - valid
                request.num_computed_tokens = min(request.num_computed_tokens, valid)
                request.metrics.num_external_cached_tokens = max(
                    0, request.metrics.num_external_cached_tokens - max(lost, 0)
                )
                self.stats.num_load_failures += 1
                self.block_manager.cache_computed_blocks(request)
                continue
            num_drafts = len(output.request_id_to_spec_token_ids.get(request.request_id, ()))
            accepted_draft_ids = request_id_to_accepted_draft_ids.get(request.request_id, [])
            request.draft_backoff.record(num_drafts, len(accepted_draft_ids))
            request.num_computed_tokens += num_new - (num_drafts - len(accepted_draft_ids))
            if request.num_computed_tokens < request.num_tokens:
                self.block_manager.cache_computed_blocks(request)
                continue  # a non-final prompt chunk: its logits are dropped
            if self.connector is not None and not request.output_token_ids:
                self._record_loaded_tiers(request)
            reason = None
            for token_id in (*accepted_draft_ids, request_id_to_token[request.request_id]):
                request.append_output_token(token_id)
                reason = request.check_token_stop()
                if reason is not None:
                    break  # tokens after a stop are dropped, as without speculation
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self.block_manager.cache_computed_blocks(request)
            updated.append(request)
            if reason is not None:
                self.finish_request(request, reason)
        for request in output.load_only_requests:
            if request.is_finished:
                continue
            if request.request_id in load_failures:
                # Its KV from the valid length on is not in the paged cache: recomputed from there.
                valid = load_failures[request.request_id]
                lost = max(0, request.num_computed_tokens - valid)
                request.num_computed_tokens = min(request.num_computed_tokens, valid)
                request.metrics.num_external_cached_tokens = max(
                    0, request.metrics.num_external_cached_tokens - lost
                )
                self.stats.num_load_failures += 1
            self.block_manager.cache_computed_blocks(request)
        self.free_sent(finished_sending_ids)
        self.readmit_received(finished_recving_ids)
        return updated

    def _record_loaded_tiers(self, request: Request) -> None:
        """At the first output token every load of the request's prompt has finished
        (loads end within their step): copy where its loaded tokens came from into its
        metrics. Called once per request by `update_from_output`."""
        transfer = self.connector.request_stats(request.request_id)
        if transfer is not None:
            request.metrics.tier_to_loaded_tokens = dict(transfer.tier_to_loaded_tokens)
            request.metrics.num_planned_recompute_tokens = transfer.num_planned_recompute_tokens

    def readmit_received(self, finished_recving_ids: Iterable[str]) -> None:
        """Requests whose background fetch ended wait for admission again, ahead of
        the requests that arrived after them."""
        received = [
            self.request_id_to_remote_wait.pop(request_id)
            for request_id in finished_recving_ids
            if request_id in self.request_id_to_remote_wait
        ]
        for request in sorted(received, key=lambda r: r.arrival_time, reverse=True):
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def free_sent(self, finished_sending_ids: Iterable[str]) -> None:
        """Free the blocks of finished requests whose connector saves are done."""
        for request_id in finished_sending_ids:
            sending = self.request_id_to_sending.pop(request_id, None)
            if sending is not None:
                self.block_manager.free(sending)

    def finish_request(self, request: Request, reason: str) -> None:
        """End a request (stop condition or abort). Safe to call from outside a step."""
        if request.is_finished:
            return
        # A step that raised may leave a request in neither queue (taken from waiting, not yet running).
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.request_id_to_remote_wait.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_request_ids.add(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        delay_free = False
        if self.connector is not None:
            delay_free = self.connector.request_finished(request, list(request.block_ids))
        if delay_free:
            self.request_id_to_sending[request.request_id] = request
        else:
            self.block_manager.free(request)


def _is_decoding(request: Request) -> bool:
    """Whether the request generates (its next token is its only uncomputed one), as
    opposed to computing its prompt (or recomputing it and its outputs after a preemption)."""
    return bool(request.output_token_ids) and request.num_computed_tokens >= request.num_tokens - 1
