"""The process of one tensor-parallel rank after the first (multiprocessing, spawn).

Life, as a pipeline stage's (engine.pipeline.worker): answer "started" (imports done),
join the engine's process group, load the rank's slices of the weights and answer
"loaded"; take the KV pool size and offload settings, build the KV tensor (the rank's
KV heads), the connector (the rank's namespace and disk folder) and the runner and
answer "ready"; then, per step, run the plan the first process sends and answer with a
`StageReply`. It ends when told to stop, when the first process's end of the pipe
closes, or when the first process dies.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.pipeline.comm import create_process_group, open_store
from engine.pipeline.messages import StagePlan, StageReply
from engine.pipeline.worker import FLUSH, STOP, StageAllocation, _exit_with_parent
from engine.tensor_parallel.comm import TensorParallelGroup
from engine.tensor_parallel.layout import (
    TensorParallelLayout,
    rank_layout,
    rank_model_config,
    rank_offload_config,
)
from engine.tensor_parallel.rank_runner import TensorParallelRunner
from engine.tensor_parallel.weights import load_rank_model

logger = logging.getLogger(__name__)


@dataclass
class RankSpec:
    """Everything a rank process needs to start (pickled once, at spawn)."""

    rank: int
    size: int
    model_config: ModelConfig
    model_dir: str | None
    dummy_weights: bool
    device: str
    dtype: torch.dtype
    backend: str
    store_host: str
    store_port: int
    timeout_s: float


def join_and_load(spec: RankSpec, store) -> tuple[TensorParallelGroup, TensorParallelLayout, torch.nn.Module]:
    """Join the engine's process group (blocks until every rank joined) and load this
    rank's weights. Called once per rank, rank 0 included."""
    group = TensorParallelGroup(
        create_process_group(spec.backend, store, spec.store_host, spec.rank, spec.size, spec.timeout_s),
        spec.rank,
        spec.size,
        spec.backend,
    )
    layout = rank_layout(spec.model_config, spec.rank, spec.size)
    model_dir = None if spec.model_dir is None else Path(spec.model_dir)
    model = load_rank_model(
        spec.model_config,
        model_dir,
        layout,
        group,
        torch.device(spec.device),
        spec.dtype,
        dummy=spec.dummy_weights,
    )
    device = torch.device(spec.device)
    if device.type == "cuda" and spec.dtype != torch.float32:
        # the engine's rule for one process (EngineCore): float32 keeps torch's glue
        model.use_glue_kernels()
    return group, layout, model


def create_rank_connectors(
    kv_offload,
    layout: TensorParallelLayout,
    model_config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
    model_id: str,
):
    """A rank's connector pair over its KV heads (its namespace names its rank and the
    group's size, its tiers are its share: `rank_offload_config`). Rank 0's scheduler
    side is the engine's; another rank uses its scheduler side only to flush its tiers."""
    from connector import create_kv_connector
    from engine.step_time import StepTimeModel

    return create_kv_connector(
        rank_offload_config(kv_offload, layout),
        model_id=model_id,
        dtype=dtype,
        num_layers=model_config.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=block_size,
        device=device,
        step_times=StepTimeModel(),
        tp_rank=layout.rank,
        tp_size=layout.size,
    )


def build_runner(
    spec: RankSpec, group, layout, model, allocation: StageAllocation, connector
) -> TensorParallelRunner:
    """The rank's runner over its KV pool of `allocation.num_blocks` blocks (its KV heads)."""
    return TensorParallelRunner(
        model,
        rank_model_config(spec.model_config, layout),
        group,
        allocation.num_blocks,
        allocation.block_size,
        torch.device(spec.device),
        spec.dtype,
        connector,
    )


def run_rank(spec: RankSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a rank process."""
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(message)s")
    try:
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("started", None))  # imports done: the first process may join the group now
        store = open_store(spec.store_host, spec.store_port, spec.rank, spec.size, spec.timeout_s)
        group, layout, model = join_and_load(spec, store)
        conn.send(("loaded", None))
        allocation: StageAllocation = conn.recv()
        connector = connector_scheduler_side = None
        if allocation.kv_offload is not None:
            connector_scheduler_side, connector = create_rank_connectors(
                allocation.kv_offload,
                layout,
                spec.model_config,
                spec.dtype,
                allocation.block_size,
                device,
                allocation.model_id,
            )
        runner = build_runner(spec, group, layout, model, allocation, connector)
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - the first process reports it
        conn.send(("error", traceback.format_exc()))
        return
    try:
        _serve_steps(runner, connector_scheduler_side, conn)
    finally:
        if runner.connector is not None:
            runner.connector.close()


def _serve_steps(
    runner: TensorParallelRunner, connector_scheduler_side, conn: multiprocessing.connection.Connection
) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the first process went away
        if message == STOP:
            return
        if message == FLUSH:
            if connector_scheduler_side is not None:
                connector_scheduler_side.flush()
            conn.send(("flushed", None))
            continue
        plan: StagePlan = message
        connector = runner.connector
        try:
            output = runner.execute(plan.to_scheduler_output())
            if connector is not None:
                # rank 0's scheduler frees blocks when rank 0's own saves are done: this
                # rank's saves must have read them by the end of the step
                connector.finish_saves()
            reply = StageReply(plan.step_id, load_failures=output.load_failures)
        except Exception as error:  # noqa: BLE001 - the step fails, the rank lives on
            if connector is not None:
                connector.abort_step()
            logger.warning(
                "tensor-parallel rank %d: step %d failed: %s", runner.group.rank, plan.step_id, error
            )
            reply = StageReply(plan.step_id, error=f"{type(error).__name__}: {error}")
        conn.send(reply)
