"""The first process's side of pipeline parallelism: it starts the stage processes,
runs stage 0 itself, hands each later stage its plan, and collects the sampled
tokens that come back from the last stage (docs/architecture.md, Pipeline parallelism; seed 001: only the last
stage samples, and its tokens reach the scheduler through this process, since
the first and last stages never talk directly).

`execute` is `collect(submit(plan))`: one batch in flight, every stage answered on
return. With async scheduling the engine's batch queue instead `submit`s up to one
micro-batch per stage and reads each one's `result()` (its `collect`) oldest first:
plans carry a step id and stages answer in step order, so while the last stage runs
micro-batch N, stage 0 runs N+1. The micro-batches hold disjoint requests (the batch
queue schedules a request again only once its micro-batch was collected), so no stage
ever needs a token another micro-batch has not returned yet. A step given up without
being collected (the engine abandons the steps in flight after a failed one) has its
replies read and dropped by the next `collect`.

A stage that dies (killed, crashed) is noticed while waiting for any reply: every
other stage is then stopped, the step raises `PipelineDeadError`, and every later
step too (the engine ends its requests with an error). So is a step that raised with
the process group out of step (inside a tensor-parallel forward pass: the failing
process records its error in the store and exits, its peers' collectives break and
they exit too; engine.pipeline.failure): the error names the first failure.

With `nnodes` > 1 the processes span hosts (engine.nodes): this process starts only
node 0's share; the other nodes' launches (engine.pipeline.node) start theirs, which
connect to this process's control channel (engine.pipeline.control) at
`dist_init_addr` PORT + 1 and get their spec, plans and stop over it as node 0's own
get them over pipes; a node's launch watches its processes and tells this one when
one dies. The store and the process groups rendezvous at `dist_init_addr` itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.cuda_graphs import GraphSizes
from engine.nodes import node_process_range, parse_dist_init_addr
from engine.pipeline.comm import open_store
from engine.pipeline.control import ControlListener
from engine.pipeline.failure import (
    breaks_group,
    end_processes,
    first_failure,
    is_collective_failure,
    process_name,
    record_failure,
)
from engine.pipeline.layer_split import (
    StageLayout,
    process_group_backend,
    split_layers,
    stage_device,
)
from engine.pipeline.messages import StageReply, merge_load_failures, to_stage_plan
from engine.pipeline.stage_builder import PipelineStageBuilder
from engine.pipeline.stage_runner import StageRunner
from engine.pipeline.worker import FLUSH, STOP, StageAllocation, StageSpec, run_stage
from engine.runner_output import RunnerOutput
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

#: host of the stages' rendezvous store (one machine)
STORE_HOST = "127.0.0.1"
#: longest wait for one stage's start-up answer (weights loaded, KV allocated)
START_TIMEOUT_S = 600.0
#: longest a stage waits on a send or receive of hidden states before failing the step
TRANSFER_TIMEOUT_S = 600.0
#: how often the wait for a stage's answer checks that every stage still lives
POLL_S = 0.05
#: after a broken collective, how long to look for its cause (a process gone, a failure
#: recorded) before naming this process's own error
CAUSE_GRACE_S = 5.0
#: a stage told to stop gets this long to exit before it is terminated, then killed
STOP_GRACE_S = 3.0


class StepInFlight:
    """A submitted step: stage 0's output (or the error it raised) until `collect`.
    `result()` is `collect` (the batch queue's future interface); a second call gives
    the same output, or raises the same error."""

    def __init__(
        self, executor: PipelineExecutor, step_id: int, output: RunnerOutput | None, error: Exception | None
    ) -> None:
        self.executor = executor
        self.step_id = step_id
        self.output = output
        self.error = error
        self.collected = False

    def result(self) -> RunnerOutput:
        return self.executor.collect(self)

    @property
    def connector_report(self):
        """Stage 0's connector report, made when the step was submitted (None without a
        connector, or when stage 0 raised): a step given up still gives it."""
        return self.output.connector_report if self.output is not None else None


class PipelineDeadError(RuntimeError):
    """A stage process is gone: the pipeline cannot run another step."""


class PipelineStageError(RuntimeError):
    """A step failed in a later stage (raised there); the pipeline stays usable."""


class PipelineExecutor:
    """Owns the stage processes. Constructed once by `EngineCore` (weights of every
    stage loaded on return), then `start_runners` once, then `execute` once per step
    from the engine's one driving thread; `shutdown` at the end (idempotent; also run
    when the executor is garbage-collected or the interpreter exits)."""

    def __init__(
        self,
        model_config: ModelConfig,
        model_dir: Path | None,
        *,
        num_stages: int,
        device: torch.device,
        dtype: torch.dtype,
        dummy_weights: bool,
        builder: Any = None,
        nnodes: int = 1,
        dist_init_addr: str | None = None,
        dist_init_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        """`builder` (None: `PipelineStageBuilder`) builds each process's parts; one with a
        `tensor_parallel_size` N > 1 runs N processes per stage, one per rank. `nnodes` > 1
        (checked by `EngineArgs.validate`): node 0's share of the processes here, the
        others' connect from their hosts within `dist_init_timeout_s`."""
        builder = builder if builder is not None else PipelineStageBuilder()
        self.builder = builder
        self.model_config = model_config
        self.layouts: list[StageLayout] = split_layers(model_config.num_layers, num_stages)
        #: processes per stage (tensor-parallel ranks); process p runs stage p // N, rank p % N
        self.tp_size = builder.tensor_parallel_size
        self.num_processes = num_stages * self.tp_size
        local_indices = node_process_range(self.num_processes, nnodes, 0)
        #: this node's processes' devices (another node picks its own)
        self.devices = [stage_device(device, p, len(local_indices)) for p in local_indices]
        self.backend = process_group_backend(self.devices)
        self.device = self.devices[0]
        self.dtype = dtype
        self.dead_reason: str | None = None
        self.connector = None  # stage 0's worker-side connector (set by start_runners)
        self.runner: StageRunner | None = None
        self._step_id = 0
        #: the latest step whose stage replies were read (steps are answered in order)
        self._replied_step_id = 0
        #: steps submitted while an earlier one was not collected yet (tests, stats)
        self.num_overlapped_submits = 0
        self._model_dir = model_dir
        self._dummy = dummy_weights
        context = multiprocessing.get_context("spawn")
        address = parse_dist_init_addr(dist_init_addr) if nnodes > 1 else None
        store_host = address.host if address is not None else STORE_HOST
        self._store = open_store(
            store_host, 0 if address is None else address.port, 0, self.num_processes, TRANSFER_TIMEOUT_S
        )
        #: node 0's own processes after the first (index p - 1)
        self._processes: list[Any] = []
        #: every process after the first (index p - 1): a pipe, or a TCP connection to another node
        self._conns: list[Any] = []
        #: node rank -> the connection to that node's launch (nnodes > 1)
        self._node_conns: dict[int, Any] = {}
        self._first_remote = local_indices.stop
        #: what the other nodes are told when they are stopped (None: a clean shutdown)
        self._stop_reason: list[str | None] = [None]
        self._specs = [
            StageSpec(
                layout=self.layouts[p // self.tp_size],
                model_config=model_config,
                model_dir=None if model_dir is None else str(model_dir),
                dummy_weights=dummy_weights,
                device=str(self.devices[p]) if p < self._first_remote else "",
                dtype=dtype,
                backend=self.backend,
                store_host=store_host,
                store_port=self._store.port,
                timeout_s=TRANSFER_TIMEOUT_S,
                tp_rank=p % self.tp_size,
                tp_size=self.tp_size,
                builder=builder,
            )
            for p in range(self.num_processes)
        ]
        listener = None if address is None else ControlListener(address.host, address.control_port)
        for p, spec in enumerate(self._specs[1 : self._first_remote], start=1):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_stage,
                args=(spec, theirs),
                name=f"kvstash-{self._name(p).replace(' ', '-')}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(ours)
        # stop the stages however the engine ends (also when start-up fails below)
        self._finalizer = weakref.finalize(
            self, _stop_processes, self._processes, self._conns, self._node_conns, self._stop_reason
        )
        if listener is not None:
            try:
                self._connect_nodes(listener, nnodes, dist_init_timeout_s)
            finally:
                listener.close()
        # joining the group blocks without watching the stages: first see each one start
        # (a stage that fails to import, e.g. a main module without the __main__ guard
        # that spawn needs, is reported here at once)
        for p in range(1, self.num_processes):
            try:
                self._expect(p, "started", START_TIMEOUT_S)
            except PipelineDeadError as error:
                raise PipelineDeadError(
                    f"{error} while starting (its traceback is above); a program that starts an "
                    "engine of several stages must run it under `if __name__ == '__main__':`, "
                    "since each stage process re-imports the main module (multiprocessing spawn)"
                ) from None
        self._groups = builder.join(self._specs[0], self._store)
        self.model = builder.load_model(self._specs[0], self._groups)
        for p in range(1, self.num_processes):
            self._expect(p, "loaded", START_TIMEOUT_S)
        logger.info(
            "pipeline of %d stages × %d tensor-parallel ranks (%s): layers %s on %s",
            num_stages,
            self.tp_size,
            self.backend,
            ", ".join(f"[{s.first_layer}, {s.end_layer})" for s in self.layouts),
            ", ".join(str(d) for d in self.devices),
        )

    @property
    def mixed_graphs(self):
        """Stage 0's mixed graphs (None: eager, or before `start_runners`): every stage
        captured the same buckets, so the engine's step-time model reads them here."""
        return getattr(getattr(self, "runner", None), "mixed_graphs", None)

    @property
    def stage_pids(self) -> list[int]:
        """Process ids of this node's processes after the first (tests kill one)."""
        return [process.pid for process in self._processes]

    def _name(self, p: int) -> str:
        """Process p in messages: its stage, and its rank with tensor parallelism."""
        return process_name(p, self.tp_size, len(self.layouts))

    def _connect_nodes(self, listener: ControlListener, nnodes: int, timeout_s: float) -> None:
        """Wait for every other node's launch and processes to connect; send each process
        its spec (its node fills in its model folder, device and address)."""
        remote = range(self._first_remote, self.num_processes)
        deadline = time.monotonic() + timeout_s
        node_conns, process_conns = listener.accept_all(
            self.num_processes, nnodes, self.tp_size, remote, deadline
        )
        self._node_conns.update(node_conns)
        for p in remote:
            process_conns[p].send(self._specs[p])
            self._conns.append(process_conns[p])
        logger.info("%d other node(s) connected: processes %d..%d", nnodes - 1, remote.start, remote.stop - 1)

    def create_connectors(self, kv_offload, model_id: str, block_size: int):
        """Stage 0's connector pair: the scheduler side is the engine's (lookups on stage
        0's tiers; a chunk another stage lacks is a load failure there, see StageRunner)."""
        return self.builder.create_connectors(self._specs[0], kv_offload, block_size, model_id)

    def start_runners(
        self,
        num_blocks: int,
        block_size: int,
        connector,
        kv_offload,
        model_id: str | None,
        graph_sizes: GraphSizes | None = None,
    ) -> PipelineExecutor:
        """Every stage allocates its KV pool of `num_blocks` blocks (its layers only) and
        builds its runner and connector, capturing CUDA graphs for `graph_sizes` (None:
        eager stages). Returns self: the engine's runner."""
        allocation = StageAllocation(num_blocks, block_size, kv_offload, model_id, graph_sizes)
        for conn in self._conns:
            conn.send(allocation)
        self.connector = connector
        self.runner = self.builder.build_runner(
            self._specs[0], self._groups, self.model, num_blocks, block_size, connector, graph_sizes
        )
        for p in range(1, self.num_processes):
            self._expect(p, "ready", START_TIMEOUT_S)
        return self

    # ---- per step ------------------------------------------------------------------
    def execute(
        self, plan: SchedulerOutput, while_device_runs: Callable[[], None] | None = None
    ) -> RunnerOutput:
        """One step over every stage: the same interface as `ModelRunner.execute`
        (`collect(submit(plan))`: one batch in flight; `while_device_runs` is called
        between the two). Raises PipelineStageError when the step failed in some stage
        (every stage ended the step: the engine may retry), PipelineDeadError when a
        stage is gone."""
        in_flight = self.submit(plan)
        if while_device_runs is not None:
            while_device_runs()
        return self.collect(in_flight)

    def submit(self, plan: SchedulerOutput) -> StepInFlight:
        """Hand every later stage the plan and run stage 0's part of it here; returns at
        once after stage 0 sent its hidden states on. Plans go down the pipes and hidden
        states down the links in step order, so a batch queue may submit the next plan
        before collecting this one (up to one in flight per stage)."""
        self._check_alive()
        if self._step_id > self._replied_step_id:
            self.num_overlapped_submits += 1
        self._step_id += 1
        step_id = self._step_id
        stage_plan = to_stage_plan(plan, step_id)
        for p, conn in enumerate(self._conns, start=1):
            try:
                conn.send(stage_plan)
            except (BrokenPipeError, ConnectionResetError, EOFError) as error:
                self._die(f"{self._name(p)} cannot be reached ({type(error).__name__})")
        try:
            return StepInFlight(self, step_id, self.runner.execute_stage(plan, step_id), None)
        except Exception as error:  # noqa: BLE001 - the other stages still answer this step
            return StepInFlight(self, step_id, None, error)

    def collect(self, step: StepInFlight) -> RunnerOutput:
        """Wait for every later stage's answer to `step` (submitted steps are collected in
        order): stage 0's output with the last stage's tokens and every stage's load
        failures merged into one mask. Earlier steps that were never collected (abandoned
        after a failed step) have their replies dropped first. Idempotent."""
        if step.collected:
            if step.error is not None:
                raise step.error
            return step.output
        if step.step_id <= self._replied_step_id:
            raise RuntimeError(f"step {step.step_id} was given up: a later step was collected first")
        if step.error is not None and breaks_group(step.error):
            self._die_with_group(step)
        for dropped_step_id in range(self._replied_step_id + 1, step.step_id):
            for p in range(1, self.num_processes):
                self._reply(p, dropped_step_id)
        replies: list[StageReply] = [self._reply(p, step.step_id) for p in range(1, self.num_processes)]
        self._replied_step_id = step.step_id
        step.collected = True
        failed = next((reply for reply in replies if reply.error is not None), None)
        if failed is not None and first_failure(self._store) is not None:
            self._die("a process failed inside its forward pass")  # (the recorded failure is named)
        # an error that only says another process failed (a tensor-parallel peer) gives way
        # to that process's own
        if step.error is not None and not getattr(step.error, "failed_elsewhere", False):
            raise step.error
        if failed is not None:
            error = PipelineStageError(
                f"{self._name(replies.index(failed) + 1)} failed step {step.step_id}: {failed.error}"
            )
            error.__cause__, step.error = step.error, error
            raise step.error
        if step.error is not None:
            raise step.error
        output = step.output
        sampler = (len(self.layouts) - 1) * self.tp_size  # the last stage's rank 0
        if sampler > 0:  # else this process sampled: its output has the tokens
            last = replies[sampler - 1]
            output.request_id_to_token = last.request_id_to_token
            output.request_id_to_accepted_draft_ids = last.request_id_to_accepted_draft_ids
        output.load_failures = merge_load_failures(output.load_failures, *(r.load_failures for r in replies))
        return output

    def flush_connectors(self) -> None:
        """Wait until every later stage's queued lower-tier writes were attempted."""
        self._check_alive()
        for p, conn in enumerate(self._conns, start=1):
            conn.send(FLUSH)
            self._expect(p, "flushed", None)

    def shutdown(self) -> None:
        """Stop every stage process (each closes its connector first). Idempotent."""
        self._finalizer()

    # ---- waiting on stages ---------------------------------------------------------
    def _reply(self, p: int, step_id: int) -> StageReply:
        reply = self._receive(p, None)
        if not isinstance(reply, StageReply) or reply.step_id != step_id:
            self._die(f"{self._name(p)} answered out of step: {reply!r:.200}")
        return reply

    def _expect(self, p: int, kind: str, timeout_s: float | None) -> Any:
        message = self._receive(p, timeout_s)
        if isinstance(message, tuple) and message[0] == "error":
            self._die(f"{self._name(p)} failed to start:\n{message[1]}")
        if not (isinstance(message, tuple) and message[0] == kind):
            self._die(f"{self._name(p)} sent {message!r:.200} instead of {kind!r}")
        return message[1]

    def _receive(self, p: int, timeout_s: float | None) -> Any:
        """The next message of process `p`, watching every process's liveness meanwhile."""
        conn = self._conns[p - 1]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                if conn.poll(POLL_S):
                    return conn.recv()
            except (EOFError, ConnectionResetError, OSError):
                if p >= self._first_remote:
                    self._check_alive()  # its node's launch may have said why
                    self._die(f"{self._name(p)} on another node closed its connection")
                process = self._processes[p - 1]
                process.join(1.0)  # a dead stage's pipe closes first: say why it died
                if process.exitcode is None:
                    self._die(f"{self._name(p)} closed its connection")
                self._check_alive()
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                self._die(f"{self._name(p)} did not answer within {timeout_s:.0f} s")

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise PipelineDeadError(self.dead_reason)
        for p, process in enumerate(self._processes, start=1):
            if not process.is_alive():
                code = process.exitcode
                how = (
                    f"was killed by signal {-code}"
                    if code is not None and code < 0
                    else f"exited with code {code}"
                )
                self._die(f"{self._name(p)} (pid {process.pid}) {how}")
        for node_rank, conn in self._node_conns.items():
            try:
                if not conn.poll(0):
                    continue
                message = conn.recv()
            except (EOFError, OSError):
                self._die(f"node {node_rank} closed its connection (its launch or host is gone)")
            if isinstance(message, tuple) and message[0] == "dead":
                self._die(f"{message[1]} (node {node_rank})")
            self._die(f"node {node_rank} sent {message!r:.200}")

    def _die_with_group(self, step: StepInFlight) -> None:
        """This process's step raised with the group out of step: the others may wait in a
        collective for it, no replies come. Its own error is the first failure; a broken
        collective is a consequence: the process that failed first recorded its error or
        died (its exit, or its node's word, comes within moments), else this one's is told."""
        error = step.error
        text = f"{self._name(0)} failed step {step.step_id} inside its forward pass: {type(error).__name__}: {error}"
        if not is_collective_failure(error):
            record_failure(self._store, text)
        else:
            deadline = time.monotonic() + CAUSE_GRACE_S
            while time.monotonic() < deadline and first_failure(self._store) is None:
                self._check_alive()  # dies naming a process that is gone
                time.sleep(POLL_S)
        self._die(text)

    def _die(self, reason: str) -> None:
        """Stop every process; this and every later step raise PipelineDeadError with the
        first failure recorded in the store when there is one (the root cause, not the
        broken collectives that followed), else `reason`."""
        if self.dead_reason is None:
            recorded = first_failure(self._store)
            self.dead_reason = recorded if recorded is not None else reason
            logger.error("%s; stopping the other processes", self.dead_reason)
            self._stop_reason[0] = self.dead_reason
            self._finalizer()
        raise PipelineDeadError(self.dead_reason)


def _stop_processes(processes: list, conns: list, node_conns: dict, stop_reason: list) -> None:
    """Ask every stage to stop, then terminate and kill the ones still running; tell the
    other nodes' launches (they stop theirs the same way) why, None for a clean stop."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):  # gone already
            conn.send(STOP)
    for conn in node_conns.values():
        with contextlib.suppress(OSError, ValueError):
            conn.send(("stop", stop_reason[0]))
    end_processes(processes, STOP_GRACE_S)
    for conn in [*conns, *node_conns.values()]:
        conn.close()
