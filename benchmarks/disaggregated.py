"""Disaggregated prefill/decode under a mixed load (issue 32, speed targets).

``--users`` users each decode ``--decode-tokens`` tokens after a short prompt, one request
after another (closed loop) for ``--duration`` seconds, while long prompts of
``--long-min``..``--long-max`` tokens arrive at ``--long-rate`` per second (fixed rate). The
same load (same prompts, greedy) runs against four set-ups of real ``kvstash serve``
processes:

- ``alone``: one engine (role both), the decodes only: the reference time between tokens;
- ``mixed``: the same engine, decodes and long prompts;
- ``round-robin``: two engines of role both, requests dealt to them in turn by this client;
- ``pd``: one ``--kv-role producer`` and one ``--kv-role consumer`` behind ``kvstash proxy``,
  through a shared tier (``--shared-tier grpc``: ``kvstash cache-server``; ``redis``).

Per set-up: p50/p99 TTFT (decodes and long prompts apart), p50/p99 time between tokens of
the decodes, requests finished per second (finished / the span from the first request sent
to the last one ended), goodput (requests per second that met the SLO: TTFT ≤
``--slo-ttft-ms`` and their own p99 time between tokens ≤ ``--slo-itl-ms``), and each
mixed set-up's p99 time between tokens over ``alone``'s (the issue's target: pd ≤ 1.2).
Then ``--lone-repeats`` lone prompts of ``--long-max`` tokens, one at a time: TTFT on the
one engine against through the proxy, and whether their greedy answers are equal.

    python benchmarks/disaggregated.py --out /tmp/pd.json                     # CPU, tiny model
    python benchmarks/disaggregated.py --model-size 8b --out pd.json          # one GPU, 8B shape, bf16

Engines sharing one device get ``--gpu-kv-tokens`` KV tokens each (default: the load's
needs) or ``--gpu-share`` of its memory each (then they start one after another). Table to
stdout, everything (per-request records too) to ``--out``. Exit 1 when a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.support.serving_args import (  # noqa: E402
    MODEL_NAMES,
    add_common_args,
    base_engine_flags,
    device_name,
    prepare_model,
    resolve_common,
    say,
)
from benchmarks.support.serving_stack import SHARED_TIERS, ServingStack, free_ports, kv_pool_flags  # noqa: E402
from benchmarks.support.stream_load import (  # noqa: E402
    RequestRecord,
    client,
    makespan_s,
    percentile_ms,
    request_meets_slo,
    stream_completion,
    wait_until,
)

SETUPS = ("alone", "mixed", "round-robin", "pd")
#: per model size: users, decode tokens, decode prompt, long min, long max, long rate /s,
#: long prompts' max tokens, duration s, SLO TTFT ms, SLO ITL ms, CPU tier GiB, cache server MiB
DEFAULTS = {
    "tiny": dict(users=4, decode_tokens=48, decode_prompt=32, long_min=768, long_max=1536, long_rate=2.0,
                 long_max_tokens=8, duration=3.0, slo_ttft_ms=1000.0, slo_itl_ms=150.0, cpu_gb=0.25,
                 cache_server_mib=512.0),
    "bench": dict(users=4, decode_tokens=64, decode_prompt=64, long_min=1024, long_max=2048, long_rate=1.0,
                  long_max_tokens=8, duration=10.0, slo_ttft_ms=3000.0, slo_itl_ms=300.0, cpu_gb=0.5,
                  cache_server_mib=1024.0),
    "8b": dict(users=32, decode_tokens=256, decode_prompt=128, long_min=8192, long_max=16384, long_rate=0.5,
               long_max_tokens=16, duration=20.0, slo_ttft_ms=2000.0, slo_itl_ms=100.0, cpu_gb=8.0,
               cache_server_mib=16384.0),
}  # fmt: skip


def random_tokens(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab_size) for _ in range(length)]


class Workload:
    """The prompts, the same for every set-up: decode user ``u``'s ``k``-th prompt and the
    ``i``-th long prompt (its length drawn in [long_min, long_max])."""

    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        self.args, self.vocab_size = args, vocab_size
        rng = random.Random(args.seed)
        num_long = int(args.duration * args.long_rate) if args.long_rate > 0 else 0
        self.long_lengths = [rng.randint(args.long_min, args.long_max) for _ in range(num_long)]

    def decode_prompt(self, user: int, index: int) -> list[int]:
        seed = 1_000_003 * self.args.seed + 10_007 * user + index + 3
        return random_tokens(seed, self.args.decode_prompt, self.vocab_size)

    def long_prompt(self, index: int) -> list[int]:
        return random_tokens(self.args.seed * 7919 + index, self.long_lengths[index], self.vocab_size)

    def lone_prompt(self, index: int) -> list[int]:
        return random_tokens(self.args.seed * 104729 + 17 + index, self.args.long_max, self.vocab_size)


async def run_load(targets: list[str], workload: Workload, with_long: bool, tag: str) -> list[RequestRecord]:
    """The mixed load against ``targets`` (requests dealt to them in turn, in arrival order)."""
    args = workload.args
    dealer = itertools.cycle(targets)
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def user(http, u: int) -> None:
        await wait_until(t0, u * 0.01)
        for index in itertools.count():
            if time.perf_counter() - t0 >= args.duration:
                return
            prompt = workload.decode_prompt(u, index)
            record = RequestRecord(f"{tag}-decode-{u}-{index}", "decode", next(dealer), len(prompt), user=u)
            records.append(record)
            await stream_completion(http, record, prompt, args.decode_tokens, t0)
            if not record.ok:
                return  # counted; a user whose request failed stops (no retry storm)

    async def long_prompt(http, i: int) -> None:
        await wait_until(t0, (i + 0.5) / args.long_rate)
        prompt = workload.long_prompt(i)
        record = RequestRecord(f"{tag}-long-{i}", "long", next(dealer), len(prompt))
        records.append(record)
        await stream_completion(http, record, prompt, args.long_max_tokens, t0)

    num_long = len(workload.long_lengths) if with_long else 0
    async with client(args.users + num_long + 4, args.request_timeout_s) as http:
        tasks = [user(http, u) for u in range(args.users)] + [long_prompt(http, i) for i in range(num_long)]
        await asyncio.gather(*tasks)
    return records


async def lone_prompts(target: str, workload: Workload, tag: str) -> list[RequestRecord]:
    """``--lone-repeats`` long prompts one at a time (nothing else running)."""
    records = []
    async with client(2, workload.args.request_timeout_s) as http:
        for index in range(workload.args.lone_repeats):
            prompt = workload.lone_prompt(index)
            record = RequestRecord(f"{tag}-lone-{index}", "lone", target, len(prompt))
            records.append(await stream_completion(http, record, prompt, 8, time.perf_counter()))
    return records


async def warm_up(targets: list[str], workload: Workload) -> None:
    """One long and one decode request per target, untimed (kernels, graphs, the planner's rates)."""
    args = workload.args
    async with client(4, args.request_timeout_s) as http:
        for n, target in enumerate(targets):
            for prompt, max_tokens in (
                (random_tokens(-1 - n, args.long_max, workload.vocab_size), args.long_max_tokens),
                (random_tokens(-100 - n, args.decode_prompt, workload.vocab_size), args.decode_tokens),
            ):
                record = RequestRecord(f"warm-{n}", "warm", target, len(prompt))
                await stream_completion(http, record, prompt, max_tokens, time.perf_counter())
                if not record.ok:
                    raise RuntimeError(f"warm-up request to {target} failed: {record.error}")


def summarize(records: list[RequestRecord], args: argparse.Namespace) -> dict:
    decodes = [r for r in records if r.kind == "decode" and r.ok]
    longs = [r for r in records if r.kind == "long" and r.ok]
    span = makespan_s(records)
    gaps = [gap for r in decodes for gap in r.itl_s]
    num_ok = sum(r.ok for r in records)
    num_in_slo = sum(request_meets_slo(r, args.slo_ttft_ms, args.slo_itl_ms) for r in records)
    return {
        "num_requests": len(records),
        "num_finished": num_ok,
        "num_failed": len(records) - num_ok,
        "errors": sorted({r.error for r in records if r.error})[:5],
        "num_decodes": len(decodes),
        "num_long": len(longs),
        "makespan_s": span,
        "finished_per_s": num_ok / span if span else 0.0,
        "generated_tokens_per_s": sum(r.num_tokens for r in records if r.ok) / span if span else 0.0,
        "decode_ttft_p50_ms": percentile_ms([r.ttft_s for r in decodes], 50),
        "decode_ttft_p99_ms": percentile_ms([r.ttft_s for r in decodes], 99),
        "long_ttft_p50_ms": percentile_ms([r.ttft_s for r in longs], 50),
        "long_ttft_p99_ms": percentile_ms([r.ttft_s for r in longs], 99),
        "itl_p50_ms": percentile_ms(gaps, 50),
        "itl_p99_ms": percentile_ms(gaps, 99),
        "itl_max_ms": max(gaps) * 1e3 if gaps else None,
        "goodput_per_s": num_in_slo / span if span else 0.0,
        "slo_attainment": num_in_slo / len(records) if records else 0.0,
    }


def engine_flags(args: argparse.Namespace, position: int) -> list[str]:
    flags = [*base_engine_flags(args), "--max-num-seqs", str(args.max_num_seqs)]
    return flags + kv_pool_flags(args.gpu_kv_tokens, args.gpu_share, position) + list(args.engine_arg)


def run_both_engines(args, model, workload, log_dir: Path, out: dict) -> None:
    """Set-ups alone, mixed (and the lone prompts) on engine 1, round-robin on engines 1 and 2."""
    wanted = set(args.setups)
    names = ["engine-1", "engine-2"] if "round-robin" in wanted else ["engine-1"]
    with ServingStack(model, log_dir / "both", args.engine_env) as stack:
        say(f"starting {len(names)} engine(s) of role both")
        urls = stack.start_engines(names, [engine_flags(args, i) for i in range(len(names))], args.one_by_one)
        say("warm-up")
        asyncio.run(warm_up(urls, workload))
        for setup, targets, with_long in (
            ("alone", urls[:1], False),
            ("mixed", urls[:1], True),
            ("round-robin", urls, True),
        ):
            if setup in wanted:
                say(f"  {setup}")
                out["records"][setup] = asyncio.run(run_load(targets, workload, with_long, setup))
        say("  lone prompts")
        out["records"]["lone-engine"] = asyncio.run(lone_prompts(urls[0], workload, "lone-engine"))
        say("stopping")
        out["shutdown_codes"]["both"] = stack.close()


def run_pd(args, model, workload, log_dir: Path, out: dict) -> None:
    """Producer + consumer behind ``kvstash proxy`` through the shared tier."""
    with ServingStack(model, log_dir / "pd", args.engine_env) as stack:
        say(f"starting the {args.shared_tier} tier, a producer, a consumer and the proxy")
        tier_url = stack.start_shared_tier(args.shared_tier, args.cache_server_mib)
        tier = [
            "--kv-offload",
            "--kv-offload-remote",
            tier_url,
            "--kv-offload-cpu-gb",
            f"{args.cpu_tier_gb:g}",
        ]
        flags = [
            ["--kv-role", role, *tier, *engine_flags(args, i)]
            for i, role in enumerate(("producer", "consumer"))
        ]
        # the proxy starts with the engines (it takes an engine that does not answer yet out
        # and tries it again later: the warm-up below waits until both answer through it)
        ports = free_ports(2)
        producer, consumer = (f"http://127.0.0.1:{port}" for port in ports)
        with ThreadPoolExecutor(2) as starting:
            proxy_started = starting.submit(
                stack.start_front, "proxy", ["--prefill", producer, "--decode", consumer]
            )
            stack.start_engines(["producer", "consumer"], flags, args.one_by_one, ports=ports)
            proxy = proxy_started.result()
        say("warm-up")
        asyncio.run(warm_up([proxy], workload))
        say("  pd")
        out["records"]["pd"] = asyncio.run(run_load([proxy], workload, True, "pd"))
        say("  lone prompts")
        out["records"]["lone-proxy"] = asyncio.run(lone_prompts(proxy, workload, "lone-proxy"))
        say("stopping")
        out["shutdown_codes"]["pd"] = stack.close()


def lone_summary(engine: list[RequestRecord], proxy: list[RequestRecord]) -> dict:
    def median_ms(records: list[RequestRecord]) -> float | None:
        return percentile_ms([r.ttft_s for r in records if r.ok], 50)

    equal = [a.ok and b.ok and a.text == b.text for a, b in zip(engine, proxy, strict=True)]
    engine_ms, proxy_ms = median_ms(engine), median_ms(proxy)
    return {
        "num_prompts": len(engine),
        "prompt_tokens": engine[0].num_prompt_tokens if engine else None,
        "engine_ttft_ms": engine_ms,
        "proxy_ttft_ms": proxy_ms,
        "proxy_minus_engine_ms": None if None in (engine_ms, proxy_ms) else proxy_ms - engine_ms,
        "consumer_external_hit_tokens": [r.external_hit_tokens for r in proxy],
        "outputs_equal": all(equal) and bool(equal),
    }


def print_table(result: dict) -> None:
    def cell(value, width: int, digits: int = 1) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

    slo = result["slo"]
    print(
        f"\ndisaggregated prefill/decode — {result['device']}, {result['model']}, {result['dtype']}; "
        f"{result['workload']['users']} users x {result['workload']['decode_tokens']} tokens, long prompts "
        f"{result['workload']['long_min']}-{result['workload']['long_max']} tokens at {result['workload']['long_rate']:g}/s "
        f"for {result['workload']['duration_s']:g} s; SLO: TTFT <= {slo['ttft_ms']:g} ms and p99 ITL <= {slo['itl_ms']:g} ms"
    )
    header = (
        f"{'set-up':<12} {'reqs':>5} {'fail':>4} {'fin/s':>7} {'good/s':>7} {'TTFT dec p50/p99':>17} "
        f"{'TTFT long p50/p99':>18} {'ITL p50/p99':>15} {'ITL p99/alone':>13}"
    )
    print(header)
    print("-" * len(header))
    for setup, s in result["setups"].items():
        print(
            f"{setup:<12} {s['num_requests']:>5} {s['num_failed']:>4} {s['finished_per_s']:>7.2f} "
            f"{s['goodput_per_s']:>7.2f} {cell(s['decode_ttft_p50_ms'], 8)}/{cell(s['decode_ttft_p99_ms'], 8)} "
            f"{cell(s['long_ttft_p50_ms'], 9)}/{cell(s['long_ttft_p99_ms'], 8)} "
            f"{cell(s['itl_p50_ms'], 7)}/{cell(s['itl_p99_ms'], 7)} {cell(s.get('itl_p99_over_alone'), 13, 2)}"
        )
    lone = result.get("lone")
    if lone:
        print(
            f"lone {lone['prompt_tokens']}-token prompt, median TTFT of {lone['num_prompts']}: one engine "
            f"{cell(lone['engine_ttft_ms'], 0)} ms, through the proxy {cell(lone['proxy_ttft_ms'], 0)} ms "
            f"(+{cell(lone['proxy_minus_engine_ms'], 0)} ms: hand-over and hops); greedy answers equal: "
            f"{lone['outputs_equal']}"
        )
    print("(ms; fin/s = requests finished per second; good/s = those within the SLO per second)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    add("--users", type=int, default=None)
    add("--decode-tokens", type=int, default=None, help="tokens each decode request generates")
    add("--decode-prompt", type=int, default=None, help="decode requests' prompt tokens")
    add("--long-min", type=int, default=None)
    add("--long-max", type=int, default=None)
    add("--long-rate", type=float, default=None, help="long prompts per second")
    add("--long-max-tokens", type=int, default=None, help="tokens each long prompt generates")
    add("--duration", type=float, default=None, help="seconds during which requests are sent")
    add("--slo-ttft-ms", type=float, default=None)
    add("--slo-itl-ms", type=float, default=None)
    add("--lone-repeats", type=int, default=3)
    add("--shared-tier", choices=SHARED_TIERS, default="grpc")
    add("--cache-server-mib", type=float, default=None)
    add("--cpu-tier-gb", type=float, default=None, help="P/D engines' CPU tier")
    add(
        "--gpu-kv-tokens",
        type=int,
        default=None,
        help="each engine's KV pool in tokens (default: the load's needs)",
    )
    add("--gpu-share", type=float, default=None, help="instead: each engine's share of the device's memory")
    add("--max-num-seqs", type=int, default=None)
    add_common_args(parser)
    args = parser.parse_args(argv)
    resolve_common(args, parser)
    for name, value in DEFAULTS[args.model_size].items():
        key = {"duration": "duration", "cpu_gb": "cpu_tier_gb"}.get(name, name)
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    for setup in args.setups:
        if setup not in SETUPS:
            parser.error(f"--setups: unknown set-up {setup!r}; choose from {', '.join(SETUPS)}")
    for name in (
        "users",
        "decode_tokens",
        "decode_prompt",
        "long_min",
        "long_max",
        "long_max_tokens",
        "lone_repeats",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.long_min > args.long_max:
        parser.error(f"--long-min {args.long_min} exceeds --long-max {args.long_max}")
    if args.duration <= 0 or args.long_rate < 0:
        parser.error("--duration must be positive and --long-rate not negative")
    if args.gpu_kv_tokens is not None and args.gpu_share is not None:
        parser.error("give --gpu-kv-tokens or --gpu-share, not both")
    if args.gpu_share is not None and not 0 < args.gpu_share <= 0.5:
        parser.error(
            f"--gpu-share must be in (0, 0.5] (two engines share the device), got {args.gpu_share:g}"
        )
    num_long_in_flight = max(4, int(args.long_rate * 4))
    args.max_num_seqs = args.max_num_seqs or args.users + num_long_in_flight
    if args.gpu_kv_tokens is None and args.gpu_share is None:
        needs = args.users * (args.decode_prompt + args.decode_tokens) + num_long_in_flight * (
            args.long_max + args.long_max_tokens
        )
        args.gpu_kv_tokens = int(needs * 1.25)
    args.one_by_one = args.gpu_share is not None  # shares are taken from the memory free at start
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvstash-pd-bench-"))
    log_dir = args.log_dir or work / "logs"
    out: dict = {"records": {}, "shutdown_codes": {}}
    try:
        model = prepare_model(args, work)
        if args.long_max + args.long_max_tokens > model.max_model_len:
            raise SystemExit(
                f"--long-max {args.long_max} does not fit the model's context of {model.max_model_len}"
            )
        workload = Workload(args, model.vocab_size)
        if set(args.setups) & {"alone", "mixed", "round-robin"}:
            run_both_engines(args, model, workload, log_dir, out)
        if "pd" in args.setups:
            run_pd(args, model, workload, log_dir, out)
    finally:
        if args.log_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    records = out["records"]
    setups = {s: summarize(records[s], args) for s in SETUPS if s in records}
    alone_p99 = setups.get("alone", {}).get("itl_p99_ms")
    for summary in setups.values():
        summary["itl_p99_over_alone"] = (
            summary["itl_p99_ms"] / alone_p99 if alone_p99 and summary["itl_p99_ms"] else None
        )
    result = {
        "benchmark": "disaggregated",
        "device": device_name(args.device),
        "model": MODEL_NAMES[model.size],
        "dtype": args.dtype,
        "shared_tier": args.shared_tier,
        "workload": {
            "users": args.users,
            "decode_tokens": args.decode_tokens,
            "decode_prompt": args.decode_prompt,
            "long_min": args.long_min,
            "long_max": args.long_max,
            "long_rate": args.long_rate,
            "long_max_tokens": args.long_max_tokens,
            "duration_s": args.duration,
            "seed": args.seed,
        },  # fmt: skip
        "engine": {
            "gpu_kv_tokens": args.gpu_kv_tokens,
            "gpu_share": args.gpu_share,
            "max_num_seqs": args.max_num_seqs,
            "engine_args": args.engine_arg,
        },
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
        "setups": setups,
        "lone": lone_summary(records["lone-engine"], records["lone-proxy"])
        if {"lone-engine", "lone-proxy"} <= set(records)
        else None,
        "long_outputs_equal": long_outputs_equal(records),
        "shutdown_codes": out["shutdown_codes"],
        "records": {name: [r.as_json() for r in rs] for name, rs in records.items()},
    }
    print_table(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 1 if any(s["num_failed"] for s in setups.values()) else 0


def long_outputs_equal(records: dict[str, list[RequestRecord]]) -> dict[str, bool]:
    """Per mixed set-up: whether each long prompt's greedy answer equals the ``mixed`` one's."""
    reference = {
        r.request_id.split("-long-")[1]: r.text for r in records.get("mixed", []) if r.kind == "long" and r.ok
    }
    equal = {}
    for setup in ("round-robin", "pd"):
        answers = {
            r.request_id.split("-long-")[1]: r.text
            for r in records.get(setup, [])
            if r.kind == "long" and r.ok
        }
        common = reference.keys() & answers.keys()
        if common:
            equal[setup] = all(reference[k] == answers[k] for k in common)
    return equal


if __name__ == "__main__":
    sys.exit(main())
