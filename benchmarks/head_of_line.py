"""Head-of-line blocking: does fetching one request's KV from a slow tier stall the
others? (issue #15)

For each tier it runs one engine with a CPU tier plus that lower tier, stores a
long prompt's KV, drops it from the CPU tier (and the GPU prefix cache; the OS
page cache too for disk where allowed), starts a decoding request, then submits
the long prompt again and steps the engine. It reports the co-running decode's
longest gap between two tokens while the long prompt waits for its first token,
its median gap, and the long prompt's TTFT, against recompute (the same with a
fresh prompt nothing holds) and against a lone recompute (no decode running), plus
what the planner loaded per tier and recomputed. Each figure is the median over
``--repeats`` fresh prompts. Every figure is taken twice in the same engine, with
the scheduler's prefill cap off and at ``--max-decode-gap-ms`` (engine.prefill_cap:
while a request decodes, other prompts' chunks are sized to keep its gap short, and so
are the hit's loads from the CPU tier: whole chunks that fit the step's time, the rest in
the next steps). Per step of the window it records the hit's loaded tokens: the table
shows the most one step loaded and what the steps of the longest gap loaded (JSON: every
step's time and loads). ``--tiers cpu`` measures a hit that stays in the CPU tier.

    python benchmarks/head_of_line.py --out hol.json          # GPU: Llama-3.1-8B shape, bf16, 16,384 tokens
    python benchmarks/head_of_line.py --tiny --out /tmp/hol.json   # CPU: tiny model, redis behind a throttled proxy

The CPU mode starts a real redis-server behind a real TCP proxy capped at
``--proxy-rate`` bytes/s (benchmarks/support/delay_proxy.py) and a disk tier; the
GPU mode measures disk, the cache server (``kvstash cache-server`` on the same
host) and redis when a redis-server is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engine_throughput import llama_config  # noqa: E402
from benchmarks.ttft import (  # noqa: E402
    cache_server,
    drop_page_cache,
    evict_cpu_tier,
    kv_bytes_per_token,
    random_prompt,
)
from connector import OffloadConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def set_decode_gap(llm: LLM, max_decode_gap_ms: float) -> None:
    """Turn the scheduler's prefill cap to ``max_decode_gap_ms`` (0: off) between rounds."""
    scheduler = llm.engine.scheduler
    scheduler.prefill_cap = dataclasses.replace(scheduler.prefill_cap, max_decode_gap_ms=max_decode_gap_ms)


def lone_round(llm: LLM, prompt: list[int], seed: int) -> dict:
    """TTFT of ``prompt`` recomputed with nothing else running (the cap never applies)."""
    llm.reset_prefix_cache()
    llm.engine.add_request(f"lone-{seed}", prompt, FIRST_TOKEN)
    output = None
    while llm.engine.has_unfinished_requests():
        output = next((o for o in llm.engine.step() if o.finished), output)
    return {"ttft_ms": output.metrics.ttft_s * 1e3}


class HitLoadRecorder:
    """Counts the tokens of ``request_id`` that each scheduled step loads (its connector
    metadata's loads): wraps the scheduler's ``schedule`` while in a ``with`` block."""

    def __init__(self, llm: LLM, request_id: str) -> None:
        self.scheduler = llm.engine.scheduler
        self.request_id = request_id
        self.num_loaded = 0  # since the last ``take``

    def __enter__(self) -> HitLoadRecorder:
        schedule = self.scheduler.schedule

        def recording_schedule(*args, **kwargs):
            plan = schedule(*args, **kwargs)
            meta = plan.connector_meta
            for spec in meta.loads if meta is not None else ():
                if spec.request_id == self.request_id:
                    self.num_loaded += spec.num_load_end - spec.num_load_start
            return plan

        self.scheduler.schedule = recording_schedule
        return self

    def __exit__(self, *exc) -> None:
        del self.scheduler.schedule  # the class's method again

    def take(self) -> int:
        num_loaded, self.num_loaded = self.num_loaded, 0
        return num_loaded


