"""Both engines of `kvstash bench`, one after the other: each started fresh, warmed up,
timed over the workload and released before the next starts; then the rounds' bounds."""

from __future__ import annotations

import gc
import os
import platform
import resource
import time
from dataclasses import asdict
from typing import Any, NamedTuple

from bench.bounds import measure_bounds
from bench.model_facts import engine_device_dtype, kv_bytes_per_token
from bench.results import BenchResult, Turn, WarmupTurn, Workload
from bench.workload import conversations_for, run_warmup, run_workload


class EngineRun(NamedTuple):
    """One engine's share of the bench."""

    turns: list[Turn]
    warmup: list[WarmupTurn]
    wall_s: float
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    #: most GPU bytes allocated at once while this engine lived (None on CPU)
    gpu_peak_bytes: int | None


def _run_engine(
    model, engine_args: dict[str, Any], kv_offload, workload: Workload, conversations, label: str
) -> EngineRun:
    """Start one engine, warm it up, run the timed workload, close its tiers (their
    writer thread would keep them alive). The engine is unreachable once this returns:
    the caller collects it before starting the next."""
    import torch

    from engine.llm import LLM

    device, _ = engine_device_dtype(model, engine_args)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    llm = LLM(model, kv_offload=kv_offload, **engine_args)
    warmup = run_warmup(llm, workload, conversations.warmup, label)
    start = time.perf_counter()
    turns = run_workload(llm, workload, conversations, label)
    seconds = time.perf_counter() - start
    if llm.engine.runner.connector is not None:
        llm.engine.runner.connector.close()
    llm.engine.shutdown()  # pipeline stage processes (pipeline_parallel_size > 1)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return EngineRun(turns, warmup, seconds, llm.engine.device, llm.engine.dtype, peak)


def _free_device_memory(device) -> int | None:
    """Collect released engines and return their cached GPU blocks to the driver; -> GPU
    bytes still allocated (None on CPU)."""
    import torch

    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine() or 'cpu'} ({os.cpu_count()} cores)"


def run_bench(
    model, workload: Workload, engine_args: dict[str, Any], offload, *, model_label: str | None = None
) -> BenchResult:
    """Both runs on fresh engines, one after the other (the first is released before the
    second starts), each warmed up the same way; then the bound's copy rates. `model`
    is a model folder or an in-memory transformers config (with load_format "dummy").
    Raises ValueError on bad settings."""
    workload.validate()
    conversations = conversations_for(model, workload, offload.chunk_size)
    runs = {}
    gpu_bytes_between_runs = None
    for label, kv_offload in (("offload off", None), ("offload on", offload)):
        runs[label] = _run_engine(model, engine_args, kv_offload, workload, conversations, label)
        bytes_left = _free_device_memory(runs[label].device)
        if label == "offload off":
            gpu_bytes_between_runs = bytes_left
    off, on = runs["offload off"], runs["offload on"]
    bytes_per_token = kv_bytes_per_token(model, engine_args)
    return BenchResult(
        workload=workload,
        model=model_label or str(model),
        engine_args=engine_args,
        offload=asdict(offload),
        turns_off=off.turns,
        turns_on=on.turns,
        wall_s_off=off.wall_s,
        wall_s_on=on.wall_s,
        warmup_off=off.warmup,
        warmup_on=on.warmup,
        bounds=measure_bounds(workload, off.turns, on.turns, bytes_per_token, on.device),
        device=str(on.device),
        device_name=device_name(on.device),
        dtype=str(on.dtype).removeprefix("torch."),
        kv_bytes_per_token=bytes_per_token,
        copy_kind="pinned host->device copy" if on.device.type == "cuda" else "host memcpy",
        gpu_bytes_between_runs=gpu_bytes_between_runs,
        gpu_peak_bytes={"off": off.gpu_peak_bytes, "on": on.gpu_peak_bytes},
        host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
