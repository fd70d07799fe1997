"""Async scheduling and the persistent batch (issue #20 items 1 and 2), measured in one run.

1. Decode tokens/s at 1 and 8 concurrent requests, one engine stepped with async
   scheduling off and on in alternating rounds (the same weights, KV pool and CUDA
   graphs), and the device's idle time between steps: CUDA events on a GPU (time the
   GPU had nothing queued), host clocks on CPU (where the "device" is the host, the
   gap is the engine's own work between two forward passes).
2. Host time to prepare the inputs of a decode step of 64 requests, with the
   persistent batch (engine.input_batch) and built from scratch (the old path), on
   the same requests; the requests grow by a token each step, as in decoding.

    python benchmarks/async_scheduling.py --out async_scheduling.json          # CUDA: 8b preset
    python benchmarks/async_scheduling.py --model-size tiny --out /tmp/a.json  # CPU, seconds

Targets (H100, 8b): async >= 1.10x tokens/s at 1 and 8 requests; prepare time at
least halved. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import llama_config  # noqa: E402
from benchmarks.ttft import synchronize  # noqa: E402
from engine import EngineArgs, EngineCore, SamplingParams  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.scheduler import SchedulerOutput  # noqa: E402
from engine.step_future import DeviceTimeline  # noqa: E402


def decode_round(
    engine: EngineCore, prompts: list[list[int]], new_tokens: int, tag: str
) -> tuple[float, list[float], float]:
    """Prefill `prompts`, then time their decode to `new_tokens` tokens.
    -> (decode tokens/s, idle gaps between the decode steps in s, busy s of those steps)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    while any(not r.output_token_ids for r in requests):  # prefill (and the first token)
        engine.step()
    synchronize(engine.device)
    timeline = DeviceTimeline(engine.device)
    engine.runner.timeline = timeline
    num_before = sum(len(r.output_token_ids) for r in requests)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    synchronize(engine.device)
    seconds = time.perf_counter() - start
    engine.runner.timeline = None
    num_tokens = sum(len(r.output_token_ids) for r in requests) - num_before
    if any(len(r.output_token_ids) != new_tokens for r in requests):
        raise RuntimeError("a request generated a wrong number of tokens")
    return num_tokens / seconds, timeline.gaps_s(), sum(timeline.busy_s())


def measure_decode(engine: EngineCore, args, vocab_size: int) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for concurrency in args.concurrency:
        results: dict[bool, list[tuple[float, list[float], float]]] = {False: [], True: []}
        for round_index in range(args.rounds + 1):  # round 0 warms both modes up
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for enabled in order:
                engine.set_async_scheduling(enabled)
                prompts = torch.randint(10, vocab_size, (concurrency, args.prompt_len), generator=generator)
                result = decode_round(
                    engine,
                    prompts.tolist(),
                    args.new_tokens,
                    f"c{concurrency}r{round_index}{'a' if enabled else 's'}",
                )
                if round_index:
                    results[enabled].append(result)
        row = {"concurrency": concurrency}
        for enabled, name in ((False, "sync"), (True, "async")):
            rates = [r[0] for r in results[enabled]]
            gaps = [g for r in results[enabled] for g in r[1]]
            busy = sum(r[2] for r in results[enabled])
            row[name] = {
                "tokens_per_s": statistics.median(rates),
                "round_tokens_per_s": rates,
                "median_idle_gap_us": 1e6 * statistics.median(gaps) if gaps else 0.0,
                "mean_idle_gap_us": 1e6 * statistics.fmean(gaps) if gaps else 0.0,
                "idle_fraction": sum(gaps) / (sum(gaps) + busy) if busy else 0.0,
            }
        row["speedup"] = row["async"]["tokens_per_s"] / row["sync"]["tokens_per_s"]
        rows.append(row)
    engine.set_async_scheduling(False)
    return rows