def one_round(
    llm: LLM, prompt: list[int], vocab_size: int, *, stored: bool, disk: bool, seed: int, evict: bool = True
) -> dict:
    """Run a decoding request, submit ``prompt``; figures of that window, with per step of
    it: its time, the prompt's tokens it loaded, whether the decode got a token."""
    engine = llm.engine
    if stored:
        llm.generate([prompt], FIRST_TOKEN)  # stores its KV (CPU + write-through)
        llm.flush_kv_offload()
        if evict:
            evict_cpu_tier(llm)
    llm.reset_prefix_cache()
    page_cache_dropped = drop_page_cache() if disk else None
    decode_id, hit_id = f"decode-{seed}", f"long-{seed}"
    engine.add_request(
        decode_id,
        random_prompt(32, vocab_size, seed=seed + 7),
        SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True),  # aborted once measured
    )
    decode_times: list[float] = []
    while len(decode_times) < 8:  # a steady decode before the long prompt arrives
        if any(o.request_id == decode_id for o in engine.step()):
            decode_times.append(time.perf_counter())
    submitted = time.perf_counter()
    engine.add_request(hit_id, prompt, FIRST_TOKEN)
    first_token_at = None
    hit_output = None
    loaded_ends: list[int] = []  # the hit's KV length after each step that loaded part of it
    steps: list[dict] = []  # the window's steps until the prompt's first token
    recorder = HitLoadRecorder(llm, hit_id)
    while first_token_at is None or len(decode_times) < 3 or decode_times[-1] <= first_token_at:
        hit_request = engine.requests.get(hit_id)
        computed_before = 0 if hit_request is None else hit_request.num_computed_tokens
        kinds_before = dict(engine.runner.step_kinds)
        began = time.perf_counter()
        with recorder:
            outputs = engine.step()
        decoded = False
        for output in outputs:
            if output.request_id == decode_id:
                decode_times.append(time.perf_counter())
                decoded = True
            elif output.request_id == hit_id and output.finished:
                first_token_at = time.perf_counter()
                hit_output = output
        num_loaded = recorder.take()
        if first_token_at is None or not steps or steps[-1]["end"] < first_token_at:
            ended = time.perf_counter()
            hit_request = engine.requests.get(hit_id)
            computed_after = computed_before if hit_request is None else hit_request.num_computed_tokens
            kinds = {k: n - kinds_before.get(k, 0) for k, n in engine.runner.step_kinds.items()}
            steps.append(
                {
                    "end": ended,
                    "ms": (ended - began) * 1e3,
                    "loaded": num_loaded,
                    "decoded": decoded,
                    # the prompt's tokens this step advanced (loaded or computed), and how it ran
                    "advanced": max(0, computed_after - computed_before),
                    "kind": ",".join(k for k, n in kinds.items() if n > 0),
                }
            )
        hit_request = engine.requests.get(hit_id)
        num_done = (
            0 if hit_request is None or hit_request.output_token_ids else hit_request.num_computed_tokens
        )
        if num_done and num_done not in loaded_ends[-1:]:
            loaded_ends.append(num_done)
    engine.abort_request(decode_id)
    while engine.has_unfinished_requests():
        engine.step()
    window = [t for t in decode_times if t >= submitted]
    window_gaps = [b - a for a, b in zip([submitted, *window[:-1]], window, strict=True)]
    # the steps that ended inside the longest gap (the last one gave the decode its token)
    longest = max(range(len(window_gaps)), key=window_gaps.__getitem__)
    gap_begin, gap_end = ([submitted, *window][longest], window[longest])
    gap_steps = [step for step in steps if gap_begin < step["end"] <= gap_end]
    steady_gaps = [b - a for a, b in zip(decode_times[:7], decode_times[1:8], strict=True)]
    metrics = hit_output.metrics
    return {
        "ttft_ms": metrics.ttft_s * 1e3,
        "decode_max_gap_ms": max(window_gaps) * 1e3,
        "decode_median_gap_ms": statistics.median(steady_gaps) * 1e3,
        "decode_tokens_while_waiting": sum(1 for t in window if t < first_token_at),
        # steps that advanced the prompt before its last one (pipelined loads: one per piece
        # of the fetch loaded as it arrived; recomputed chunks count too)
        "prompt_steps_before_last": len(loaded_ends),
        # the prompt's loads per step (tokens) and the steps of the decode's longest gap
        "max_loaded_per_step": max((step["loaded"] for step in steps), default=0),
        "num_load_steps": sum(1 for step in steps if step["loaded"]),
        "longest_gap_loaded": sum(step["loaded"] for step in gap_steps),
        "longest_gap_steps": len(gap_steps),
        "steps": [{k: v for k, v in step.items() if k != "end"} for step in steps],
        "ext_tokens": metrics.num_external_cached_tokens,
        "tier_to_loaded_tokens": metrics.tier_to_loaded_tokens,
        "planned_recompute_tokens": metrics.num_planned_recompute_tokens,
        "page_cache_dropped": page_cache_dropped,
    }


