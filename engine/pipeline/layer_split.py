"""Where each pipeline stage runs and what it holds: its contiguous layer range, its
device, the process-group backend, and its share of the offload tiers. Pure
functions, called once per stage at engine start."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch

from connector.config import OffloadConfig


class StageLayout(NamedTuple):
    """Stage ``stage`` of ``num_stages`` computes layers ``[first_layer, end_layer)``."""

    stage: int
    num_stages: int
    first_layer: int
    end_layer: int
    num_model_layers: int

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def layer_range(self) -> tuple[int, int, int]:
        """``(first_layer, end_layer, num_model_layers)``: part of the offload namespace."""
        return (self.first_layer, self.end_layer, self.num_model_layers)


def split_layers(num_layers: int, num_stages: int) -> list[StageLayout]:
    """Contiguous ranges as equal as can be, the earlier stages taking one more layer
    when the count does not divide. ValueError when a stage would get no layer."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers "
            "(every stage needs at least one layer)"
        )
    base, extra = divmod(num_layers, num_stages)
    layouts, first = [], 0
    for stage in range(num_stages):
        end = first + base + (1 if stage < extra else 0)
        layouts.append(StageLayout(stage, num_stages, first, end, num_layers))
        first = end
    return layouts


def stage_device(engine_device: torch.device, stage: int, num_stages: int) -> torch.device:
    """CPU stays CPU. On CUDA, stage k takes the k-th GPU after the engine's when the
    host has one per stage; otherwise every stage shares the engine's GPU."""
    if engine_device.type != "cuda":
        return engine_device
    first = engine_device.index if engine_device.index is not None else torch.cuda.current_device()
    if first + num_stages <= torch.cuda.device_count():
        return torch.device("cuda", first + stage)
    return torch.device("cuda", first)


def process_group_backend(devices: list[torch.device]) -> str:
    """NCCL when every stage has a GPU of its own; gloo otherwise (CPU, or stages that
    share one GPU, which NCCL refuses: hidden states then travel through host memory)."""
    if all(d.type == "cuda" for d in devices) and len({d.index for d in devices}) == len(devices):
        return "nccl"
    return "gloo"


def stage_offload_config(config: OffloadConfig, layout: StageLayout) -> OffloadConfig:
    """A stage's offload settings: its share of the CPU byte cap by its layers (a stage's
    chunks hold its layers only, so every stage has as many CPU-tier slots as one
    whole-model engine would: the same number in every stage, whose layer counts may
    differ by one) and 1/N of the disk's, its own disk folder (a disk tier locks its folder), and
    loads read synchronously: background fetches are planned by the first stage's
    scheduler side with its own keys, which the other stages cannot use."""
    disk_path = config.disk_path
    if disk_path is not None:
        disk_path = str(Path(disk_path) / f"pp{layout.num_stages}-stage{layout.stage}")
    return dataclasses.replace(
        config,
        cpu_bytes=max(1, config.cpu_bytes // layout.num_model_layers * layout.num_layers)
        if config.cpu_bytes
        else 0,
        disk_bytes=max(1, config.disk_bytes // layout.num_stages),
        disk_path=disk_path,
        async_loads=False,
    )
