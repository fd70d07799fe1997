"""Tensor parallelism: N ranks per pipeline stage, M stages (1 without pipeline
parallelism), N × M processes run by the pipeline executor (`PipelineExecutor(builder=...)`). Process
`stage · N + rank` joins two groups: the pipeline group of its rank number (the same
rank of every stage: hidden states go from a stage's rank r to the next stage's rank r,
each rank holding the whole residual stream after its all-reduces) and its stage's
tensor-parallel group. A stage's ranks agree on its load failures before its forward
pass; the pipeline headers carry them on to the later stages, as without ranks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from engine.pipeline.comm import create_process_group
from engine.pipeline.layer_split import stage_offload_config
from engine.pipeline.stage_builder import StageGroups, stage_link
from engine.tensor_parallel.comm import TensorParallelGroup
from engine.tensor_parallel.layout import rank_layout, rank_model_config, rank_offload_config
from engine.tensor_parallel.rank_runner import TensorParallelStageRunner
from engine.tensor_parallel.stage_model import load_rank_stage_model


class TensorParallelStageBuilder:
    """Builds one rank of one stage (engine.pipeline.stage_builder's interface)."""

    def __init__(self, tensor_parallel_size: int) -> None:
        self.tensor_parallel_size = tensor_parallel_size

    def join(self, spec, store: dist.Store) -> StageGroups:
        """Join this rank's pipeline group, then its stage's group (every process joins in
        that order, so no two wait for each other)."""
        layout, rank, size = spec.layout, spec.tp_rank, spec.tp_size
        pipeline = create_process_group(
            spec.backend,
            dist.PrefixStore(f"pipeline-rank{rank}", store),
            spec.bind_host,
            layout.stage,
            layout.num_stages,
            spec.timeout_s,
        )
        stage_group = create_process_group(
            spec.backend,
            dist.PrefixStore(f"tensor-parallel-stage{layout.stage}", store),
            spec.bind_host,
            rank,
            size,
            spec.timeout_s,
        )
        return StageGroups(pipeline, TensorParallelGroup(stage_group, rank, size, spec.backend))

    def load_model(self, spec, groups: StageGroups) -> torch.nn.Module:
        model_dir = None if spec.model_dir is None else Path(spec.model_dir)
        return load_rank_stage_model(
            spec.model_config,
            model_dir,
            spec.layout,
            rank_layout(spec.model_config, spec.tp_rank, spec.tp_size),
            groups.tensor_parallel,
            torch.device(spec.device),
            spec.dtype,
            dummy=spec.dummy_weights,
        )

    def create_connectors(self, spec, kv_offload, block_size: int, model_id: str):
        """The engine's process's connector pair (stage 0, rank 0): its scheduler side is
        the engine's (`_connector_args`)."""
        from connector import create_kv_connector
        from engine.step_time import StepTimeModel

        config, kwargs = _connector_args(spec, kv_offload)
        return create_kv_connector(
            config, block_size=block_size, step_times=StepTimeModel(), model_id=model_id, **kwargs
        )

    def create_worker_connector(self, spec, kv_offload, model_id: str):
        """Any other rank's worker-side connector: it runs from the metadata alone (its
        scheduler side is rank 0's, in the engine's process)."""
        from connector import create_worker_connector

        config, kwargs = _connector_args(spec, kv_offload)
        return create_worker_connector(config, model_id=model_id, **kwargs)

    def build_runner(
        self, spec, groups: StageGroups, model, num_blocks: int, block_size: int, connector, graph_sizes=None
    ):
        """A rank's runner, eager: `graph_sizes` is not used (an all-reduce inside a graph
        needs NCCL; a gloo collective cannot be captured)."""
        device = torch.device(spec.device)
        link = stage_link(spec, groups, device)
        layout = rank_layout(spec.model_config, spec.tp_rank, spec.tp_size)
        return TensorParallelStageRunner(
            model,
            rank_model_config(spec.model_config, layout),
            spec.layout,
            link,
            num_blocks,
            block_size,
            device,
            spec.dtype,
            connector,
            group=groups.tensor_parallel,
        )


def _connector_args(spec, kv_offload) -> tuple:
    """A rank's offload config and connector arguments: its stage's layers and its KV
    heads, a namespace naming both, 1/(M·N) of the byte caps and the folder
    `ppM-stageK/tpN-rankR` (with one stage: its KV heads, 1/N of the caps, the folder
    `tpN-rankR`)."""
    layout = rank_layout(spec.model_config, spec.tp_rank, spec.tp_size)
    stages = spec.layout.num_stages > 1  # one stage: the folders and keys of ranks alone
    if stages:
        kv_offload = stage_offload_config(kv_offload, spec.layout)
    return rank_offload_config(kv_offload, layout), {
        "dtype": spec.dtype,
        "num_layers": spec.layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": spec.model_config.head_dim,
        "device": torch.device(spec.device),
        "layer_range": spec.layout.layer_range if stages else None,
        "tp_rank": layout.rank,
        "tp_size": layout.size,
    }
