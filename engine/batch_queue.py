"""Asynchronous scheduling: a queue of up to two submitted steps (vLLM's
`step_with_batch_queue` and async scheduling).

While step N runs on the device, the engine schedules and submits step N+1; it
waits for a step's sampled tokens only when the queue is full or nothing new can be
scheduled. To plan N+1 before N's tokens are known, the queue applies each
submitted step's effect ahead of time: its requests' `num_computed_tokens` advance
by their scheduled tokens, and a request that samples gets one
`num_output_placeholders` (the scheduler then gives it its next position; the model
runner takes that position's input id from N's sampled tokens on the device).
Around `update_from_output` of a collected step the queue takes every step's
advance back, so the scheduler sees exactly the state a synchronous engine would,
then re-applies the advances of the steps still in flight.

What a step in flight computes for a request that changed meanwhile is dropped,
never shown: a request that finished (EOS, stop string, `max_tokens`, abort) in an
earlier step is skipped by `update_from_output`; one preempted by a later schedule,
or whose KV load failed, is removed from the step's plan before its update.

With pipeline parallelism (`num_stages` > 1) the queue holds up to one micro-batch per
stage, as vLLM V1 does: a request in a micro-batch in flight is not scheduled again
until that micro-batch was collected (its sampled token came back from the last stage
through the executor), so micro-batches hold disjoint requests and no input id is
filled on the device. Each micro-batch takes at most 1/`num_stages` of the unfinished
requests, so that with several requests every stage has one to run; one request alone
runs one micro-batch at a time (no overlap). The oldest micro-batch is collected
before the next is planned when the queue is full or every request is in flight.

Synchronous steps (the queue collects at once): a step with connector loads (a load
that fails must be known before the request's next step computes or saves on top of
it), and a plan without requests (its connector bookkeeping runs after every step in
flight). Speculative decoding runs without the queue (drafts need the accepted
tokens of the previous step). Called only by `EngineCore`; not thread-safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput
from engine.runner_output import RunnerOutput
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step_future import StepFuture

#: steps submitted and not yet collected, at most
MAX_STEPS_IN_FLIGHT = 2

#: `EngineCore`'s end of a step: (plan, runner output, perf_counter at submit) -> outputs
FinishStep = Callable[[SchedulerOutput, RunnerOutput, float], list[RequestOutput]]


@dataclass
class _Advance:
    """What one step in flight adds to one request's state while it is in flight."""

    request: Request
    num_tokens: int
    num_placeholders: int  # 1 when the step samples a token for the request, else 0
    #: whether it is added now (not while the scheduler updates, nor once the request
    #: ended, was preempted or must recompute after a failed load)
    applied: bool = False

    def apply(self) -> None:
        if not self.applied:
            self.request.num_computed_tokens += self.num_tokens
            self.request.num_output_placeholders += self.num_placeholders
            self.applied = True

    def take_back(self) -> None:
        if self.applied:
            self.request.num_computed_tokens -= self.num_tokens
            self.request.num_output_placeholders -= self.num_placeholders
            self.applied = False


@dataclass
class InFlightStep:
    """A submitted step: its plan, the runner's future and what it advanced."""

    plan: SchedulerOutput
    future: StepFuture
    began: float
    advances: list[_Advance]
    #: requests whose output of this step is dropped (preempted or reloaded since)
    dropped_request_ids: set[str] = field(default_factory=set)


