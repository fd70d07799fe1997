"""Routing across replicas: round-robin, session affinity and KV-aware (issue 33 benchmark).

``--users`` users hold conversations of ``--turns`` turns with ``--replicas`` real
``kvstash serve`` replicas (each with a GPU KV pool of ``--gpu-kv-tokens`` and a CPU tier of
``--cpu-tier-gb``, publishing KV events). A user's first prompt is a context of
``--context-min``..``--context-max`` tokens and a question; each later turn is the previous
prompt, an answer and a new question, so it extends the previous prompt. Requests arrive at
``--rate`` per second (users shuffled within each round of turns), a turn never before the
user's previous one ended. The users' contexts together exceed one replica's GPU+CPU cache
(the script prints both). Three policies, each with prompts of its own (same lengths, other
tokens: what one policy left in the caches is no hit for the next):

- ``round-robin``: this client deals requests to the replicas in turn;
- ``affinity``: this client sends each user to replica ``crc32(user id) % replicas``;
- ``kv-aware``: ``kvstash router`` in front of the replicas, following their KV events.

Per policy: hit rate (cached prompt tokens / prompt tokens, from the answers' usage, split
into GPU prefix cache and offload tiers; overall and for turns after the first), mean and
P90 TTFT, throughput (requests and tokens per second over the span from the first request
sent to the last one ended), and the load per replica (finished requests and prompt tokens,
from each replica's ``/metrics`` before and after) with its max/min ratio.

    python benchmarks/router.py --out /tmp/router.json                  # CPU, tiny model
    python benchmarks/router.py --model-size 8b --out router.json       # one GPU, 8B shape, bf16

Table to stdout, everything (per-request records too) to ``--out``. Exit 1 when a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
import zlib
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
from benchmarks.support.serving_stack import (  # noqa: E402
    ServingStack,
    free_ports,
    kv_event_endpoints,
    kv_pool_flags,
)
from benchmarks.support.stream_load import (  # noqa: E402
    RequestRecord,
    client,
    makespan_s,
    mean_ms,
    percentile_ms,
    stream_completion,
    wait_until,
)

POLICIES = ("round-robin", "affinity", "kv-aware")
#: per model size: users, turns, context min/max, question and answer tokens, rate /s,
#: replica KV pool tokens, replica CPU tier GiB
DEFAULTS = {
    "tiny": dict(users=8, turns=3, context_min=512, context_max=1024, question_tokens=32, answer_tokens=8,
                 rate=8.0, gpu_kv_tokens=1536, cpu_tier_gb=0.0025),
    "bench": dict(users=12, turns=3, context_min=1024, context_max=2048, question_tokens=32, answer_tokens=16,
                  rate=2.0, gpu_kv_tokens=8192, cpu_tier_gb=0.02),
    "8b": dict(users=24, turns=3, context_min=4096, context_max=12288, question_tokens=64, answer_tokens=32,
               rate=2.0, gpu_kv_tokens=32768, cpu_tier_gb=12.0),
}  # fmt: skip
#: the replicas' counters read before and after each policy (prometheus sample names)
COUNTERS = {
    "prompt_tokens": "kvstash_prompt_tokens_total",
    "generation_tokens": "kvstash_generation_tokens_total",
    "gpu_hit_tokens": "kvstash_gpu_prefix_hit_tokens_total",
    "external_hit_tokens": "kvstash_external_hit_tokens_total",
}


class Conversations:
    """Every policy's prompts: user ``u``'s turn ``t`` is its turn ``t - 1`` + an answer +
    a question. Lengths depend on the seed only; tokens on the seed and the policy."""

    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        self.args, self.vocab_size = args, vocab_size
        rng = random.Random(args.seed)
        self.context_lengths = [rng.randint(args.context_min, args.context_max) for _ in range(args.users)]
        # arrival slots: round by round, users shuffled within a round
        order = []
        for turn in range(args.turns):
            users = list(range(args.users))
            rng.shuffle(users)
            order += [(user, turn) for user in users]
        self.slot_of = {key: index for index, key in enumerate(order)}

    def prompt(self, policy_index: int, user: int, turn: int) -> list[int]:
        args = self.args
        rng = random.Random(f"{args.seed}:{policy_index}:{user}")

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, self.vocab_size) for _ in range(n)]

        prompt = tokens(self.context_lengths[user]) + tokens(args.question_tokens)
        for _ in range(turn):
            prompt += tokens(args.answer_tokens) + tokens(args.question_tokens)
        return prompt

    def longest(self) -> int:
        args = self.args
        return args.context_max + args.turns * args.question_tokens + (args.turns - 1) * args.answer_tokens

    def total_context_tokens(self) -> int:
        args = self.args
        per_user_extra = args.turns * args.question_tokens + (args.turns - 1) * args.answer_tokens
        return sum(self.context_lengths) + args.users * per_user_extra


async def run_policy(
    policy: str, policy_index: int, targets: list[str], conversations: Conversations
) -> list[RequestRecord]:
    args = conversations.args
    records: list[RequestRecord] = []
    dealt = 0
    t0 = time.perf_counter()

    def target_of(user: int) -> str:
        nonlocal dealt
        if policy == "round-robin":
            dealt += 1
            return targets[(dealt - 1) % len(targets)]
        if policy == "affinity":
            return targets[zlib.crc32(f"user-{user}".encode()) % len(targets)]
        return targets[0]  # the router

    async def user(http, u: int) -> None:
        for turn in range(args.turns):
            await wait_until(t0, conversations.slot_of[(u, turn)] / args.rate)
            prompt = conversations.prompt(policy_index, u, turn)
            record = RequestRecord(
                f"{policy}-{u}-{turn}", "turn", target_of(u), len(prompt), user=u, turn=turn
            )
            records.append(record)
            await stream_completion(http, record, prompt, args.answer_tokens, t0)
            if not record.ok:
                return  # counted; the conversation ends

    async with client(args.users + 2, args.request_timeout_s) as http:
        await asyncio.gather(*(user(http, u) for u in range(args.users)))
    return records


def replica_counters(url: str) -> dict[str, float]:
    """The replica's finished requests and token counters from its ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).raise_for_status().text
    values = dict.fromkeys(["requests", *COUNTERS], 0.0)
    name_of = {sample: name for name, sample in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstash_requests_total":
                values["requests"] += sample.value
            elif sample.name in name_of:
                values[name_of[sample.name]] += sample.value
    return values


def summarize(records: list[RequestRecord], loads: list[dict[str, float]]) -> dict:
    ok = [r for r in records if r.ok]
    later = [r for r in ok if r.turn]
    span = makespan_s(records)

    def hit_rate(rs: list[RequestRecord]) -> float | None:
        prompt = sum(r.num_prompt_tokens for r in rs)
        return sum(r.cached_tokens for r in rs) / prompt if prompt else None

    def spread(key: str) -> float | None:
        values = [load[key] for load in loads]
        return max(values) / min(values) if values and min(values) > 0 else None

    prompt_tokens = sum(r.num_prompt_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_finished": len(ok),
        "num_failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "hit_rate": hit_rate(ok),
        "hit_rate_later_turns": hit_rate(later),
        "gpu_hit_share": sum(r.gpu_hit_tokens for r in ok) / prompt_tokens if prompt_tokens else None,
        "external_hit_share": sum(r.external_hit_tokens for r in ok) / prompt_tokens
        if prompt_tokens
        else None,
        "ttft_mean_ms": mean_ms([r.ttft_s for r in ok]),
        "ttft_p90_ms": percentile_ms([r.ttft_s for r in ok], 90),
        "ttft_later_turns_mean_ms": mean_ms([r.ttft_s for r in later]),
        "ttft_later_turns_p90_ms": percentile_ms([r.ttft_s for r in later], 90),
        "makespan_s": span,
        "requests_per_s": len(ok) / span if span else 0.0,
        "prompt_tokens_per_s": prompt_tokens / span if span else 0.0,
        "generated_tokens_per_s": sum(r.num_tokens for r in ok) / span if span else 0.0,
        "replica_loads": loads,
        "replica_requests_max_over_min": spread("requests"),
        "replica_prompt_tokens_max_over_min": spread("prompt_tokens"),
    }


def run(args: argparse.Namespace, model, conversations: Conversations, log_dir: Path) -> dict:
    names = [f"replica-{i}" for i in range(args.replicas)]
    flag_lists, events = [], []
    for i, name in enumerate(names):
        pub, replay = kv_event_endpoints()
        events += ["--replica-events", f"{pub},{replay}"]
        flags = [*base_engine_flags(args), "--max-num-seqs", str(args.users + 2), "--engine-id", name]
        flags += ["--kv-offload", "--kv-offload-cpu-gb", f"{args.cpu_tier_gb:g}"]
        flags += ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
        flag_lists.append(flags + kv_pool_flags(args.gpu_kv_tokens, None, i) + list(args.engine_arg))
    records: dict[str, list[RequestRecord]] = {}
    summaries: dict[str, dict] = {}
    with ServingStack(model, log_dir, args.engine_env) as stack:
        # the router starts with the replicas: it asks for their events until they answer
        ports = free_ports(args.replicas)
        replicas = [flag for port in ports for flag in ("--replica", f"http://127.0.0.1:{port}")]
        router_flags = [*replicas, *events, "--tokenizer", str(model.path)]
        say(
            f"starting {args.replicas} replicas"
            + (" and kvstash router" if "kv-aware" in args.policies else "")
        )
        with ThreadPoolExecutor(2) as starting:
            router = (
                starting.submit(stack.start_front, "router", router_flags)
                if "kv-aware" in args.policies
                else None
            )
            urls = stack.start_engines(names, flag_lists, ports=ports)
            router_url = router.result() if router is not None else None
        say("warm-up")
        asyncio.run(warm_up(urls, conversations))
        for policy_index, policy in enumerate(POLICIES):
            if policy not in args.policies:
                continue
            say(f"  {policy}")
            before = [replica_counters(url) for url in urls]
            targets = [router_url] if policy == "kv-aware" else urls
            records[policy] = asyncio.run(run_policy(policy, policy_index + 1, targets, conversations))
            after = [replica_counters(url) for url in urls]
            loads = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
            summaries[policy] = summarize(records[policy], loads)
        say("stopping")
        codes = stack.close()
    return {"policies": summaries, "records": records, "shutdown_codes": codes}


async def warm_up(urls: list[str], conversations: Conversations) -> None:
    """One request per replica of the longest prompt length, untimed (tokens of policy 0)."""
    args = conversations.args
    async with client(len(urls), args.request_timeout_s) as http:
        for n, url in enumerate(urls):
            prompt = conversations.prompt(0, n % args.users, args.turns - 1)
            record = RequestRecord(f"warm-{n}", "warm", url, len(prompt))
            await stream_completion(http, record, prompt, args.answer_tokens, time.perf_counter())
            if not record.ok:
                raise RuntimeError(f"warm-up request to {url} failed: {record.error}")


def print_table(result: dict) -> None:
    def cell(value, width: int, digits: int = 1, scale: float = 1.0) -> str:
        return f"{'-':>{width}}" if value is None else f"{value * scale:>{width}.{digits}f}"

    w = result["workload"]
    print(
        f"\nrouting across {result['replicas']} replicas — {result['device']}, {result['model']}, "
        f"{result['dtype']}; {w['users']} users x {w['turns']} turns, contexts {w['context_min']}-"
        f"{w['context_max']} tokens, {w['rate']:g} requests/s; users' context {result['total_context_tokens']} "
        f"tokens against {result['replica_cache_tokens']} a replica holds (GPU {result['gpu_kv_tokens']} + CPU tier)"
    )
    header = (
        f"{'policy':<12} {'reqs':>5} {'fail':>4} {'hit %':>6} {'hit % t>1':>9} {'gpu/ext %':>11} "
        f"{'TTFT mean':>9} {'TTFT p90':>9} {'req/s':>6} {'tok/s':>8} {'reqs per replica':>17} {'tok max/min':>11}"
    )
    print(header)
    print("-" * len(header))
    for policy, s in result["policies"].items():
        per_replica = "/".join(f"{load['requests']:.0f}" for load in s["replica_loads"])
        print(
            f"{policy:<12} {s['num_requests']:>5} {s['num_failed']:>4} {cell(s['hit_rate'], 6, 1, 100)} "
            f"{cell(s['hit_rate_later_turns'], 9, 1, 100)} "
            f"{cell(s['gpu_hit_share'], 5, 1, 100)}/{cell(s['external_hit_share'], 5, 1, 100)} "
            f"{cell(s['ttft_mean_ms'], 9)} {cell(s['ttft_p90_ms'], 9)} {s['requests_per_s']:>6.2f} "
            f"{s['prompt_tokens_per_s']:>8.0f} {per_replica:>17} {cell(s['replica_prompt_tokens_max_over_min'], 11, 2)}"
        )
    ratios = result["p90_ttft_ratios"]
    if ratios:
        print(
            "P90 TTFT over kv-aware's: "
            + ", ".join(f"{policy} {cell(value, 0, 2)}x" for policy, value in ratios.items())
        )
    print(
        "(ms; hit % = cached prompt tokens / prompt tokens, t>1 = turns after the first, gpu/ext = from the "
        "GPU prefix cache / offload tiers; tok/s = prompt tokens per second; tok max/min = prompt tokens per "
        "replica, busiest over idlest)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    add("--replicas", type=int, default=2)
    add("--users", type=int, default=None)
    add("--turns", type=int, default=None)
    add("--context-min", type=int, default=None, help="first prompt's context tokens, at least")
    add("--context-max", type=int, default=None)
    add("--question-tokens", type=int, default=None)
    add("--answer-tokens", type=int, default=None, help="tokens generated per turn (and added to the next)")
    add("--rate", type=float, default=None, help="requests per second (fixed-rate arrivals)")
    add("--gpu-kv-tokens", type=int, default=None, help="each replica's KV pool in tokens")
    add("--cpu-tier-gb", type=float, default=None, help="each replica's CPU tier")
    add_common_args(parser)
    args = parser.parse_args(argv)
    resolve_common(args, parser)
    for name, value in DEFAULTS["8b" if args.model_size == "8b" else args.model_size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in args.policies:
        if policy not in POLICIES:
            parser.error(f"--policies: unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    for name in (
        "replicas",
        "users",
        "turns",
        "context_min",
        "question_tokens",
        "answer_tokens",
        "gpu_kv_tokens",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.context_min > args.context_max:
        parser.error(f"--context-min {args.context_min} exceeds --context-max {args.context_max}")
    if args.rate <= 0 or args.cpu_tier_gb < 0:
        parser.error("--rate must be positive and --cpu-tier-gb not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvstash-router-bench-"))
    try:
        model = prepare_model(args, work)
        conversations = Conversations(args, model.vocab_size)
        if conversations.longest() + args.answer_tokens > model.max_model_len:
            raise SystemExit(
                f"the last turn reaches {conversations.longest()} tokens, more than the model's "
                f"context of {model.max_model_len}"
            )
        kv_token = model.kv_bytes_per_token(args.dtype)
        replica_cache_tokens = args.gpu_kv_tokens + int(args.cpu_tier_gb * (1 << 30) / kv_token)
        total = conversations.total_context_tokens()
        say(
            f"users' context {total} tokens; one replica holds {replica_cache_tokens} "
            f"({'exceeded' if total > replica_cache_tokens else 'NOT exceeded: grow --users or --context-*'})"
        )
        outcome = run(args, model, conversations, args.log_dir or work / "logs")
    finally:
        if args.log_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    policies = outcome["policies"]
    kv_aware = policies.get("kv-aware", {}).get("ttft_p90_ms")
    ratios = {
        policy: summary["ttft_p90_ms"] / kv_aware
        for policy, summary in policies.items()
        if policy != "kv-aware" and kv_aware and summary["ttft_p90_ms"]
    }
    result = {
        "benchmark": "router",
        "device": device_name(args.device),
        "model": MODEL_NAMES[model.size],
        "dtype": args.dtype,
        "replicas": args.replicas,
        "workload": {
            "users": args.users,
            "turns": args.turns,
            "context_min": args.context_min,
            "context_max": args.context_max,
            "question_tokens": args.question_tokens,
            "answer_tokens": args.answer_tokens,
            "rate": args.rate,
            "seed": args.seed,
        },  # fmt: skip
        "gpu_kv_tokens": args.gpu_kv_tokens,
        "cpu_tier_gb": args.cpu_tier_gb,
        "kv_bytes_per_token": kv_token,
        "total_context_tokens": total,
        "replica_cache_tokens": replica_cache_tokens,
        "policies": policies,
        "p90_ttft_ratios": ratios,
        "shutdown_codes": outcome["shutdown_codes"],
        "records": {name: [r.as_json() for r in rs] for name, rs in outcome["records"].items()},
    }
    print_table(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 1 if any(s["num_failed"] for s in policies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
