"""Hidden states between neighbouring pipeline stages, over torch.distributed.

Per step, stage k sends stage k+1 a header (int64: step id, status, number of
tokens, then per request the tokens its loads truly placed, or -1) and, when the
status is OK, the hidden states [num_tokens, hidden_size]. The header makes a
failure travel down the pipeline: a stage whose step failed (or whose upstream
did) sends ERROR and no tensor, so no stage waits for hidden states that will not
come. With gloo, tensors go through host memory (stages that share one GPU).
"""

from __future__ import annotations

import datetime
from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.pipeline.failure import run_collective, start_collective, wait_collective

STATUS_OK = 0
STATUS_ERROR = 1
_HEADER_FIELDS = 3  # step id, status, number of tokens


class StageInput(NamedTuple):
    """What a stage received from the previous one for one step."""

    ok: bool
    hidden: torch.Tensor | None
    #: request id -> leading tokens truly in the cache on some earlier stage (its loads stopped early)
    load_failures: dict[str, int]


def open_store(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of one engine's stages; rank 0 hosts it (`port` 0: a free
    port, read back from `store.port`). Called once per stage at engine start."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)


def create_process_group(
    backend: str, store: dist.Store, host: str, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroup:
    """The engine's own process group (blocks until every stage joined). Never the
    process-global default group: two engines may run in one process."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"unknown process-group backend {backend!r}")


class StageLink:
    """One stage's ends of the pipeline: receive from `rank - 1`, send to `rank + 1`.
    Used by one thread of its process, once per step each way."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        backend: str,
        device: torch.device,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.group = group
        self.rank = rank
        # NCCL moves device tensors; gloo host tensors
        self.wire_device = device if backend == "nccl" else torch.device("cpu")
        self.device = device
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._pending: list = []
        self._keep_alive: tuple = ()

    def send(
        self,
        step_id: int,
        request_ids: list[str],
        hidden: torch.Tensor | None,
        load_failures: dict[str, int],
    ) -> None:
        """Send the step's output to the next stage without waiting for it to arrive (the
        next `send` or `drain` waits). `hidden` None sends an ERROR header alone."""
        self.drain()
        num_tokens = 0 if hidden is None else hidden.shape[0]
        header = [step_id, STATUS_OK if hidden is not None else STATUS_ERROR, num_tokens]
        header += [load_failures.get(request_id, -1) for request_id in request_ids]
        header_tensor = torch.tensor(header, dtype=torch.int64, device=self.wire_device)
        self._pending.append(start_collective(self.group.send, [header_tensor], self.rank + 1, 0))
        if hidden is not None:
            # as bytes: every backend moves uint8, not every one bfloat16
            payload = hidden.to(self.wire_device).contiguous().view(torch.uint8)
            self._pending.append(start_collective(self.group.send, [payload], self.rank + 1, 0))
        # the tensors must outlive their sends
        self._keep_alive = (header_tensor, None if hidden is None else payload)

    def drain(self) -> None:
        """Wait for the sends in flight (they end once the next stage received them)."""
        pending, self._pending = self._pending, []
        for work in pending:
            wait_collective(work)

    def receive(self, step_id: int, request_ids: list[str]) -> StageInput:
        """Block until the previous stage's output of `step_id` is here. RuntimeError when
        the header is of another step (the stages lost step with each other)."""
        header = torch.empty(_HEADER_FIELDS + len(request_ids), dtype=torch.int64, device=self.wire_device)
        run_collective(self.group.recv, [header], self.rank - 1, 0)
        values = header.tolist()
        received_step, status, num_tokens = values[:_HEADER_FIELDS]
        if received_step != step_id:
            raise RuntimeError(f"pipeline stage {self.rank} expected step {step_id}, got {received_step}")
        load_failures = {
            request_id: num_valid
            for request_id, num_valid in zip(request_ids, values[_HEADER_FIELDS:], strict=True)
            if num_valid >= 0
        }
        if status != STATUS_OK:
            return StageInput(False, None, load_failures)
        element_size = torch.empty((), dtype=self.dtype).element_size()
        payload = torch.empty(
            num_tokens, self.hidden_size * element_size, dtype=torch.uint8, device=self.wire_device
        )
        run_collective(self.group.recv, [payload], self.rank - 1, 0)
        return StageInput(True, payload.view(self.dtype).to(self.device), load_failures)
