"""Tensor parallelism: every layer's heads, MLP columns and vocabulary split over N
ranks, one process each (docs/architecture.md, "Tensor parallelism"). `EngineCore`
runs them through engine.pipeline's executor with a `TensorParallelStageBuilder` when
`EngineArgs.tensor_parallel_size` > 1 (N processes per pipeline stage)."""

from engine.tensor_parallel.layout import check_tensor_parallel_size, rank_layout
from engine.tensor_parallel.stage_builder import TensorParallelStageBuilder

__all__ = ["TensorParallelStageBuilder", "check_tensor_parallel_size", "rank_layout"]
