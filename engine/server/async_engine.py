"""An asyncio front end over one `EngineCore`: many clients, one batched step loop.

One background thread owns the engine. Coroutines submit requests and aborts
through a thread-safe queue; the thread admits them between steps, runs
`EngineCore.step` continuously while any request is unfinished, and hands each
output back to the submitting coroutine's own `asyncio.Queue` with
`loop.call_soon_threadsafe`. Requests from different clients therefore share
engine steps (continuous batching), unlike a lock around `LLM.generate`.

A step that raises fails only the request that causes it: `EngineCore.step` retries
the requests of a failed step in smaller groups (a warning line each time) until one
fails a step alone, then ends it and runs a probe step without it. That request's
client gets `RequestFailedError`, the cause is logged once with its traceback,
`kvstash_engine_step_errors_total` counts every failed step, and the loop goes on.
The engine is taken for broken, and the thread stops (every later request gets
`EngineDeadError`), when cleaning up after a step raises, when the device reports an
error after the step (a sticky CUDA error), or when `max_consecutive_step_errors`
requests in a row failed alone and the probe step failed after each of them (failures
no request explains). A request that fails the engine on its own never stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.config import SamplingParams
from engine.engine_core import EngineCore, EngineStepError
from engine.metrics import EngineMetrics
from engine.request import RequestOutput

logger = logging.getLogger(__name__)


#: failures in a row that no single request explains (the probe step after them failed
#: too) after which the engine is taken for broken
MAX_CONSECUTIVE_STEP_ERRORS = 3


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an unrecoverable step failure, or shutdown)."""


class RequestFailedError(RuntimeError):
    """The engine step that ran this request raised; the request was ended. Its message
    names no internals: the cause is in the server log."""


@dataclass
class _Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future  # set to None once queued in the engine, or to the ValueError
    outputs: asyncio.Queue  # RequestOutput items (the last one finished), or an exception on failure
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Tracking:
    """What the engine thread remembers about a live request."""

    submission: _Submission
    num_tokens: int = 0
    last_token_time: float = field(default_factory=time.monotonic)


_STOP = object()