def measure(name: str, offload: OffloadConfig, config, engine_args: dict, args, length: int) -> list[dict]:
    """One engine for the tier; per repeat and per cap setting (off, then on) a recompute,
    a hit and a lone recompute of fresh prompts. One row per cap setting."""
    llm = LLM(config, load_format="dummy", kv_offload=offload, **engine_args)
    vocab = config.vocab_size
    gaps_ms = (0.0, args.max_decode_gap_ms) if args.max_decode_gap_ms else (0.0,)
    # Warm-up of every path (recompute, CPU-tier load, fetch; capped chunks) so compilation stays out.
    for warm_seed, gap_ms in enumerate(gaps_ms):
        set_decode_gap(llm, gap_ms)
        warm = random_prompt(min(length, 1024), vocab, seed=4242 + warm_seed)
        one_round(llm, warm, vocab, stored=True, disk=False, seed=-1 - warm_seed)
    gap_to_runs = {gap_ms: {"hit": [], "recompute": [], "lone": []} for gap_ms in gaps_ms}
    for repeat in range(args.repeats):
        for gap_index, gap_ms in enumerate(gaps_ms):
            set_decode_gap(llm, gap_ms)
            runs = gap_to_runs[gap_ms]
            for kind in ("recompute", "hit", "lone"):
                seed = (
                    length * 1000 + repeat * 100 + gap_index * 10 + ("recompute", "hit", "lone").index(kind)
                )
                prompt = random_prompt(length, vocab, seed=seed)
                if kind == "lone":
                    runs[kind].append(lone_round(llm, prompt, seed))
                    continue
                runs[kind].append(
                    one_round(
                        llm,
                        prompt,
                        vocab,
                        stored=kind == "hit",
                        disk=name == "disk",
                        seed=seed,
                        evict=name != "cpu",
                    )
                )
    planner = llm.engine.scheduler.connector.planner
    rates = planner.snapshot() if planner is not None else {}
    # what the planner and the cap planned with: the step-time model's parameters and its
    # prediction of a lone recompute at a few lengths (against the TTFTs measured above)
    step_times = llm.engine.step_times
    step_time_model = {
        **step_times.parameters(),
        **{f"prefill_s:{n}": step_times.prefill_seconds(0, n) for n in (4096, 8192, 16384)},
    }
    del llm
    if engine_args["device"] == "cuda":
        torch.cuda.empty_cache()

    rows = []
    for gap_ms, runs in gap_to_runs.items():

        def median(kind: str, field: str, runs=runs) -> float:
            return statistics.median(run[field] for run in runs[kind])

        last_hit = runs["hit"][-1]
        rows.append(
            {
                "tier": name,
                "max_decode_gap_ms": gap_ms,
                "hit_ttft_ms": median("hit", "ttft_ms"),
                "recompute_ttft_ms": median("recompute", "ttft_ms"),
                "lone_recompute_ttft_ms": median("lone", "ttft_ms"),
                "hit_decode_max_gap_ms": median("hit", "decode_max_gap_ms"),
                "recompute_decode_max_gap_ms": median("recompute", "decode_max_gap_ms"),
                "decode_median_gap_ms": median("hit", "decode_median_gap_ms"),
                "decode_tokens_while_waiting": median("hit", "decode_tokens_while_waiting"),
                "hit_prompt_steps_before_last": median("hit", "prompt_steps_before_last"),
                "hit_max_loaded_per_step": median("hit", "max_loaded_per_step"),
                "hit_num_load_steps": median("hit", "num_load_steps"),
                "hit_longest_gap_loaded": median("hit", "longest_gap_loaded"),
                "tier_to_loaded_tokens": last_hit["tier_to_loaded_tokens"],
                "planned_recompute_tokens": last_hit["planned_recompute_tokens"],
                "page_cache_dropped": last_hit["page_cache_dropped"],
                "planner_rates": rates,
                "step_time_model": step_time_model,
                "runs": runs,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'tier':<7} {'cap ms':>6} {'TTFT hit':>9} {'TTFT rec':>9} {'hit/rec':>7} {'TTFT lone':>9} "
        f"{'gap hit':>8} {'gap rec':>8} {'gap med':>8} {'dec toks':>8} {'pieces':>6} "
        f"{'max ld':>6} {'ld stp':>6} {'gap ld':>6}  loaded per tier / recomputed"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        loaded = ",".join(f"{k}:{v}" for k, v in sorted(row["tier_to_loaded_tokens"].items())) or "-"
        cap = f"{row['max_decode_gap_ms']:g}" if row["max_decode_gap_ms"] else "off"
        print(
            f"{row['tier']:<7} {cap:>6} {row['hit_ttft_ms']:>9.1f} {row['recompute_ttft_ms']:>9.1f} "
            f"{row['hit_ttft_ms'] / row['recompute_ttft_ms']:>7.2f} {row['lone_recompute_ttft_ms']:>9.1f} "
            f"{row['hit_decode_max_gap_ms']:>8.1f} {row['recompute_decode_max_gap_ms']:>8.1f} "
            f"{row['decode_median_gap_ms']:>8.2f} {row['decode_tokens_while_waiting']:>8.0f} "
            f"{row['hit_prompt_steps_before_last']:>6.0f} {row['hit_max_loaded_per_step']:>6.0f} "
            f"{row['hit_num_load_steps']:>6.0f} {row['hit_longest_gap_loaded']:>6.0f}  "
            f"{loaded} / {row['planned_recompute_tokens']}"
        )
    print(
        "(ms; gap = a co-running decode's longest gap between tokens while the long prompt waits;"
        " TTFT lone = recompute with nothing decoding; cap = the engine's max_decode_gap_ms;"
        " pieces = the hit's steps before its last: loads of the chunks that had arrived, or head chunks;"
        " max ld = the most tokens of the hit one step loaded, ld stp = its steps that loaded,"
        " gap ld = its tokens loaded in the steps of the hit's longest gap: with the cap a load takes"
        " the whole chunks that fit the step's time)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model on CPU, redis behind a throttled proxy"
    )
    parser.add_argument("--length", type=int, default=None, help="long prompt tokens (16384 GPU, 3000 tiny)")
    parser.add_argument("--tiers", default=None, help="comma-separated: cpu, disk, redis, grpc")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--proxy-rate", type=float, default=200_000, help="CPU mode: proxy bytes/s")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="chunked-prefill budget per step"
    )
    parser.add_argument(
        "--max-decode-gap-ms",
        type=float,
        default=50.0,
        help="the prefill cap measured against no cap (0: only without)",
    )
    parser.add_argument("--load-policy", default="planned", choices=("planned", "always"))
    parser.add_argument(
        "--no-pipelined-loads",
        action="store_true",
        help="load a fetch only once it ended (OffloadConfig.pipelined_loads off), to compare",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads (tiny: 1, so that a shared CPU's other jobs do not stall "
        "every parallel op of a step; GPU: torch's default)",
    )
    parser.add_argument("--disk-path", type=Path, default=None, help="disk tier folder (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()

    device = "cpu" if args.tiny else "cuda"
    torch_threads = args.torch_threads or (1 if args.tiny else None)
    if torch_threads:
        torch.set_num_threads(torch_threads)
    dtype_name = "float32" if args.tiny else "bfloat16"
    length = args.length or (3000 if args.tiny else 16384)
    tiers = (args.tiers or ("redis,disk" if args.tiny else "disk,grpc,redis")).split(",")
    config = llama_config(args.tiny)
    block_size = 16
    engine_args = dict(
        device=device,
        dtype=dtype_name,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=(length + 2048) // block_size * 2,
        max_num_seqs=4,
    )
    kv_bytes = (length + 2048) * kv_bytes_per_token(config, dtype_name)
    disk_root = Path(tempfile.mkdtemp(prefix="kvstash-hol-")) if args.disk_path is None else args.disk_path
    rows = []
    for tier in tiers:
        fields = dict(
            cpu_bytes=2 * kv_bytes, load_policy=args.load_policy, pipelined_loads=not args.no_pipelined_loads
        )
        if tier == "cpu":  # the hit stays in the CPU tier: loaded in the admitting step(s)
            rows += measure(tier, OffloadConfig(**fields), config, engine_args, args, length)
        elif tier == "disk":
            rows += measure(
                tier,
                OffloadConfig(**fields, disk_path=str(disk_root / "disk"), disk_bytes=4 * kv_bytes),
                config,
                engine_args,
                args,
                length,
            )
        elif tier == "grpc":
            with cache_server(memory_gb=max(4, 4 * kv_bytes / (1 << 30))) as url:
                rows += measure(
                    tier, OffloadConfig(**fields, remote_url=url), config, engine_args, args, length
                )
        elif tier == "redis":
            from benchmarks.support.delay_proxy import DelayProxy
            from benchmarks.support.redis_process import RedisServerProcess

            if shutil.which("redis-server") is None:
                print("redis tier skipped: no redis-server on this machine")
                continue
            server = RedisServerProcess().start()
            try:
                rate = args.proxy_rate if args.tiny else None
                with DelayProxy(server.port, rate_bytes_per_s=rate) as proxy:
                    url = f"redis://127.0.0.1:{proxy.port}"
                    tier_rows = measure(
                        tier, OffloadConfig(**fields, remote_url=url), config, engine_args, args, length
                    )
                    for row in tier_rows:
                        row["proxy_rate_bytes_per_s"] = rate
                    rows += tier_rows
            finally:
                server.close()
        else:
            parser.error(f"unknown tier {tier!r}: choose cpu, disk, redis, grpc")
    if args.disk_path is None:
        shutil.rmtree(disk_root, ignore_errors=True)
    device_name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    print(f"\nhead-of-line: {length}-token prompt, {device_name}, {dtype_name}, median of {args.repeats}")
    print_table(rows)
    report = {
        "benchmark": "head_of_line",
        "device": device_name,
        "dtype": dtype_name,
        "model": "tiny-llama" if args.tiny else "llama-3.1-8b-shaped (random weights)",
        "prompt_tokens": length,
        "load_policy": args.load_policy,
        "pipelined_loads": not args.no_pipelined_loads,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "torch": torch.__version__,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
