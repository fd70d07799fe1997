"""Where the time of a CPU-tier hit goes: load versus the prefill of the new tokens.

`kvstash bench` on the H100 measured CPU-tier hits of 8k-token histories at 62-75 ms
against a 27 ms bound (KV bytes at the pinned host->device rate plus one decode step).
This benchmark separates the parts for one prefix length and several suffix lengths
(the new tokens after the cached history):

- ``gpu_hit``: the prompt again with its prefix in the GPU prefix cache: only the
  suffix is prefilled (its cost over a long prefix, no load);
- ``cpu_hit``: the prompt after the GPU prefix cache was reset: the prefix is loaded
  from the CPU tier, the suffix prefilled;
- ``load`` = cpu_hit - gpu_hit: what the load adds; ``bound`` = prefix KV bytes at the
  pinned copy rate measured in the same run.

With ``--profile`` one CPU-tier hit per suffix runs under torch.profiler and the top
operations by device time and by host time are printed (and written to the JSON).

    python benchmarks/hit_profile.py --out hit.json                 # GPU, Llama-3.1-8B shape
    python benchmarks/hit_profile.py --max-graph-tokens 0 --out hit_eager.json  # suffixes eager
    python benchmarks/hit_profile.py --tiny --out /tmp/hit.json     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engine_throughput import llama_config  # noqa: E402
from benchmarks.ttft import kv_bytes_per_token, pinned_h2d_gbps, random_prompt, ttft  # noqa: E402
from connector import OffloadConfig  # noqa: E402
from engine import LLM  # noqa: E402


def cpu_hit(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    llm.flush_kv_offload()
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine refused to drop its prefix cache")
    return ttft(llm, prompt)


def top_ops(profile, key: str, limit: int) -> list[dict]:
    rows = sorted(profile.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:limit]
    return [
        {
            "name": e.key[:90],
            "count": e.count,
            "device_ms": getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3,
            "host_ms": e.self_cpu_time_total / 1e3,
        }
        for e in rows
    ]


def profiled_hit(llm: LLM, prompt: list[int], limit: int, trace_path: Path | None = None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    llm.flush_kv_offload()
    llm.reset_prefix_cache()
    # with a trace, Python calls too (slower, but the timeline shows where the host waits)
    with profile(activities=activities, with_stack=trace_path is not None) as prof:
        seconds, _ = ttft(llm, prompt)
    if trace_path is not None:  # a timeline (chrome://tracing, Perfetto) of the whole hit
        prof.export_chrome_trace(str(trace_path))
    device_key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return {
        "ttft_ms_under_profiler": seconds * 1e3,
        "top_device": top_ops(prof, device_key, limit),
        "top_host": top_ops(prof, "self_cpu_time_total", limit),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke run)")
    parser.add_argument(
        "--prefix", type=int, default=None, help="cached prefix tokens (default 8192; tiny 512)"
    )
    parser.add_argument("--suffixes", default="1,16,80,128,512", help="new tokens after the prefix")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="torch.profiler on one hit per suffix")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="with --profile: write each hit's Chrome trace into this folder",
    )
    parser.add_argument("--top", type=int, default=12, help="operations listed per profile")
    parser.add_argument(
        "--max-graph-tokens",
        type=int,
        default=None,
        help="the engine's max_graph_tokens (default: the engine's; 0: suffixes run eagerly, as before mixed graphs)",
    )
    parser.add_argument(
        "--direct-loads",
        action="store_true",
        help="unpack straight from the pinned slots (OffloadConfig.direct_host_loads=True) instead of staging",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = "float32" if args.tiny else "bfloat16"
    config = llama_config(args.tiny)
    prefix_len = args.prefix or (512 if args.tiny else 8192)
    suffixes = [int(n) for n in args.suffixes.split(",") if n]
    if not suffixes or min(suffixes) < 1:
        parser.error("--suffixes needs positive token counts")
    max_len = prefix_len + max(suffixes)
    bytes_per_token = kv_bytes_per_token(config, dtype)
    llm = LLM(
        config,
        load_format="dummy",
        device=str(device),
        dtype=dtype,
        max_num_batched_tokens=max(8192, max_len),
        num_gpu_blocks=(max_len + 1024) // 16 * 2,
        max_num_seqs=4,
        kv_offload=OffloadConfig(
            cpu_bytes=4 * max_len * bytes_per_token, direct_host_loads=args.direct_loads
        ),
        **({} if args.max_graph_tokens is None else {"max_graph_tokens": args.max_graph_tokens}),
    )
    h2d = pinned_h2d_gbps(device)
    rows, profiles = [], {}
    for suffix in suffixes:
        gpu_hits, cpu_hits, loaded = [], [], []
        for repeat in range(args.repeats + 1):  # the first pass warms this shape
            prefix = random_prompt(prefix_len, config.vocab_size, seed=1000 * suffix + repeat)
            # Two prompts that share the prefix only: the first one's suffix, computed
            # over the GPU-cached prefix, is stored too, so the CPU hit takes the second.
            prompt, other = (
                prefix + random_prompt(suffix, config.vocab_size, seed=7 + 31 * suffix + 2 * repeat + k)
                for k in range(2)
            )
            ttft(llm, prefix)  # stores the prefix in the CPU tier
            gpu, _ = ttft(llm, prompt)
            hit, num_loaded = cpu_hit(llm, other)
            if repeat:
                gpu_hits.append(gpu)
                cpu_hits.append(hit)
                loaded.append(num_loaded)
        gpu_ms, cpu_ms = statistics.median(gpu_hits) * 1e3, statistics.median(cpu_hits) * 1e3
        bound_ms = min(loaded) * bytes_per_token / h2d / 1e6 if h2d else None
        rows.append(
            {
                "suffix_tokens": suffix,
                "loaded_tokens": min(loaded),
                "gpu_hit_ms": gpu_ms,
                "cpu_hit_ms": cpu_ms,
                "load_ms": cpu_ms - gpu_ms,
                "copy_bound_ms": bound_ms,
            }
        )
        if args.profile:
            prefix = random_prompt(prefix_len, config.vocab_size, seed=99_991 + suffix)
            ttft(llm, prefix)
            tail = random_prompt(suffix, config.vocab_size, seed=99_989 + suffix)
            trace_path = None
            if args.trace is not None:
                args.trace.mkdir(parents=True, exist_ok=True)
                trace_path = args.trace / f"hit_suffix{suffix}.json"
            profiles[suffix] = profiled_hit(llm, prefix + tail, args.top, trace_path)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"hit profile: {prefix_len}-token prefix, {dtype} on {name}; pinned H2D {h2d or 0:.1f} GB/s")
    print(f"{'suffix':>7} {'loaded':>7} {'GPU hit ms':>11} {'CPU hit ms':>11} {'load ms':>8} {'bound ms':>9}")
    for row in rows:
        bound = "-" if row["copy_bound_ms"] is None else f"{row['copy_bound_ms']:.1f}"
        print(
            f"{row['suffix_tokens']:>7} {row['loaded_tokens']:>7} {row['gpu_hit_ms']:>11.1f}"
            f" {row['cpu_hit_ms']:>11.1f} {row['load_ms']:>8.1f} {bound:>9}"
        )
    step_kinds = dict(llm.engine.runner.step_kinds)
    print(f"steps by kind (CUDA graph replays or eager): {step_kinds}")
    for suffix, found in profiles.items():
        print(
            f"\nprofile, suffix {suffix} (TTFT {found['ttft_ms_under_profiler']:.1f} ms under the profiler)"
        )
        for title, key in (("device", "top_device"), ("host", "top_host")):
            print(f"  top by {title} time:")
            for op in found[key]:
                print(
                    f"    {op['device_ms']:>8.2f} dev ms {op['host_ms']:>8.2f} host ms {op['count']:>6}x  {op['name']}"
                )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "device": name,
                    "dtype": dtype,
                    "prefix_tokens": prefix_len,
                    "h2d_gbps": h2d,
                    "rows": rows,
                    "max_graph_tokens": llm.engine.args.max_graph_tokens,
                    "step_kinds": step_kinds,
                    "profiles": {str(k): v for k, v in profiles.items()},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
