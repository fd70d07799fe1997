"""The first process's side of tensor parallelism: it starts the rank processes, runs
rank 0 itself, hands every other rank each step's plan, and merges their answers
(docs/architecture.md, "Tensor parallelism"). The scheduler, the block manager, the
scheduler-side connector and the tokenizer stay in this process; only rank 0 samples.

One step in flight (`execute`): every rank runs the same plan, their collectives keep
them in step. A rank that dies (killed, crashed) is noticed while waiting for its
answer: every other rank is then stopped, the step raises `TensorParallelDeadError`,
and every later step too (the engine ends its requests with an error).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.pipeline import PipelineDeadError, PipelineStageError
from engine.pipeline.comm import open_store
from engine.pipeline.executor import POLL_S, START_TIMEOUT_S, STORE_HOST, TRANSFER_TIMEOUT_S, _stop_processes
from engine.pipeline.layer_split import process_group_backend, stage_device
from engine.pipeline.messages import StageReply, merge_load_failures, to_stage_plan
from engine.pipeline.worker import FLUSH, StageAllocation
from engine.runner_output import RunnerOutput
from engine.scheduler import SchedulerOutput
from engine.tensor_parallel.layout import check_tensor_parallel_size, rank_layout
from engine.tensor_parallel.rank_runner import PeerRankError, TensorParallelRunner
from engine.tensor_parallel.worker import (
    RankSpec,
    build_runner,
    create_rank_connectors,
    join_and_load,
    run_rank,
)

logger = logging.getLogger(__name__)


class TensorParallelDeadError(PipelineDeadError):
    """A rank process is gone: the engine cannot run another step."""


class TensorParallelRankError(PipelineStageError):
    """A step failed on another rank (every rank ended it); the engine stays usable."""


class TensorParallelExecutor:
    """Owns the rank processes. Constructed once by `EngineCore` (every rank's weights
    loaded on return), then `start_runners` once, then `execute` once per step from the
    engine's one driving thread; `shutdown` at the end (idempotent; also run when the
    executor is garbage-collected or the interpreter exits)."""

    def __init__(
        self,
        model_config: ModelConfig,
        model_dir: Path | None,
        *,
        tensor_parallel_size: int,
        device: torch.device,
        dtype: torch.dtype,
        dummy_weights: bool,
    ) -> None:
        size = tensor_parallel_size
        check_tensor_parallel_size(model_config, size)
        self.model_config = model_config
        self.size = size
        self.devices = [stage_device(device, rank, size) for rank in range(size)]
        self.backend = process_group_backend(self.devices)
        self.device = self.devices[0]
        self.dtype = dtype
        self.layout = rank_layout(model_config, 0, size)
        self.dead_reason: str | None = None
        self.connector = None  # rank 0's worker-side connector (set by start_runners)
        self.runner: TensorParallelRunner | None = None
        self._step_id = 0
        self._store = open_store(STORE_HOST, 0, 0, size, TRANSFER_TIMEOUT_S)
        self._specs = [
            RankSpec(
                rank=rank,
                size=size,
                model_config=model_config,
                model_dir=None if model_dir is None else str(model_dir),
                dummy_weights=dummy_weights,
                device=str(self.devices[rank]),
                dtype=dtype,
                backend=self.backend,
                store_host=STORE_HOST,
                store_port=self._store.port,
                timeout_s=TRANSFER_TIMEOUT_S,
            )
            for rank in range(size)
        ]
        context = multiprocessing.get_context("spawn")
        self._processes: list[Any] = []
        self._conns: list[Any] = []
        for spec in self._specs[1:]:
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_rank, args=(spec, theirs), name=f"kvstash-tp-rank{spec.rank}", daemon=True
            )
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop_processes, self._processes, self._conns)
        for rank in range(1, size):
            try:
                self._expect(rank, "started", START_TIMEOUT_S)
            except PipelineDeadError as error:
                raise TensorParallelDeadError(
                    f"{error} while starting (its traceback is above); a program that starts an "
                    "engine of several ranks must run it under `if __name__ == '__main__':`, "
                    "since each rank process re-imports the main module (multiprocessing spawn)"
                ) from None
        self.group, _, self.model = join_and_load(self._specs[0], self._store)
        for rank in range(1, size):
            self._expect(rank, "loaded", START_TIMEOUT_S)
        logger.info(
            "tensor parallelism over %d ranks (%s) on %s",
            size,
            self.backend,
            ", ".join(str(d) for d in self.devices),
        )

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the ranks after the first (tests kill one)."""
        return [process.pid for process in self._processes]

    stage_pids = rank_pids  # the name the engine's callers know from pipeline stages

    def create_connectors(self, kv_offload, model_id: str, block_size: int):
        """Rank 0's connector pair: the scheduler side is the engine's (lookups on rank 0's
        tiers; a chunk another rank lacks is a load failure there, merged by the runners)."""
        return create_rank_connectors(
            kv_offload, self.layout, self.model_config, self.dtype, block_size, self.device, model_id
        )

    def start_runners(
        self, num_blocks: int, block_size: int, connector, kv_offload, model_id: str | None
    ) -> TensorParallelExecutor:
        """Every rank allocates its KV pool of `num_blocks` blocks (its KV heads) and builds
        its runner and connector. Returns self: the engine's runner."""
        allocation = StageAllocation(num_blocks, block_size, kv_offload, model_id)
        for conn in self._conns:
            conn.send(allocation)
        self.connector = connector
        self.runner = build_runner(self._specs[0], self.group, self.layout, self.model, allocation, connector)
        for rank in range(1, self.size):
            self._expect(rank, "ready", START_TIMEOUT_S)
        return self

    def execute(
        self, plan: SchedulerOutput, while_device_runs: Callable[[], None] | None = None
    ) -> RunnerOutput:
        """One step on every rank: the interface of `ModelRunner.execute`. Raises
        TensorParallelRankError when the step failed on another rank (every rank ended it:
        the engine may retry), TensorParallelDeadError when a rank is gone."""
        self._check_alive()
        self._step_id += 1
        step_id = self._step_id
        rank_plan = to_stage_plan(plan, step_id)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(rank_plan)
            except (BrokenPipeError, ConnectionResetError, EOFError) as error:
                self._die(f"tensor-parallel rank {rank} cannot be reached ({type(error).__name__})")
        output = error = None
        try:
            output = self.runner.execute(plan, while_device_runs)
        except Exception as raised:  # noqa: BLE001 - the other ranks still answer this step
            error = raised
        replies = [self._reply(rank, step_id) for rank in range(1, self.size)]
        if error is not None and not isinstance(error, PeerRankError):
            raise error
        failed = next((reply for reply in replies if reply.error is not None), None)
        if failed is not None:
            # the rank that failed first says why (rank 0 then raised PeerRankError)
            rank = replies.index(failed) + 1
            raise TensorParallelRankError(
                f"tensor-parallel rank {rank} failed step {step_id}: {failed.error}"
            ) from error
        if error is not None:
            raise error
        output.load_failures = merge_load_failures(output.load_failures, *(r.load_failures for r in replies))
        return output

    def flush_connectors(self) -> None:
        """Wait until every other rank's queued lower-tier writes were attempted."""
        self._check_alive()
        for rank, conn in enumerate(self._conns, start=1):
            conn.send(FLUSH)
            self._expect(rank, "flushed", None)

    def shutdown(self) -> None:
        """Stop every rank process (each closes its connector first). Idempotent."""
        self._finalizer()

    # ---- waiting on ranks --------------------------------------------------------
    def _reply(self, rank: int, step_id: int) -> StageReply:
        reply = self._receive(rank, None)
        if not isinstance(reply, StageReply) or reply.step_id != step_id:
            self._die(f"tensor-parallel rank {rank} answered out of step: {reply!r:.200}")
        return reply

    def _expect(self, rank: int, kind: str, timeout_s: float | None) -> Any:
        message = self._receive(rank, timeout_s)
        if isinstance(message, tuple) and message[0] == "error":
            self._die(f"tensor-parallel rank {rank} failed to start:\n{message[1]}")
        if not (isinstance(message, tuple) and message[0] == kind):
            self._die(f"tensor-parallel rank {rank} sent {message!r:.200} instead of {kind!r}")
        return message[1]

    def _receive(self, rank: int, timeout_s: float | None) -> Any:
        """The next message of `rank`, watching every rank's liveness meanwhile."""
        conn = self._conns[rank - 1]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                if conn.poll(POLL_S):
                    return conn.recv()
            except (EOFError, ConnectionResetError, OSError):
                process = self._processes[rank - 1]
                process.join(1.0)  # a dead rank's pipe closes first: say why it died
                if process.exitcode is None:
                    self._die(f"tensor-parallel rank {rank} closed its connection")
                self._check_alive()
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                self._die(f"tensor-parallel rank {rank} did not answer within {timeout_s:.0f} s")

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise TensorParallelDeadError(self.dead_reason)
        for rank, process in enumerate(self._processes, start=1):
            if not process.is_alive():
                code = process.exitcode
                how = (
                    f"was killed by signal {-code}"
                    if code is not None and code < 0
                    else f"exited with code {code}"
                )
                self._die(f"tensor-parallel rank {rank} (pid {process.pid}) {how}")

    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("%s; stopping the other ranks", reason)
            self._finalizer()
        raise TensorParallelDeadError(self.dead_reason)