class AsyncEngine:
    """Owns the engine thread. `start()` once, `generate()` from any coroutine,
    `shutdown()` once; safe to create several in one process."""

    def __init__(
        self,
        engine: EngineCore,
        metrics: EngineMetrics | None = None,
        max_consecutive_step_errors: int = MAX_CONSECUTIVE_STEP_ERRORS,
    ) -> None:
        if max_consecutive_step_errors < 1:
            raise ValueError(f"max_consecutive_step_errors must be >= 1, got {max_consecutive_step_errors}")
        self.engine = engine
        self.metrics = metrics if metrics is not None else EngineMetrics(engine)
        self.max_consecutive_step_errors = max_consecutive_step_errors
        self._num_consecutive_step_errors = 0
        self._inbox: queue.Queue = queue.Queue()
        self._request_id_to_tracking: dict[str, _Tracking] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # guards `_closed` against submissions racing the engine thread's exit
        self._lock = threading.Lock()
        self._closed = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread is not None and not self._closed

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the async engine is already started")
        self._thread = threading.Thread(target=self._run, name="kvstash-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread; unfinished requests end with EngineDeadError."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit the request, then yield its cumulative outputs until it finishes.
        Raises ValueError before yielding anything when the engine rejects it."""
        outputs = await self.add_request(request_id, prompt_token_ids, params, cache_salt)
        async for output in self.stream_outputs(request_id, outputs):
            yield output

    async def stream_outputs(self, request_id: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield an admitted request's cumulative outputs until it finishes. Raises
        RequestFailedError when the step running it failed, EngineDeadError when the
        engine thread stops. Closing the iterator early
        (a client disconnect) aborts the request."""
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine forgot the request already
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> asyncio.Queue:
        """Queue one request for the engine thread and wait until it is admitted.
        Returns the queue its outputs arrive on; raises ValueError when rejected
        (``cache_salt``, ``kv_transfer_params``: see ``EngineCore.add_request``)."""
        loop = asyncio.get_running_loop()
        submission = _Submission(
            request_id,
            list(prompt_token_ids),
            params,
            loop,
            loop.create_future(),
            asyncio.Queue(),
            cache_salt,
            kv_transfer_params,
        )
        with self._lock:
            if self._thread is None or self._closed:
                # the cause stays in the server log, never in a client's answer
                reason = (
                    "it failed, see the server log" if self._error is not None else "not started or shut down"
                )
                raise EngineDeadError(f"the engine is not running ({reason})")
            self._inbox.put(submission)
        error = await submission.admitted
        if error is not None:
            raise error
        return submission.outputs

    async def durable_transfer_params(
        self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None
    ) -> dict | None:
        """A producer's hand-over of a finished request: its response's
        ``kv_transfer_params``, once its KV is durable in the shared tier (waited for on a
        thread of its own, never the engine's). None without a shared tier."""
        connector = self.engine.scheduler.connector
        if connector is None:
            return None
        params = await asyncio.to_thread(
            connector.durable_transfer_params, request_id, prompt_token_ids, cache_salt
        )
        return None if params is None else params.to_dict()

    def abort(self, request_id: str) -> None:
        """End a request from any thread (e.g. its client went away); unknown ids are ignored."""
        self._inbox.put(_Abort(request_id))

    # ---- the engine thread -----------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain_inbox(block):
                    break
                if self.engine.has_unfinished_requests() and not self._step():
                    break
        except BaseException as error:  # noqa: BLE001 - every waiting client must hear of it
            logger.exception("engine thread stopped: the engine could not recover from an error")
            self._error = error
        finally:
            with self._lock:
                self._closed = True
            self._fail_all(self._error or EngineDeadError("the engine was shut down"))

    def _step(self) -> bool:
        """Run one engine step and deliver its outputs. Returns False when the step failed
        and the engine cannot go on."""
        try:
            outputs = self.engine.step()
        except EngineStepError as error:
            return self._end_failed_step(error)
        self._num_consecutive_step_errors = 0
        self._deliver(outputs)
        return True

    def _end_failed_step(self, error: EngineStepError) -> bool:
        """Fail the requests the engine ended (it aborted them already), log the cause
        once with its traceback (a warning line while the engine retries the step's
        requests in smaller groups), and decide whether the engine may step again."""
        cause = error.__cause__ or error
        request_ids = [output.request_id for output in error.outputs]
        if error.engine_ok is False:
            self._num_consecutive_step_errors += 1
        elif error.engine_ok:
            self._num_consecutive_step_errors = 0
        if error.num_retried:
            logger.warning(
                "engine step of %d requests failed (%s: %s); retrying them in smaller groups",
                error.num_retried,
                type(cause).__name__,
                cause,
            )
        else:
            explained = {
                True: "the engine runs without it",
                False: f"the engine fails without it too ({self._num_consecutive_step_errors} in a row)",
                None: "the engine could not be probed",
            }[error.engine_ok]
            logger.error(
                "engine step failed; ended its request(s) %s (%s)",
                ", ".join(request_ids) or "-",
                explained,
                exc_info=cause,
            )
        failed = RequestFailedError(
            "the engine step running this request failed; the request was ended (see the server log)"
        )
        for output in error.outputs:
            self._record_finished(output)
            tracking = self._request_id_to_tracking.pop(output.request_id, None)
            if tracking is not None:
                _send(tracking.submission, failed)
        reason = None
        device_error = self.engine.device_error()
        if device_error is not None:
            reason = f"the device reports an error after the step: {device_error}"
        elif self._num_consecutive_step_errors >= self.max_consecutive_step_errors:
            reason = (
                f"{self._num_consecutive_step_errors} requests in a row failed a step alone and the "
                "engine's probe step failed after each"
            )
        if reason is None:
            return True
        logger.error("engine stopped: %s; every request now gets 503", reason)
        self._error = EngineDeadError(reason)
        return False

    def _drain_inbox(self, block: bool) -> bool:
        """Admit submissions and apply aborts; waits for one item when `block`.
        Returns False when asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            if isinstance(item, _Abort):
                self._abort(item.request_id)
            else:
                self._admit(item)

    def _admit(self, submission: _Submission) -> None:
        try:
            self.engine.add_request(
                submission.request_id,
                submission.prompt_token_ids,
                submission.params,
                cache_salt=submission.cache_salt,
                kv_transfer_params=submission.kv_transfer_params,
            )
        except ValueError as error:
            _resolve(submission, error)
            return
        self._request_id_to_tracking[submission.request_id] = _Tracking(submission)
        _resolve(submission, None)

    def _abort(self, request_id: str) -> None:
        tracking = self._request_id_to_tracking.pop(request_id, None)
        output = self.engine.abort_request(request_id)
        if output is not None and tracking is not None:
            self._record_finished(output)
            _send(tracking.submission, output)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            tracking = self._request_id_to_tracking.get(output.request_id)
            if tracking is None:
                continue
            num_new = len(output.token_ids) - tracking.num_tokens
            if num_new > 0:
                first = tracking.num_tokens == 0
                inter_token_s = None if first else (now - tracking.last_token_time) / num_new
                self.metrics.observe_output(num_new, output.metrics.ttft_s if first else None, inter_token_s)
                tracking.num_tokens = len(output.token_ids)
                tracking.last_token_time = now
            if output.finished:
                del self._request_id_to_tracking[output.request_id]
                self._record_finished(output)
            _send(tracking.submission, output)

    def _record_finished(self, output: RequestOutput) -> None:
        connector = self.engine.scheduler.connector
        transfer = connector.request_stats(output.request_id) if connector is not None else None
        self.metrics.observe_finished(output, transfer)

    def _fail_all(self, error: BaseException) -> None:
        dead = (
            error
            if isinstance(error, EngineDeadError)
            else EngineDeadError("the engine stopped after an error (see the server log)")
        )
        for tracking in self._request_id_to_tracking.values():
            _send(tracking.submission, dead)
        self._request_id_to_tracking.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Submission):
                _resolve(item, dead)


def _resolve(submission: _Submission, error: BaseException | None) -> None:
    def settle() -> None:
        if not submission.admitted.done():
            submission.admitted.set_result(error)

    _call_soon(submission.loop, settle)


def _send(submission: _Submission, item: RequestOutput | BaseException) -> None:
    _call_soon(submission.loop, submission.outputs.put_nowait, item)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    # a closed event loop raises RuntimeError: its client is gone, nobody waits any more
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)