class BatchQueue:
    """The engine core's steps in flight (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *, num_stages: int = 1) -> None:
        """`num_stages` > 1: `runner` is the pipeline executor and steps are micro-batches
        of disjoint requests, up to `num_stages` in flight."""
        self.scheduler = scheduler
        self.runner = runner
        self.num_stages = num_stages
        self.max_steps_in_flight = num_stages if num_stages > 1 else MAX_STEPS_IN_FLIGHT
        self._in_flight: deque[InFlightStep] = deque()
        #: the step `_collect_oldest` is updating (a step that raises there is abandoned too)
        self._collecting: InFlightStep | None = None
        #: perf_counter when the latest step's tokens were read: the device starts a step
        #: queued behind another about then (the connector times prefill from it)
        self._last_collected_at = 0.0
        #: outputs of steps in flight dropped: their request had ended, was preempted or
        #: must recompute after a failed load (tests, stats)
        self.num_dropped_outputs = 0
        #: steps collected at once because they had loads or no requests (tests, stats)
        self.num_sync_steps = 0
        #: steps submitted while another was in flight (tests, stats)
        self.num_overlapped_steps = 0

    def __len__(self) -> int:
        return len(self._in_flight)

    # --- the step -----------------------------------------------------------------------

    def step(self, finish: FinishStep, take_snapshot: Callable[[list[Request]], None]) -> list[RequestOutput]:
        """Schedule and submit one step (planning ahead of the steps in flight), then
        collect the oldest step if the queue is full, the new step must run alone, or
        there was nothing new to submit. -> the outputs of the steps collected (none
        while the queue fills)."""
        if self.num_stages > 1:
            return self._step_micro_batch(finish, take_snapshot)
        plan = self.scheduler.schedule()
        self._forget_preempted(plan.preempted_request_ids)
        if not plan.requests:
            outputs = self.drain(finish)
            if self.scheduler.waits_only_for_transfers(plan):
                # Only background fetches are under way: sleep until one progresses, not spin.
                self.runner.connector.wait_for_transfers(0.005)
            began = time.perf_counter()
            self.num_sync_steps += 1
            return latest_per_request(outputs + finish(plan, self.runner.execute(plan), began))
        outputs = self._submit(plan, finish, take_snapshot)
        if outputs is not None:
            return outputs
        if len(self._in_flight) < MAX_STEPS_IN_FLIGHT:
            return []
        return self._collect_oldest(finish)

    def _step_micro_batch(
        self, finish: FinishStep, take_snapshot: Callable[[list[Request]], None]
    ) -> list[RequestOutput]:
        """One step with pipeline stages: collect the oldest micro-batch while the queue is
        full or holds every unfinished request, then plan and submit a micro-batch of the
        requests that are in none."""
        scheduler = self.scheduler
        outputs: list[RequestOutput] = []
        while self._in_flight and (
            len(self._in_flight) >= self.max_steps_in_flight or not self._has_requests_to_schedule()
        ):
            outputs += self._collect_oldest(finish)
        # the requests that can run at once, shared out over the stages
        num_seated = min(len(scheduler.running) + len(scheduler.waiting), scheduler.max_num_seqs)
        plan = scheduler.schedule(
            exclude=self._requests_in_flight(),
            max_num_requests=max(1, math.ceil(num_seated / self.num_stages)),
        )
        self._forget_preempted(plan.preempted_request_ids)
        if not plan.requests:
            # its connector bookkeeping runs after every step in flight
            outputs += self.drain(finish)
            if scheduler.waits_only_for_transfers(plan):
                self.runner.connector.wait_for_transfers(0.005)
            began = time.perf_counter()
            self.num_sync_steps += 1
            return latest_per_request(outputs + finish(plan, self.runner.execute(plan), began))
        drained = self._submit(plan, finish, take_snapshot)
        return latest_per_request(outputs + (drained or []))

    def _submit(
        self, plan: SchedulerOutput, finish: FinishStep, take_snapshot: Callable[[list[Request]], None]
    ) -> list[RequestOutput] | None:
        """Submit a plan with requests -> the outputs of every step in flight when it had
        to run synchronously (connector loads), else None."""
        take_snapshot(plan.requests)
        began = time.perf_counter()
        if self._in_flight:
            self.num_overlapped_steps += 1
        future = self.runner.submit(plan)
        # prefix hashes that admission left out, while the device runs the step
        self.scheduler.hash_blocks_of(plan.requests)
        self._push(plan, future, began)
        if plan.connector_meta is not None and plan.connector_meta.loads:
            self.num_sync_steps += 1
            return self.drain(finish)
        return None

    def _requests_in_flight(self) -> set[Request]:
        return {request for step in self._in_flight for request in step.plan.requests}

    def _has_requests_to_schedule(self) -> bool:
        """Whether a running request is in no micro-batch in flight, or a waiting one may
        take a free seat. (A plan can still come out empty, e.g. when no block is free for
        a waiting request: then every micro-batch is collected before it runs.)"""
        scheduler = self.scheduler
        in_flight = self._requests_in_flight()
        if any(r not in in_flight for r in scheduler.running):
            return True
        return bool(scheduler.waiting) and len(scheduler.running) < scheduler.max_num_seqs

    def drain(self, finish: FinishStep) -> list[RequestOutput]:
        """Collect every step in flight, oldest first -> their outputs (the latest one
        per request)."""
        outputs: list[RequestOutput] = []
        while self._in_flight:
            outputs += self._collect_oldest(finish)
        return latest_per_request(outputs)

    def abandon(self, apply_report: Callable[[Any], None]) -> list[Request]:
        """After a step raised: forget every step in flight, taking their advances back
        -> their requests (the engine core ends or retries them with the failed step's).
        The connector reports of the steps no result was collected for go to
        `apply_report`, oldest first, once each step's device work ended (or failed): the
        transfers they report on (saves, fetches, CPU-tier slots) happened all the same."""
        for step in self._in_flight:
            with contextlib.suppress(Exception):  # the step's own failure: its report stands
                step.future.result()
            if step.future.connector_report is not None:
                apply_report(step.future.connector_report)
        requests: list[Request] = []
        collecting = [self._collecting] if self._collecting is not None else []
        for step in [*collecting, *self._in_flight]:
            requests += [r for r in step.plan.requests if r not in requests]
        for step in self._in_flight:
            for advance in step.advances:
                advance.take_back()
        for request in requests:
            request.num_output_placeholders = 0
        self._in_flight.clear()
        self._collecting = None
        return requests

    # --- bookkeeping --------------------------------------------------------------------

    def _push(self, plan: SchedulerOutput, future: StepFuture, began: float) -> None:
        advances = []
        for request, num_new in zip(plan.requests, plan.num_scheduled_tokens, strict=True):
            end = request.num_computed_tokens + num_new
            num_drafts = len(plan.request_id_to_spec_token_ids.get(request.request_id, ()))
            samples = end == request.num_tokens + request.num_output_placeholders + num_drafts
            advance = _Advance(request, num_new, int(samples))
            advance.apply()
            advances.append(advance)
        self._in_flight.append(InFlightStep(plan, future, began, advances))

    def _collect_oldest(self, finish: FinishStep) -> list[RequestOutput]:
        """Wait for the oldest step's tokens and update the scheduler with them, every
        advance taken back meanwhile."""
        step = self._in_flight[0]
        result = step.future.result()
        began, self._last_collected_at = max(step.began, self._last_collected_at), time.perf_counter()
        for in_flight in self._in_flight:
            for advance in in_flight.advances:
                advance.take_back()
        self._in_flight.popleft()
        self._collecting = step
        plan = step.plan
        self.num_dropped_outputs += sum(
            r.is_finished or r.request_id in step.dropped_request_ids for r in plan.requests
        )
        if step.dropped_request_ids:
            kept = [
                (r, n)
                for r, n in zip(plan.requests, plan.num_scheduled_tokens, strict=True)
                if r.request_id not in step.dropped_request_ids
            ]
            plan = dataclasses.replace(
                plan, requests=[r for r, _ in kept], num_scheduled_tokens=[n for _, n in kept]
            )
        outputs = finish(plan, result, began)
        reloaded = set(result.load_failures)
        for later in self._in_flight:
            later.dropped_request_ids |= reloaded
            for advance in later.advances:
                request = advance.request
                if not request.is_finished and request.request_id not in later.dropped_request_ids:
                    advance.apply()
        self._collecting = None
        return outputs

    def _forget_preempted(self, preempted_request_ids: list[str]) -> None:
        """A request preempted while steps in flight hold it restarts from nothing: its
        outputs of those steps are dropped and its advances void (preemption already
        reset `num_computed_tokens`)."""
        for request_id in preempted_request_ids:
            for step in self._in_flight:
                for advance in step.advances:
                    if advance.request.request_id == request_id:
                        advance.applied = False  # void: preemption reset the request
                        advance.request.num_output_placeholders = 0
                        step.dropped_request_ids.add(request_id)


def latest_per_request(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Outputs are cumulative: keep each request's latest, in order of first appearance."""
    latest: dict[str, RequestOutput] = {}
    for output in outputs:
        latest[output.request_id] = output
    return list(latest.values())
