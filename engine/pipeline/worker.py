"""The process of one pipeline stage after the first (`torch.multiprocessing`, spawn).

Life: answer "started" (imports done), join the engine's process group, load the stage's weights and answer
"loaded"; take the KV pool size and offload settings, build the KV tensor, the
connector and the runner and answer "ready"; then, per step, run the plan the first
process sends and answer with a `StageReply`. It ends when told to stop, when the
first process's end of the pipe closes, or when the first process dies (a
watchdog thread exits the process at once: a stage never outlives its engine).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.pipeline.comm import StageLink, create_process_group, open_store
from engine.pipeline.layer_split import StageLayout, stage_offload_config
from engine.pipeline.messages import StagePlan, StageReply
from engine.pipeline.stage_model import load_stage_model
from engine.pipeline.stage_runner import StageRunner

logger = logging.getLogger(__name__)

#: messages from the first process besides plans
STOP = "stop"
#: wait until every queued lower-tier write of this stage's connector was attempted
FLUSH = "flush"


@dataclass
class StageSpec:
    """Everything a stage process needs to start (pickled once, at spawn)."""

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


@dataclass
class StageAllocation:
    """The second start-up message: sizes known once every stage loaded its weights."""

    num_blocks: int
    block_size: int
    kv_offload: Any  # OffloadConfig | None (the engine's; each stage takes its share)
    model_id: str | None


def run_stage(spec: StageSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a stage process."""
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s pp-stage{spec.layout.stage} %(message)s")
    runner = None
    try:
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("started", None))  # imports done: the first process may join the group now
        store = open_store(
            spec.store_host, spec.store_port, spec.layout.stage, spec.layout.num_stages, spec.timeout_s
        )
        group = create_process_group(
            spec.backend, store, spec.store_host, spec.layout.stage, spec.layout.num_stages, spec.timeout_s
        )
        model_dir = None if spec.model_dir is None else Path(spec.model_dir)
        model = load_stage_model(
            spec.model_config, model_dir, spec.layout, device, spec.dtype, dummy=spec.dummy_weights
        )
        conn.send(("loaded", None))
        allocation: StageAllocation = conn.recv()
        connector = None
        if allocation.kv_offload is not None:
            connector = create_stage_connector(
                allocation.kv_offload, spec.layout, spec.model_config, spec.dtype, device, allocation.model_id
            )
        link = StageLink(
            group, spec.layout.stage, spec.backend, device, spec.model_config.hidden_size, spec.dtype
        )
        runner = StageRunner(
            model,
            spec.model_config,
            spec.layout,
            link,
            allocation.num_blocks,
            allocation.block_size,
            device,
            spec.dtype,
            connector,
        )
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - the first process reports it
        conn.send(("error", traceback.format_exc()))
        return
    try:
        _serve_steps(runner, conn)
    finally:
        if runner.connector is not None:
            runner.connector.close()
        runner.link.drain()


def _serve_steps(runner: StageRunner, conn: multiprocessing.connection.Connection) -> None:
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
            if connector is not None:
                connector.abort_step()
            logger.warning("pipeline stage %d: step %d failed: %s", runner.layout.stage, plan.step_id, error)
            reply = StageReply(plan.step_id, error=f"{type(error).__name__}: {error}")
        conn.send(reply)


def create_stage_connectors(
    kv_offload,
    layout: StageLayout,
    model_config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
    model_id: str,
):
    """The first stage's connector pair over its layers (its namespace names its layer
    range, its tiers are its share: `stage_offload_config`); its scheduler side is the
    engine's."""
    from connector import create_kv_connector
    from engine.step_time import StepTimeModel

    return create_kv_connector(
        stage_offload_config(kv_offload, layout),
        model_id=model_id,
        dtype=dtype,
        num_layers=layout.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=block_size,
        device=device,
        step_times=StepTimeModel(),
        layer_range=layout.layer_range,
    )


def create_stage_connector(
    kv_offload,
    layout: StageLayout,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    model_id: str,
):
    """A later stage's worker-side connector over its layers and its share of the tiers;
    its scheduler side is the first stage's (in another process): it runs from the
    metadata alone, with no lookups, planner or tier prober of its own."""
    from connector import create_worker_connector

    return create_worker_connector(
        stage_offload_config(kv_offload, layout),
        model_id=model_id,
        dtype=dtype,
        num_layers=layout.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        device=device,
        layer_range=layout.layer_range,
    )


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
