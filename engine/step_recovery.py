"""What the engine core does when a step raises: it ends or retries that step's requests so
that the engine stays consistent and may step on (`EngineStepError`).

`EngineCore.step` calls `StepRecovery.retry_group` before each step, `step_passed` after a
step that raised nothing, and `recover` (or `end_all_with_error`, when a pipeline stage
died) after one that raised. A failed step of several requests ends none of them: they go
back to the waiting queue as they were before the step (`StepSnapshot`) and the next steps
run them in halves, then quarters..., until the one request that fails a step alone is
ended; a probe step of an internal one-token request then tells whether the engine works
without it. May change: the scheduler's queues and its step's requests, the engine's
`requests` (ended ones are removed), the requests' output tokens and seeded generators
(restored), the connector's step state (`abort_step`, `finish_saves`) and the engine's
`stats`. Not thread-safe: the engine core's one caller drives it.
"""

from __future__ import annotations

import logging

import torch

from engine.config import SamplingParams
from engine.engine_stats import EngineStats
from engine.request import Request, RequestOutput
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """`EngineCore.step` raised; the step's own exception is `__cause__`. Later steps may
    run: every request is either ended or back in the queue, blocks and connector state
    consistent.

    - `num_retried` > 0: the step held several requests; they were sent back (their
      output so far kept) to be retried in smaller groups, nothing was ended.
    - else the step held one request (or its groups narrowed down to one): that request
      is ended (finish_reason "error") through the abort path and is in `outputs`, with
      any request the step had finished before raising. `engine_ok` then tells whether a
      probe step of an internal one-token request ran right after: True means the engine
      works without the ended request (the failure was that request's own), False that it
      fails without it too, None that no probe could run.
    """

    def __init__(
        self, outputs: list[RequestOutput], *, num_retried: int = 0, engine_ok: bool | None = None
    ) -> None:
        if num_retried:
            message = f"an engine step failed; its {num_retried} requests are retried in smaller groups"
        else:
            ids = ", ".join(output.request_id for output in outputs) or "none"
            message = f"an engine step failed; its requests were ended: {ids}"
        super().__init__(message)
        self.outputs = outputs
        self.num_retried = num_retried
        self.engine_ok = engine_ok


#: request ids of the engine's probe requests (never a client's: clients' ids are
#: checked against this prefix)
PROBE_REQUEST_ID_PREFIX = "kvstash-probe-"


