"""One rank's share of one pipeline stage (tensor parallelism combined with pipeline
parallelism): the stage's layers (engine.pipeline.stage_model) built with the rank's
config and sharded as the whole model is (`shard_modules`); the last stage's logits are
gathered to its rank 0, which samples."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.pipeline.layer_split import StageLayout
from engine.pipeline.stage_model import PipelineStageModel
from engine.tensor_parallel.comm import TensorParallelGroup
from engine.tensor_parallel.layout import TensorParallelLayout, rank_model_config
from engine.tensor_parallel.model import gather_logits, shard_modules
from engine.tensor_parallel.weights import fill_rank_weights


class TensorParallelStageModel(PipelineStageModel):
    """`PipelineStageModel`'s interface; `compute_logits` (last stage) returns the logits
    on the stage's rank 0 and None on its other ranks (every rank calls it: a collective)."""

    def __init__(
        self,
        config: ModelConfig,
        stage: StageLayout,
        layout: TensorParallelLayout,
        group: TensorParallelGroup,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(rank_model_config(config, layout), stage, device, dtype)
        self.full_config = config
        self.group = group
        shard_modules(self, list(self.model.layers.values()), config, layout, group, device, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_logits(self.group, super().compute_logits(hidden), self.full_config.vocab_size)


def load_rank_stage_model(
    config: ModelConfig,
    model_dir: Path | None,
    stage: StageLayout,
    layout: TensorParallelLayout,
    group: TensorParallelGroup,
    device: torch.device,
    dtype: torch.dtype,
    *,
    dummy: bool = False,
) -> TensorParallelStageModel:
    """Called once per process at engine start: only the rank's slices of the stage's
    weights are allocated and read."""
    with torch.device("meta"):
        model = TensorParallelStageModel(config, stage, layout, group, torch.device("meta"), dtype)
    return fill_rank_weights(model, config, model_dir, layout, device, dtype, dummy=dummy)
