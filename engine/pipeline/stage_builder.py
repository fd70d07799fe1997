"""How one pipeline process builds its parts: it joins its process groups, loads its
weights, builds its connectors and its runner. `PipelineStageBuilder` builds a plain
stage (the whole width of its layers); a tensor-parallel rank of a stage passes another
builder (engine.tensor_parallel.stage_builder) through `StageSpec.builder`, so this
package never imports that one. A builder is a small picklable object: every process
gets it at spawn."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.cuda_graphs import GraphSizes
from engine.pipeline.comm import StageLink, create_process_group
from engine.pipeline.layer_split import StageLayout, stage_offload_config
from engine.pipeline.stage_model import load_stage_model
from engine.pipeline.stage_runner import StageRunner


@dataclass
class StageGroups:
    """A process's groups: `pipeline` links it to the neighbouring stages (its rank
    there is its stage); `tensor_parallel` is its stage's ranks (None without)."""

    pipeline: dist.ProcessGroup
    tensor_parallel: Any = None


class PipelineStageBuilder:
    """A stage without tensor parallelism (one process per stage)."""

    #: processes per stage
    tensor_parallel_size = 1

    def join(self, spec, store: dist.Store) -> StageGroups:
        """Join the engine's group (blocks until every stage joined)."""
        layout: StageLayout = spec.layout
        return StageGroups(
            create_process_group(
                spec.backend, store, spec.bind_host, layout.stage, layout.num_stages, spec.timeout_s
            )
        )

    def load_model(self, spec, groups: StageGroups) -> torch.nn.Module:
        model_dir = None if spec.model_dir is None else Path(spec.model_dir)
        return load_stage_model(
            spec.model_config,
            model_dir,
            spec.layout,
            torch.device(spec.device),
            spec.dtype,
            dummy=spec.dummy_weights,
        )

    def create_connectors(self, spec, kv_offload, block_size: int, model_id: str):
        """The first stage's connector pair over its layers (its namespace names its layer
        range, its tiers are its share: `stage_offload_config`); its scheduler side is the
        engine's."""
        from connector import create_kv_connector
        from engine.step_time import StepTimeModel

        layout: StageLayout = spec.layout
        return create_kv_connector(
            stage_offload_config(kv_offload, layout),
            model_id=model_id,
            dtype=spec.dtype,
            num_layers=layout.num_layers,
            num_kv_heads=spec.model_config.num_kv_heads,
            head_dim=spec.model_config.head_dim,
            block_size=block_size,
            device=torch.device(spec.device),
            step_times=StepTimeModel(),
            layer_range=layout.layer_range,
        )

    def create_worker_connector(self, spec, kv_offload, model_id: str):
        """A later stage's worker-side connector over its layers and its share of the tiers;
        its scheduler side is the first stage's (in another process): it runs from the
        metadata alone, with no lookups, planner or tier prober of its own."""
        from connector import create_worker_connector

        layout: StageLayout = spec.layout
        return create_worker_connector(
            stage_offload_config(kv_offload, layout),
            model_id=model_id,
            dtype=spec.dtype,
            num_layers=layout.num_layers,
            num_kv_heads=spec.model_config.num_kv_heads,
            head_dim=spec.model_config.head_dim,
            device=torch.device(spec.device),
            layer_range=layout.layer_range,
        )

    def build_runner(
        self,
        spec,
        groups: StageGroups,
        model,
        num_blocks: int,
        block_size: int,
        connector,
        graph_sizes: GraphSizes | None = None,
    ) -> StageRunner:
        """The stage's runner; with `graph_sizes` (CUDA) it captures its decode and mixed
        graphs over its own layers."""
        device = torch.device(spec.device)
        link = stage_link(spec, groups, device)
        return StageRunner(
            model,
            spec.model_config,
            spec.layout,
            link,
            num_blocks,
            block_size,
            device,
            spec.dtype,
            connector,
            graph_sizes=graph_sizes,
        )


def stage_link(spec, groups: StageGroups, device: torch.device) -> StageLink:
    """The process's link to the stages before and after it (its rank's pipeline group)."""
    return StageLink(
        groups.pipeline, spec.layout.stage, spec.backend, device, spec.model_config.hidden_size, spec.dtype
    )
