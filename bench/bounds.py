"""The physical bound of a round's hit: its KV bytes at the host->device copy rate
measured on this machine, plus one decode step (the least compute a hit leaves)."""

from __future__ import annotations

import statistics
import time

from bench.results import RoundBound, Turn, Workload

#: timed copies per size for the host->device rate (after one untimed copy that faults pages in);
#: the fastest counts: a bound is what the hardware can do, not what a busy machine did once
NUM_COPY_REPEATS = 10


def copy_seconds(num_bytes: int, device) -> float:
    """Fewest seconds to copy `num_bytes` from pinned host memory to `device` (CUDA), or
    between two host buffers (CPU), over `NUM_COPY_REPEATS` tries: the floor under
    loading that much KV."""
    import torch

    if num_bytes <= 0:
        return 0.0
    on_cuda = device.type == "cuda"
    source = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=on_cuda)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(NUM_COPY_REPEATS + 1):
        if on_cuda:
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        target.copy_(source, non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    del source, target
    return min(times[1:])


def measure_bounds(
    workload: Workload, turns_off: list[Turn], turns_on: list[Turn], bytes_per_token: int, device
):
    """One `RoundBound` per round: the on-run's mean hit bytes, their copy time measured
    now, and the off-run's median decode step of the round."""
    bounds = []
    for round_index in range(workload.num_rounds):
        on = [t for t in turns_on if t.round == round_index]
        hit_bytes = statistics.mean(t.num_external_hit_tokens for t in on) * bytes_per_token
        steps = [s for t in turns_off if t.round == round_index if (s := t.decode_step_s) is not None]
        bounds.append(
            RoundBound(
                round=round_index + 1,
                hit_bytes=hit_bytes,
                copy_s=copy_seconds(int(hit_bytes), device),
                decode_step_s=statistics.median(steps) if steps else None,
            )
        )
    return bounds
