"""The scheduler (vLLM V1 style): a waiting and a running queue and one token
budget per step. There is no prefill or decode phase: each scheduled request
advances `num_computed_tokens` by some tokens; a prompt longer than the budget
is split over steps, the request staying in the running queue, and only the
step that reaches the end of its known tokens samples a token.

Called by the engine core once per step (`schedule`, then `update_from_output`).
Never touches tensors. A step first runs the running requests (`_schedule_running`),
then admits waiting ones (`_admit_waiting`). Of the connector's scheduler side, when
present, it asks one question per request per step (`grant`: for a waiting request,
and for a running one still in its prompt) and tells it once what it did with the
answer (`update_state_after_alloc`); then `build_connector_meta` once per step, and
`request_preempted` / `request_finished` once each (docs/architecture.md, Connector).
A grant loads tokens from the tiers (they count as computed), caps what the request
computes this step, or makes it wait: a request whose KV the connector must first
fetch from a lower tier waits aside in WAITING_FOR_REMOTE_KVS (`request_id_to_remote_wait`,
no blocks held) and is put back at the front of the waiting queue when the worker reports
the fetch finished, or (pipelined loads) when part of it arrived: it is then admitted to
load that part and compute nothing (a load-only request of the step, `load_only_requests`)
and stays running at its compute limit, loading the rest as it arrives, until the fetch
ended and it computes; one whose lookup is not answered yet is skipped for the step.
Neither holds up the requests behind it. While a request decodes, the prompt tokens of a
step are capped (`prefill_cap`, engine.prefill_cap) so that the decode's next token is
not held up by a long prefill step, and so are its loads: the scheduler passes the step's
time left to `grant`, which loads the whole chunks that fit (at least one) and leaves the
rest for the following steps, the request computing nothing until it is all in.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from connector.base import ConnectorMetadata, Grant, GrantWait, KVConnectorScheduler, ScheduledRequest
from engine.block_manager import BlockManager
from engine.prefill_cap import PrefillCap, StepPrefillCap
from engine.request import Request, RequestStatus
from engine.runner_output import RunnerOutput
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
    #: requests finished since the previous step (pipeline stages drop what they keep of them)
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
class _StepPlan:
    """What one `schedule` call has planned so far: the token budget left, the requests
    and their tokens, the prefill cap's account of the step's time (None: no cap)."""

    budget: int
    max_num_requests: int | None
    cap: StepPrefillCap | None = None
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)
    #: requests that only load this step (a part of their fetch, or of a load cut short)
    load_only: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    request_id_to_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def has_room(self) -> bool:
        return self.budget > 0 and (
            self.max_num_requests is None or len(self.scheduled) < self.max_num_requests
        )

    def num_to_compute(self, grant: Grant, num_new: int, prefilling: bool) -> int | None:
        """How many of a request's `num_new` uncomputed tokens after its grant's load run in
        this step: the budget's share, the grant's limit, and (a prompt, under a prefill cap)
        what the step's time left holds after the load's own time. None: nothing fits."""
        num_new = min(num_new, self.budget)
        if grant.max_compute_tokens is not None:
            num_new = min(num_new, grant.max_compute_tokens)
        if self.cap is None or not prefilling:
            return num_new
        self.cap.spend_seconds(grant.load_seconds)
        if grant.max_compute_tokens == 0:
            return 0  # it only loads
        num_new = self.cap.limit(grant.num_load_end, num_new)
        return num_new or None

    def add(self, request: Request, num_new: int, loads_only: bool, prefilling: bool) -> None:
        if loads_only:
            self.load_only.append(request)
            return
        if self.cap is not None and prefilling:
            self.cap.spend(request.num_computed_tokens, num_new)
        self.scheduled.append(request)
        self.num_scheduled.append(num_new)
        self.budget -= num_new


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
    #: the latest plan's connector metadata: a step that raises before the runner bound it
    #: has the worker side end it (`StepRecovery.recover`), else its saves stay pending
    step_connector_meta: ConnectorMetadata | None = None
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
        self._num_tail_waits = 0
        self.step_requests = []
        step = _StepPlan(self.max_num_batched_tokens, max_num_requests)
        if self.prefill_cap is not None:
            step.cap = self.prefill_cap.for_step(
                sum(_is_decoding(r) for r in self.running if only is None or r in only)
            )
        self._schedule_running(step, only, exclude)
        if not step.preempted:  # no admission after a preemption: blocks are short
            self._admit_waiting(step, only)
        output = SchedulerOutput(
            requests=step.scheduled,
            num_scheduled_tokens=step.num_scheduled,
            preempted_request_ids=[r.request_id for r in step.preempted],
            finished_request_ids=self._finished_request_ids,
            request_id_to_spec_token_ids=step.request_id_to_spec_token_ids,
            load_only_requests=step.load_only,
        )
        self._finished_request_ids = set()
        # a step that raises ends (or rolls back) the requests whose loads it held, too
        self.step_requests = step.scheduled + step.load_only
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
                    for r, n in zip(step.scheduled, step.num_scheduled, strict=True)
                    if r.num_computed_tokens < r.num_prompt_tokens
                ]
            )
            self.step_connector_meta = output.connector_meta
        return output

    def _schedule_running(self, step: _StepPlan, only, exclude) -> None:
        """Running requests first, in arrival order; preempt from the back when blocks run
        out. One still in its prompt asks the connector for its grant: below its compute
        limit it computes up to it, at it it loads what arrived (computing nothing while
        more is to come) or skips the step while nothing did."""
        index = 0
        while index < len(self.running) and step.has_room():
            request = self.running[index]
            index += 1
            if (only is not None and request not in only) or request in exclude:
                continue
            self.step_requests.append(request)
            grant = Grant(request.num_computed_tokens)
            in_prompt = self.connector is not None and request.num_computed_tokens < request.num_prompt_tokens
            if in_prompt:
                grant = self._ask(request, request.num_computed_tokens, step)
                if grant.wait is not GrantWait.NONE:
                    self._num_tail_waits += 1
                    continue  # its tail is still being fetched: the others go on
            prefilling = not _is_decoding(request)
            # (with async scheduling, the tokens that steps in flight will sample count too)
            num_new = request.num_tokens + request.num_output_placeholders - grant.num_load_end
            num_new = step.num_to_compute(grant, num_new, prefilling)
            if num_new is None:
                continue  # the step's prefill time is spent: it goes on next step
            loads_only = grant.max_compute_tokens == 0
            spec_token_ids = (
                []
                if self.proposer is None or loads_only
                else propose_drafts(self.proposer, request, step.budget)
            )
            num_with_drafts = grant.num_load_end + num_new + len(spec_token_ids)
            # Drafts ride along only on blocks nobody behind needs: never preempt for a draft.
            if (
                spec_token_ids
                and draft_slots_leave_room(
                    self.block_manager, request, num_with_drafts, len(self.running) - index
                )
                and self.block_manager.allocate_slots(request, num_with_drafts)
            ):
                step.request_id_to_spec_token_ids[request.request_id] = spec_token_ids
                num_new += len(spec_token_ids)
            while not self.block_manager.allocate_slots(request, grant.num_load_end + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    return  # the request preempted itself: nothing behind it is left
            if in_prompt:
                self.connector.update_state_after_alloc(request, list(request.block_ids), grant)
                request.num_computed_tokens += grant.num_load_tokens
                request.metrics.num_external_cached_tokens += grant.num_load_tokens
                self.stats.num_external_hit_tokens += grant.num_load_tokens
            step.add(request, num_new, loads_only, prefilling)

    def _admit_waiting(self, step: _StepPlan, only) -> None:
        """Admit waiting requests while budget, seats and blocks last. A request whose
        lookup a lower tier has not answered yet is skipped (asked next step); one whose KV
        must first be fetched waits aside, holding no blocks."""
        skipped: list[Request] = []
        candidates = self.waiting if only is None else deque(r for r in self.waiting if r in only)
        while candidates and step.has_room() and len(self.running) < self.max_num_seqs:
            request = candidates[0]
            self.step_requests.append(request)
            cached_block_ids = self.block_manager.find_cached_prefix(request)
            # A prompt whose every block is cached still computes its last token.
            num_gpu_hit = min(len(cached_block_ids) * self.block_manager.block_size, request.num_tokens - 1)
            grant = Grant(num_gpu_hit)
            if self.connector is not None:
                grant = self._ask(request, num_gpu_hit, step)
                if grant.wait is not GrantWait.NONE:
                    self._take_waiting(request, candidates, only)
                    if grant.wait is not GrantWait.FETCH:
                        skipped.append(request)  # its lookup is not answered: asked next step
                        continue
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.request_id_to_remote_wait[request.request_id] = request
                    self.connector.update_state_after_alloc(request, [], grant)
                    continue
            num_new = step.num_to_compute(grant, request.num_tokens - grant.num_load_end, prefilling=True)
            if num_new is None:
                break  # the step's prefill time is spent: admitted next step
            if not self.block_manager.allocate_slots(request, grant.num_load_end + num_new, cached_block_ids):
                break
            self._take_waiting(request, candidates, only)
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, list(request.block_ids), grant)
            request.num_computed_tokens = grant.num_load_end
            request.status = RequestStatus.RUNNING
            request.num_admissions += 1
            if request.num_admissions == 1:
                request.metrics.num_local_cached_tokens = min(num_gpu_hit, request.num_prompt_tokens)
                request.metrics.num_external_cached_tokens = grant.num_load_tokens
            self.stats.num_prefix_hit_tokens += num_gpu_hit
            self.stats.num_external_hit_tokens += grant.num_load_tokens
            self.running.append(request)
            step.add(request, num_new, grant.max_compute_tokens == 0, prefilling=True)
        self.waiting.extendleft(reversed(skipped))

    def _ask(self, request: Request, num_computed: int, step: _StepPlan) -> Grant:
        """The connector's grant for `request` (waiting, or running in its prompt) this
        step, its load kept to the tokens before the request's last known one (that one
        always runs, so the step's logits are its)."""
        seconds_left = step.cap.time_left_s if step.cap is not None else None
        grant = self.connector.grant(request, num_computed, seconds_left)
        if grant.num_computed_tokens != num_computed:
            raise ValueError(
                f"grant for request {request.request_id!r} starts at {grant.num_computed_tokens}, "
                f"asked at {num_computed}"
            )
        num_load = max(0, min(grant.num_load_tokens, request.num_tokens - 1 - num_computed))
        if grant.wait is GrantWait.NONE and grant.max_compute_tokens == 0 and num_load == 0:
            # it may only load, and nothing is there to load: it waits (a running request) or
            # the connector contradicts itself (a waiting one)
            return grant._replace(num_load_tokens=0, wait=GrantWait.TAIL)
        return grant._replace(num_load_tokens=num_load)

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
        if self.connector is not None:
            self.connector.request_preempted(request)
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

    def update_from_result(self, output: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """A step's result: the connector applies its worker report, then
        `update_from_output`. Returns the requests that got a new token."""
        finished_sending_ids, finished_recving_ids = self.apply_connector_report(result.connector_report)
        return self.update_from_output(
            output,
            result.request_id_to_token,
            result.load_failures,
            finished_sending_ids,
            result.request_id_to_accepted_draft_ids,
            finished_recving_ids,
        )

    def apply_abandoned_report(self, report) -> None:
        """The worker report of a step the engine gave up after a failed one (its tokens
        are dropped, its requests rolled back or ended): the transfers it reports on ran
        all the same (saves written, fetches ended, CPU-tier slots filled, loads over), so it
        is applied as a collected step's is. Dropping it left finished requests waiting
        for their saves forever and their blocks and slots held. Called by the engine core,
        oldest step first, before it rolls the requests back."""
        finished_sending_ids, finished_recving_ids = self.apply_connector_report(report)
        self.free_sent(finished_sending_ids)
        self.readmit_received(finished_recving_ids)

    def apply_connector_report(self, report) -> tuple[set[str], set[str]]:
        """The connector's scheduler side applies a step's worker report (called once per
        step result, before `update_from_output`) -> (request ids done sending, request
        ids whose fetch ended or progressed)."""
        if self.connector is None or report is None:
            return set(), set()
        return self.connector.update_connector_output(report)

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