class StepRecovery:
    """Retries and ends the requests of failed steps (see the module's docstring); shares
    the engine core's scheduler, runner, `requests` and `stats`."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner,
        requests: dict[str, Request],
        stats: EngineStats,
        *,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.requests = requests
        self.stats = stats
        self.block_size = block_size
        self.max_model_len = max_model_len
        #: groups of requests a failed step sent back; while any is left each step runs
        #: only (part of) the first group, until the one request that fails is found
        self._retry_groups: list[list[Request]] = []
        self._num_probes = 0

    def retry_group(self) -> set[Request] | None:
        """The requests the next step may run while failed steps are being narrowed down,
        or None (a normal step). A group whose requests cannot be scheduled (no blocks
        while others hold them) is given up: its requests then run in normal steps."""
        while self._retry_groups:
            group = self._retry_groups[0]
            group[:] = [r for r in group if not r.is_finished]
            if group:
                return set(group)
            self._retry_groups.pop(0)
        return None

    def step_passed(self, group: set[Request] | None, snapshot: StepSnapshot) -> None:
        """After a step that raised nothing: the requests of the retried `group` that it ran
        are cleared (a group none of whose requests could be scheduled is given up)."""
        if group is not None:
            if not snapshot.request_ids:
                logger.warning(
                    "the requests retried after a failed step cannot be scheduled now; they run as usual"
                )
                self._retry_groups.clear()
            else:
                # a step that ran them passed: they are cleared
                self._retry_groups[0][:] = [
                    r for r in self._retry_groups[0] if r.request_id not in snapshot.request_ids
                ]

    def recover(self, group: set[Request] | None, snapshot: StepSnapshot) -> EngineStepError:
        """Make the engine consistent after a step raised; returns the error to raise."""
        if self.runner.connector is not None:
            self.runner.connector.abort_step(self.scheduler.step_connector_meta)
        step_requests = list(self.scheduler.step_requests)
        self.scheduler.step_requests = []
        # A request the step finished before raising cannot be rolled back (the connector
        # and the block pool took it over already): it is reported ended, as an error.
        finished = [r for r in step_requests if r.is_finished]
        unfinished = [r for r in step_requests if not r.is_finished]
        outputs = [self._end_with_error(r) for r in finished]
        if group is not None:
            self._retry_groups[0][:] = [r for r in self._retry_groups[0] if r not in unfinished]
        if len(unfinished) > 1:
            self._roll_back(unfinished, snapshot)
            half = len(unfinished) // 2
            self._retry_groups[:0] = [unfinished[:half], unfinished[half:]]
            self.stats.num_requests_retried += len(unfinished)
            return EngineStepError(outputs, num_retried=len(unfinished))
        outputs += [self._end_with_error(r) for r in unfinished]
        return EngineStepError(outputs, engine_ok=self._probe() if unfinished else None)

    def end_all_with_error(self) -> EngineStepError:
        """A pipeline stage died: no step can run any more. Every request is ended
        (finish_reason "error"); the engine reports itself dead (`device_error`)."""
        if self.runner.connector is not None:
            self.runner.connector.abort_step()
        self.scheduler.step_requests = []
        self._retry_groups.clear()
        outputs = [self._end_with_error(request) for request in list(self.requests.values())]
        return EngineStepError(outputs, engine_ok=False)

    def _roll_back(self, requests: list[Request], snapshot: StepSnapshot) -> None:
        """Send the requests back to the waiting queue as they were before the step."""
        if self.runner.connector is not None:
            # saves the step queued may still read the blocks that are freed here
            self.runner.connector.finish_saves()
        for request in reversed(requests):  # each goes to the front: keep their order
            snapshot.restore(request, self.block_size)
            self.scheduler.roll_back(request)

    def _end_with_error(self, request: Request) -> RequestOutput:
        """End a request of a failed step through the abort path (also one the step had
        finished: its client never saw the end)."""
        # gone already when the step finished it before raising: not reported either
        self.requests.pop(request.request_id, None)
        self.scheduler.finish_request(request, "error")
        request.finish_reason = "error"
        return request.to_output()

    def _probe(self) -> bool | None:
        """After a request failed a step alone: run one step of an internal one-token
        request alone. True when it completes (the engine works: the failure was the
        request's own), False when it raises too, None when it could not be scheduled."""
        self._num_probes += 1
        probe = Request(
            request_id=f"{PROBE_REQUEST_ID_PREFIX}{self._num_probes}",
            prompt_token_ids=[0],
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            eos_token_ids=frozenset(),
            max_model_len=self.max_model_len,
        )
        self.scheduler.add_request(probe)
        self.stats.num_probe_steps += 1
        try:
            plan = self.scheduler.schedule(only={probe})
            if plan.requests != [probe]:
                return None
            self.scheduler.update_from_result(plan, self.runner.execute(plan))
            return probe.is_finished and probe.finish_reason == "length"
        except Exception as error:  # noqa: BLE001 - the answer is the point
            logger.warning("the engine's probe step failed too: %s: %s", type(error).__name__, error)
            self.stats.num_probe_failures += 1
            if self.runner.connector is not None:
                self.runner.connector.abort_step(self.scheduler.step_connector_meta)
            return False
        finally:
            self.scheduler.step_requests = []
            self.scheduler.finish_request(probe, "abort")  # no-op once it finished


class StepSnapshot:
    """What a step may change of its requests that a retry must undo: output tokens and
    seeded generators (a retried request then samples exactly what it would have).
    Taken after scheduling, for the scheduled requests only."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()
        self._request_id_to_num_outputs: dict[str, int] = {}
        self._request_id_to_generator_state: dict[str, torch.Tensor] = {}

    def take(self, requests: list[Request]) -> None:
        for request in requests:
            self.request_ids.add(request.request_id)
            self._request_id_to_num_outputs[request.request_id] = len(request.output_token_ids)
            if request.generator is not None:
                self._request_id_to_generator_state[request.request_id] = request.generator.get_state()

    def restore(self, request: Request, block_size: int) -> None:
        num_outputs = self._request_id_to_num_outputs.get(request.request_id)
        if num_outputs is not None and len(request.output_token_ids) > num_outputs:
            del request.output_token_ids[num_outputs:]
            del request.all_token_ids[request.num_prompt_tokens + num_outputs :]
            del request.block_hashes[request.num_tokens // block_size :]
        state = self._request_id_to_generator_state.get(request.request_id)
        if state is not None:
            request.generator.set_state(state)