def measure_prepare(engine: EngineCore, num_requests: int, context_len: int, num_steps: int) -> dict:
    """Median host seconds of `ModelRunner._prepare` for decode steps of `num_requests`
    requests of `context_len` tokens, with and without the persistent batch."""
    runner = engine.runner
    block_size = engine.block_size
    batch = runner.input_batch
    result = {}
    for name, input_batch in (("from_scratch", None), ("persistent_batch", batch)):
        runner.input_batch = input_batch
        requests = []
        next_block = 0
        for i in range(num_requests):
            request = Request(
                request_id=f"prep-{name}-{i}",
                prompt_token_ids=[(7 * i + j) % 500 + 3 for j in range(context_len)],
                sampling_params=SamplingParams(max_tokens=num_steps + 1, temperature=0.0),
                eos_token_ids=frozenset(),
                max_model_len=context_len + num_steps + 2,
            )
            num_blocks = -(-(context_len + num_steps + 1) // block_size)
            request.block_ids = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            request.num_admissions = 1
            requests.append(request)
        times = []
        for step in range(num_steps):
            for request in requests:
                request.num_computed_tokens = request.num_tokens - 1
            plan = SchedulerOutput(
                requests=requests,
                num_scheduled_tokens=[1] * num_requests,
                preempted_request_ids=[],
                finished_request_ids=set(),
            )
            start = time.perf_counter()
            runner._prepare(plan)
            times.append(time.perf_counter() - start)
            for request in requests:
                request.append_output_token((step * 31 + 5) % 500)
        result[name] = {"median_us": 1e6 * statistics.median(times[1:]), "num_steps": num_steps}
    runner.input_batch = batch
    result["speedup"] = result["from_scratch"]["median_us"] / result["persistent_batch"]["median_us"]
    result.update(num_requests=num_requests, context_len=context_len)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-size", choices=["tiny", "8b"], default=None, help="default: 8b on CUDA, tiny on CPU"
    )
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128 on CUDA, 24 on CPU")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode (after a warm-up round)")
    parser.add_argument("--prepare-requests", type=int, default=64)
    parser.add_argument("--prepare-context-len", type=int, default=2048)
    parser.add_argument("--prepare-steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("async_scheduling.json"))
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_size = args.model_size or ("8b" if device.type == "cuda" else "tiny")
    if args.new_tokens is None:
        args.new_tokens = 128 if device.type == "cuda" else 24
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = llama_config(tiny=model_size != "8b")
    max_len = max(args.prompt_len + args.new_tokens + 16, args.prepare_context_len + args.prepare_steps + 16)
    num_blocks = max(args.concurrency) * -(-(args.prompt_len + args.new_tokens + 16) // 16) + 16
    engine = EngineCore(
        config,
        EngineArgs(
            load_format="dummy",
            device=str(device),
            dtype=dtype,
            num_gpu_blocks=num_blocks,
            max_num_seqs=max(args.concurrency),
            max_model_len=max_len,
            warmup=False,
        ),
    )
    decode = measure_decode(engine, args, config.vocab_size)
    prepare = measure_prepare(engine, args.prepare_requests, args.prepare_context_len, args.prepare_steps)

    print(
        f"\nasync scheduling ({model_size}, {dtype}, {device}; prompt {args.prompt_len}, {args.new_tokens} new tokens)"
    )
    print(
        f"{'requests':>8} {'mode':>6} {'decode tok/s':>13} {'idle gap us (median)':>21} {'idle %':>7} {'speedup':>8}"
    )
    for row in decode:
        for name in ("sync", "async"):
            r = row[name]
            speedup = f"{row['speedup']:.2f}x" if name == "async" else ""
            print(
                f"{row['concurrency']:>8} {name:>6} {r['tokens_per_s']:>13.1f} {r['median_idle_gap_us']:>21.1f}"
                f" {100 * r['idle_fraction']:>6.1f}% {speedup:>8}"
            )
    print(
        f"\nprepare a decode step of {prepare['num_requests']} requests x {prepare['context_len']} tokens: "
        f"from scratch {prepare['from_scratch']['median_us']:.1f} us, persistent batch "
        f"{prepare['persistent_batch']['median_us']:.1f} us ({prepare['speedup']:.2f}x)"
    )
    report = {
        "model_size": model_size,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "dtype": dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "decode": decode,
        "prepare": prepare,
        "targets": {"async_speedup": 1.10, "prepare_speedup": 2.0},
        "meets_targets": {
            "async_speedup": all(row["speedup"] >= 1.10 for row in decode),
            "prepare_speedup": prepare["speedup"] >= 2.0,
        },
    }
    print(
        "targets: async >= 1.10x at every concurrency: "
        f"{'met' if report['meets_targets']['async_speedup'] else 'NOT met'}; prepare >= 2x: "
        f"{'met' if report['meets_targets']['prepare_speedup'] else 'NOT met'}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
