"""Where a batch-1 decode step's time goes, against the memory bound (issue 34 item 4).

One engine with the default settings (CUDA graphs), prefix caching off, greedy, EOS
ignored. For each batch size it decodes ``--new-tokens`` tokens after a ``--prompt-len``
prompt and reports:

- the step's wall time (median over the decode steps, ``LLM.engine.step``) and tokens/s;
- the bound: the bytes a step must read (every weight once, plus the KV of the context)
  at the HBM rate measured in the same run (a device-to-device copy, bytes read + written),
  and the step's fraction of it;
- a ``torch.profiler`` trace of ``--profile-steps`` decode steps: GPU kernel time per step
  (summed, and the union of busy intervals), the gap between the step's wall time and the
  GPU's busy time (host work the device waits for), and the largest kernels by time.

    python3 benchmarks/decode_profile.py --out decode_profile.json
    python3 benchmarks/decode_profile.py --tiny --out /tmp/decode_tiny.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import kv_bytes_per_token, llama_config, make_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def hbm_bytes_per_s(device: torch.device, num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy (0 on CPU: no bound)."""
    if device.type != "cuda":
        return 0.0
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del source, target
    return 2 * num_bytes / statistics.median(times)


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_steps(llm: LLM, prompts: list[list[int]], new_tokens: int, counter: list[int]) -> list[float]:
    """Run the prompts; the wall seconds of each step after every request has its first token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = []
    for prompt in prompts:
        counter[0] += 1
        requests.append(engine.add_request(f"prof-{counter[0]}", prompt, params))
    while any(not r.output_token_ids for r in requests):
        engine.step()
    step_seconds = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - start)
    return step_seconds


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    end_so_far = float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def profile_steps(llm: LLM, prompts: list[list[int]], num_steps: int, counter: list[int]) -> dict:
    """``torch.profiler`` over ``num_steps`` decode steps: kernel time per step, busy union,
    the largest kernels."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    requests = []
    for prompt in prompts:
        counter[0] += 1
        requests.append(engine.add_request(f"prof-{counter[0]}", prompt, params))
    while any(len(r.output_token_ids) < 4 for r in requests):
        engine.step()
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = 0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests() and steps < num_steps:
            engine.step()
            steps += 1
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    name_to_us: dict[str, float] = defaultdict(float)
    name_to_count: dict[str, int] = defaultdict(int)
    intervals = []
    for event in prof.events():
        if getattr(event, "device_type", None) is None or str(event.device_type) != "DeviceType.CUDA":
            continue
        duration_us = event.time_range.end - event.time_range.start
        name_to_us[event.name] += duration_us
        name_to_count[event.name] += 1
        intervals.append((event.time_range.start, event.time_range.end))
    kernel_us = sum(name_to_us.values())
    busy_us = _union_seconds(intervals)
    top = sorted(name_to_us.items(), key=lambda item: -item[1])[:20]
    host = sorted(prof.key_averages(), key=lambda avg: -avg.self_cpu_time_total)[:15]
    return {
        "top_host_ops": [
            {
                "name": avg.key[:120],
                "ms_per_step": avg.self_cpu_time_total / 1e3 / max(steps, 1),
                "calls_per_step": avg.count / max(steps, 1),
            }
            for avg in host
        ],
        "num_steps": steps,
        "wall_ms_per_step": 1e3 * wall / max(steps, 1),
        "kernel_ms_per_step": kernel_us / 1e3 / max(steps, 1),
        "gpu_busy_ms_per_step": busy_us / 1e3 / max(steps, 1),
        "top_kernels": [
            {
                "name": name[:120],
                "ms_per_step": us / 1e3 / max(steps, 1),
                "calls_per_step": name_to_count[name] / max(steps, 1),
            }
            for name, us in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU in float32 (seconds)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--engine-arg", action="append", default=[], help="KEY=VALUE passed to LLM (ints parsed)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    prompt_len = args.prompt_len or (16 if args.tiny else 512)
    new_tokens = args.new_tokens or (8 if args.tiny else 128)
    config = llama_config(args.tiny)
    extra = {}
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        extra[key] = (
            int(value) if value.lstrip("-").isdigit() else {"true": True, "false": False}.get(value, value)
        )
    llm = LLM(
        config,
        load_format="dummy",
        device=str(device),
        dtype=dtype,
        enable_prefix_caching=False,
        max_model_len=prompt_len + new_tokens + 64,
        max_num_seqs=max(args.batch_sizes),
        **extra,
    )
    torch_dtype = getattr(torch, dtype)
    rate = hbm_bytes_per_s(device)
    num_weight_bytes = weight_bytes(llm)
    counter = [0]
    rows = []
    for batch_size in args.batch_sizes:
        prompts = make_prompts(batch_size, prompt_len, config.vocab_size, seed=batch_size)
        decode_steps(llm, prompts, 8, counter)  # warm this batch size's graphs
        step_seconds = decode_steps(llm, prompts, new_tokens, counter)
        median_s = statistics.median(step_seconds)
        context = prompt_len + new_tokens // 2
        kv_bytes = batch_size * context * kv_bytes_per_token(config, torch_dtype)
        bound_s = (num_weight_bytes + kv_bytes) / rate if rate else 0.0
        profiled = profile_steps(llm, prompts, args.profile_steps, counter)
        rows.append(
            {
                "batch_size": batch_size,
                "step_ms_median": 1e3 * median_s,
                "step_ms_p90": 1e3 * sorted(step_seconds)[int(0.9 * (len(step_seconds) - 1))],
                "tokens_per_s": batch_size / median_s,
                "bound_ms": 1e3 * bound_s,
                "fraction_of_bound": bound_s / median_s if bound_s else None,
                **{f"profile_{k}": v for k, v in profiled.items()},
            }
        )
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor()}")
    print(f"weights {num_weight_bytes / 1e9:.2f} GB, HBM copy rate {rate / 1e12:.2f} TB/s (read+write)")
    print(
        "| batch | step ms (median) | tok/s | bound ms | of bound | profiled wall ms | kernels ms | GPU busy ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        frac = f"{row['fraction_of_bound']:.2f}" if row["fraction_of_bound"] else "-"
        print(
            f"| {row['batch_size']} | {row['step_ms_median']:.2f} | {row['tokens_per_s']:.0f} | {row['bound_ms']:.2f} | {frac} "
            f"| {row['profile_wall_ms_per_step']:.2f} | {row['profile_kernel_ms_per_step']:.2f} | {row['profile_gpu_busy_ms_per_step']:.2f} |"
        )
    for row in rows:
        print(f"\nbatch {row['batch_size']}: largest kernels per step")
        for kernel in row["profile_top_kernels"][:12]:
            print(f"  {kernel['ms_per_step']:7.3f} ms  x{kernel['calls_per_step']:5.1f}  {kernel['name']}")
        print(f"batch {row['batch_size']}: host ops by self time per step")
        for op in row["profile_top_host_ops"][:10]:
            print(f"  {op['ms_per_step']:7.3f} ms  x{op['calls_per_step']:5.1f}  {op['name']}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "device": str(device),
                    "dtype": dtype,
                    "prompt_len": prompt_len,
                    "new_tokens": new_tokens,
                    "weight_bytes": num_weight_bytes,
                    "hbm_bytes_per_s": rate,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
