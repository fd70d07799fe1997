"""A submitted model-runner step whose sampled tokens are read later, and an optional
timeline of when the device ran each step (benchmarks read it).

`ModelRunner.submit` returns a `StepFuture` as soon as the step's work is queued; the
engine core calls `result()` once, when it needs the step's tokens. On CUDA a kernel
writes the sampled ids into pinned host memory behind the step's kernels
(`engine.host_readback`: not on a copy engine, where they would queue behind the
connector's saves), so `result()` waits for that step only; on CPU the work is done by
the time `submit` returns and `result()` only converts. Not thread-safe.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.runner_output import RunnerOutput

if TYPE_CHECKING:
    from engine.host_readback import PendingRead


class StepFuture:
    """The outcome of one submitted step. `output` is complete except for
    `request_id_to_token`, which `result()` fills from the sampled ids."""

    def __init__(
        self,
        output: RunnerOutput,
        sampled_request_ids: list[str],
        token_ids: torch.Tensor | PendingRead | None,
    ) -> None:
        """`token_ids`: the sampled ids in `sampled_request_ids`' order, as a host tensor
        (CPU), a read queued by the runner's `HostReadback` (CUDA), or None (no sampling)."""
        self._output = output
        self._sampled_request_ids = sampled_request_ids
        self._token_ids = token_ids
        self._done = token_ids is None

    @classmethod
    def done(cls, output: RunnerOutput) -> StepFuture:
        """A step whose tokens are known already (no sampling, or drafts verified)."""
        return cls(output, [], None)

    @property
    def connector_report(self):
        """The connector worker's report made when the step was submitted (None without
        a connector); known before the tokens, so a step given up still gives it."""
        return self._output.connector_report

    def result(self) -> RunnerOutput:
        """Wait for the step's sampled tokens -> its output (idempotent)."""
        if not self._done:
            tokens = self._token_ids.tolist()  # a PendingRead waits for its kernel only
            self._output.request_id_to_token = dict(zip(self._sampled_request_ids, tokens, strict=True))
            self._done = True
        return self._output


class DeviceTimeline:
    """When each step's device work began and ended, to measure the device's idle time
    between steps: CUDA events on CUDA (the gap is time the GPU had nothing queued), host
    clocks on CPU (where the "device" is the host: the gap is the engine's own work
    between two forward passes). The model runner marks `begin` right before a step's
    forward pass and `end` after its sampling is queued."""

    def __init__(self, device: torch.device) -> None:
        self._on_cuda = device.type == "cuda"
        self._marks: list[tuple[object, object]] = []
        self._begin: object | None = None

    def _mark(self) -> object:
        if self._on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        self._begin = self._mark()

    def end(self) -> None:
        self._marks.append((self._begin, self._mark()))

    def clear(self) -> None:
        self._marks.clear()

    def gaps_s(self) -> list[float]:
        """Seconds between the end of each step and the begin of the next (waits for
        the device on CUDA)."""
        if self._on_cuda:
            torch.cuda.synchronize()
            return [
                max(0.0, end.elapsed_time(begin) / 1e3)
                for (_, end), (begin, _) in zip(self._marks, self._marks[1:], strict=False)
            ]
        return [
            max(0.0, begin - end) for (_, end), (begin, _) in zip(self._marks, self._marks[1:], strict=False)
        ]

    def busy_s(self) -> list[float]:
        """Seconds of each step from begin to end."""
        if self._on_cuda:
            torch.cuda.synchronize()
            return [begin.elapsed_time(end) / 1e3 for begin, end in self._marks]
        return [end - begin for begin, end in self._marks]
