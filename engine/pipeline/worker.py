"""The process of one pipeline stage after the first (`torch.multiprocessing`, spawn).

Life: answer "started" (imports done), join the engine's process groups, load the stage's
weights and answer "loaded" (what a process builds, `StageSpec.builder` says:
engine.pipeline.stage_builder); take the KV pool size and offload settings, build the KV tensor, the
connector and the runner and answer "ready"; then, per step, run the plan the first
process sends and answer with a `StageReply`. It ends when told to stop, when the
first process's end of the pipe closes, or when the first process dies (a
watchdog thread exits the process at once: a stage never outlives its engine). A step
that raised with its process group out of step (engine.pipeline.failure) is recorded
in the store and answered, then the process exits: its peers' collectives break.

The connection is a pipe for the processes the engine's process starts, a TCP
connection (engine.pipeline.control) for those another node starts
(engine.pipeline.node): the messages are the same.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ModelConfig
from engine.pipeline.comm import open_store
from engine.pipeline.failure import breaks_group, is_collective_failure, process_name, record_failure
from engine.pipeline.layer_split import StageLayout
from engine.pipeline.messages import StagePlan, StageReply
from engine.pipeline.stage_builder import PipelineStageBuilder
from engine.pipeline.stage_runner import StageRunner

logger = logging.getLogger(__name__)

#: messages from the first process besides plans
STOP = "stop"
#: wait until every queued lower-tier write of this stage's connector was attempted
FLUSH = "flush"


@dataclass
class StageSpec:
    """Everything a stage process needs to start (pickled once, at spawn). With tensor
    parallelism a stage has `tp_size` processes, this one its rank `tp_rank`."""

    layout: StageLayout
    model_config: ModelConfig
    model_dir: str | None
    dummy_weights: bool
    device: str
    dtype: torch.dtype
    backend: str
    store_host: str
    store_port: int
    timeout_s: float
    #: the address of this process's host that its peers reach (gloo binds it); node 0's
    #: processes share the store's host, another node's use the address that routes there
    local_host: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    #: builds the process's groups, model, connectors and runner (PipelineStageBuilder
    #: when None)
    builder: Any = None

    @property
    def process_index(self) -> int:
        """0 for the engine's process; stage-major, then rank."""
        return self.layout.stage * self.tp_size + self.tp_rank

    @property
    def bind_host(self) -> str:
        """The address gloo binds in this process."""
        return self.local_host or self.store_host

    @property
    def num_processes(self) -> int:
        return self.layout.num_stages * self.tp_size

    def stage_builder(self):
        return self.builder if self.builder is not None else PipelineStageBuilder()


@dataclass
class StageAllocation:
    """The second start-up message: sizes known once every stage loaded its weights."""

    num_blocks: int
    block_size: int
    kv_offload: Any  # OffloadConfig | None (the engine's; each stage takes its share)
    model_id: str | None
    #: what each stage captures CUDA graphs for (engine.cuda_graphs.GraphSizes; None: eager)
    graph_sizes: Any = None


def run_stage(spec: StageSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a stage process."""
    _exit_with_parent()
    name = f"pp-stage{spec.layout.stage}" + (f"-tp{spec.tp_rank}" if spec.tp_size > 1 else "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(message)s")
    runner = None
    builder = spec.stage_builder()
    try:
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("started", None))  # imports done: the first process may join the group now
        store = open_store(
            spec.store_host, spec.store_port, spec.process_index, spec.num_processes, spec.timeout_s
        )
        groups = builder.join(spec, store)
        model = builder.load_model(spec, groups)
        conn.send(("loaded", None))
        allocation: StageAllocation = conn.recv()
        connector = None
        if allocation.kv_offload is not None:
            connector = builder.create_worker_connector(spec, allocation.kv_offload, allocation.model_id)
        runner = builder.build_runner(
            spec,
            groups,
            model,
            allocation.num_blocks,
            allocation.block_size,
            connector,
            allocation.graph_sizes,
        )
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - the first process reports it
        conn.send(("error", traceback.format_exc()))
        return
    try:
        _serve_steps(
            runner, conn, store, process_name(spec.process_index, spec.tp_size, spec.layout.num_stages)
        )
    finally:
        if runner.connector is not None:
            runner.connector.close()
        runner.link.drain()


def _serve_steps(runner: StageRunner, conn: multiprocessing.connection.Connection, store, name: str) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the first process went away
        if message == STOP:
            return
        if message == FLUSH:
            if runner.connector is not None:
                runner.connector.flush()
            conn.send(("flushed", None))
            continue
        plan: StagePlan = message
        scheduler_output = plan.to_scheduler_output()
        connector = runner.connector
        try:
            # The stage's connector needs nothing but the metadata; its report (the output's
            # connector_report) has no reader here: the first stage's scheduler side plans
            # from the first stage's report, and load failures travel with the hidden states.
            output = runner.execute_stage(scheduler_output, plan.step_id)
            if connector is not None:
                # the first stage's scheduler frees blocks when its own saves are done:
                # this stage's saves must have read them by the end of the step
                connector.finish_saves()
            reply = StageReply(
                plan.step_id,
                request_id_to_token=output.request_id_to_token,
                request_id_to_accepted_draft_ids=output.request_id_to_accepted_draft_ids,
                load_failures=output.load_failures,
            )
        except Exception as error:  # noqa: BLE001 - the step fails, the stage lives on
            if breaks_group(error):
                _exit_breaking_group(conn, store, name, plan.step_id, error)
            if connector is not None:
                connector.abort_step()
            logger.warning(
                "pipeline stage %d: step %d failed: %s",
                runner.layout.stage,
                plan.step_id,
                error,
                exc_info=True,
            )
            reply = StageReply(plan.step_id, error=f"{type(error).__name__}: {error}")
        conn.send(reply)


def _exit_breaking_group(conn, store, name: str, step_id: int, error: BaseException) -> None:
    """The step raised while the peers wait in a collective for this process: record the
    error (unless an earlier one was, or it is a broken collective), answer the step with
    it and exit at once (no
    connector close, no drain: they would wait on the peers). The exit breaks the peers'
    collectives (gloo sees the connection close)."""
    text = f"{name} failed step {step_id} inside its forward pass: {type(error).__name__}: {error}"
    logger.error("%s; exiting, which ends the process group", text, exc_info=error)
    if not is_collective_failure(error):  # else a peer failed first: it recorded or died
        record_failure(store, text)
    with contextlib.suppress(OSError, ValueError):
        conn.send(StageReply(step_id, error=text))
    logging.shutdown()
    os._exit(1)


def _exit_with_parent() -> None:
    """A daemon thread that ends this process as soon as the first process is gone
    (killed by a signal included: no atexit of its runs then)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="kvstash-pp-parent-watch", daemon=True).start()
