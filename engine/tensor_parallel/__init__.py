"""Tensor parallelism: every layer's heads, MLP columns and vocabulary split over N
ranks, one process each (docs/architecture.md, "Tensor parallelism"). `EngineCore`
builds a `TensorParallelExecutor` when `EngineArgs.tensor_parallel_size` > 1."""

from engine.tensor_parallel.executor import (
    TensorParallelDeadError,
    TensorParallelExecutor,
    TensorParallelRankError,
)
from engine.tensor_parallel.layout import check_tensor_parallel_size, rank_layout
from engine.tensor_parallel.stage_builder import TensorParallelStageBuilder

__all__ = [
    "TensorParallelDeadError",
    "TensorParallelExecutor",
    "TensorParallelRankError",
    "TensorParallelStageBuilder",
    "check_tensor_parallel_size",
    "rank_layout",
]
