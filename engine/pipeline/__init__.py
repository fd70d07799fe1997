"""Pipeline parallelism: the model's layers in N contiguous stages, one process each
(docs/architecture.md, "Pipeline parallelism"). `EngineCore` builds a
`PipelineExecutor` when `EngineArgs.pipeline_parallel_size` > 1."""

from engine.pipeline.executor import PipelineDeadError, PipelineExecutor, PipelineStageError
from engine.pipeline.layer_split import StageLayout, split_layers

__all__ = ["PipelineDeadError", "PipelineExecutor", "PipelineStageError", "StageLayout", "split_layers"]
