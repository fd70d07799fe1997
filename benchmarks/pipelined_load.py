"""Pipelined loads, measured on the CPU (issue #16 item 3): the time to first token of a
lower-tier hit with the fetch's chunks loaded as they arrive (pipelined) and with one load
once the whole fetch ended, the same prompts in the same engine and run.

The model is a small Llama with a KV as wide as a real one per layer (8 layers x 8 KV heads
x 64 dims, float32: 32 KiB per token), so that the load (the unpack into the paged cache,
which is the host→device copy's place on CPU) costs what a fetch costs. Tiers, each real:
- ``disk``: the disk tier (O_DIRECT reads where the filesystem takes them);
- ``redis``: a real redis-server behind a real TCP proxy capped at ``--proxy-rate-mb``
  MB/s per connection (benchmarks/support/delay_proxy.py, in a process of its own),
  ``--reads-in-flight`` reads at once.
Per repeat and tier: a fresh prompt is computed (and stored), then its KV is dropped from the
CPU tier and the GPU prefix cache and it is asked again, once pipelined and once not (the
order alternating). Also reported: recomputing a fresh prompt, and the host time the loads
took (``load ms``: what pipelining can hide behind the fetch).

    python benchmarks/pipelined_load.py --out /tmp/pipelined_load.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.presets import llama31_config  # noqa: E402
from benchmarks.ttft import evict_cpu_tier, kv_bytes_per_token, random_prompt, set_pipelined_loads  # noqa: E402
from connector import OffloadConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def wide_kv_config(num_layers: int):
    """A small Llama whose KV per layer is a real model's width (8 KV heads x 64 dims)."""
    return llama31_config(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=512,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
    )


#: runs benchmarks/support/delay_proxy.py in a child process (its pacing threads would
#: otherwise compete for this process's GIL with the engine's step thread)
_PROXY_CHILD = """
import sys
from benchmarks.support.delay_proxy import DelayProxy
proxy = DelayProxy(int(sys.argv[1]), rate_bytes_per_s=float(sys.argv[2])).start()
print(proxy.port, flush=True)
sys.stdin.read()  # until the parent closes it
"""


@contextlib.contextmanager
def throttled_proxy(target_port: int, rate_bytes_per_s: float):
    """A real TCP proxy to ``target_port`` capped at ``rate_bytes_per_s`` per connection and
    direction, in its own process; yields its port."""
    child = subprocess.Popen(
        [sys.executable, "-c", _PROXY_CHILD, str(target_port), str(rate_bytes_per_s)],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield int(child.stdout.readline())
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def hit(llm: LLM, prompt: list[int], pipelined: bool) -> dict:
    """A hit of ``prompt`` (stored before) from the lower tier alone."""
    evict_cpu_tier(llm)
    llm.reset_prefix_cache()
    set_pipelined_loads(llm, pipelined)
    output = llm.generate([prompt], FIRST_TOKEN)[0]
    stats = llm.engine.scheduler.connector.request_stats(output.request_id)
    return {
        "ttft_ms": output.metrics.ttft_s * 1e3,
        "load_ms": stats.load_seconds * 1e3,
        "loaded_tokens": stats.num_loaded_tokens,
        "tier_to_loaded_tokens": dict(output.metrics.tier_to_loaded_tokens),
    }


def measure(tier: str, offload: OffloadConfig, config, engine_args: dict, args) -> dict:
    llm = LLM(config, load_format="dummy", kv_offload=offload, **engine_args)
    vocab = config.vocab_size
    warm = random_prompt(min(args.tokens, 512), vocab, seed=7)  # every path once, off the clock
    llm.generate([warm], FIRST_TOKEN)
    llm.flush_kv_offload()
    for pipelined in (True, False):
        hit(llm, warm, pipelined)
    runs: dict[str, list[dict]] = {"pipelined": [], "unpipelined": [], "recompute": []}
    for repeat in range(args.repeats):
        prompt = random_prompt(args.tokens, vocab, seed=1000 + repeat)
        recompute = llm.generate([prompt], FIRST_TOKEN)[0]
        runs["recompute"].append({"ttft_ms": recompute.metrics.ttft_s * 1e3})
        llm.flush_kv_offload()
        for pipelined in (True, False) if repeat % 2 == 0 else (False, True):
            runs["pipelined" if pipelined else "unpipelined"].append(hit(llm, prompt, pipelined))
    llm.engine.runner.connector.close()
    del llm

    def median(kind: str, field: str) -> float:
        return statistics.median(run[field] for run in runs[kind])

    row = {
        "tier": tier,
        "tokens": args.tokens,
        "kv_mib": args.tokens * kv_bytes_per_token(config, "float32") / (1 << 20),
        "recompute_ms": median("recompute", "ttft_ms"),
        "hit_pipelined_ms": median("pipelined", "ttft_ms"),
        "hit_unpipelined_ms": median("unpipelined", "ttft_ms"),
        "load_pipelined_ms": median("pipelined", "load_ms"),
        "load_unpipelined_ms": median("unpipelined", "load_ms"),
        "tier_to_loaded_tokens": runs["pipelined"][-1]["tier_to_loaded_tokens"],
        "runs": runs,
    }
    row["pipelining_gain"] = 1 - row["hit_pipelined_ms"] / row["hit_unpipelined_ms"]
    return row


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'tier':<6} {'tokens':>6} {'KV MiB':>7} {'recompute':>9} {'hit pip':>8} {'hit unpip':>9} "
        f"{'gain':>6} {'load pip':>8} {'load unpip':>10}  loaded per tier"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        loaded = ",".join(f"{k}:{v}" for k, v in sorted(row["tier_to_loaded_tokens"].items())) or "-"
        print(
            f"{row['tier']:<6} {row['tokens']:>6} {row['kv_mib']:>7.1f} {row['recompute_ms']:>9.1f} "
            f"{row['hit_pipelined_ms']:>8.1f} {row['hit_unpipelined_ms']:>9.1f} "
            f"{row['pipelining_gain']:>6.0%} {row['load_pipelined_ms']:>8.1f} "
            f"{row['load_unpipelined_ms']:>10.1f}  {loaded}"
        )
    print("(ms, TTFT medians; gain = 1 - pipelined / unpipelined; load = host time of the loads)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--layers", type=int, default=8, help="model layers (4 KiB of KV per token each)")
    parser.add_argument("--tiers", default="disk,redis", help="comma-separated: disk, redis")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--proxy-rate-mb", type=float, default=40.0, help="redis proxy MB/s per connection")
    parser.add_argument(
        "--reads-in-flight", type=int, default=4, help="background reads per tier (disk and remote alike)"
    )
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()

    torch.set_num_threads(args.torch_threads)
    config = wide_kv_config(args.layers)
    kv_bytes = (args.tokens + 1024) * kv_bytes_per_token(config, "float32")
    block_size = 16
    engine_args = dict(
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=args.tokens,
        num_gpu_blocks=(args.tokens + 1024) // block_size * 2,
        max_num_seqs=4,
    )
    fields = dict(
        chunk_size=args.chunk_size,
        cpu_bytes=2 * kv_bytes,
        load_policy="always",  # measure the load path, whatever the planner would choose
        reads_in_flight=args.reads_in_flight,
        remote_reads_in_flight=args.reads_in_flight,
    )
    disk_root = Path(tempfile.mkdtemp(prefix="kvstash-pipelined-"))
    rows = []
    try:
        for tier in args.tiers.split(","):
            if tier == "disk":
                offload = OffloadConfig(**fields, disk_path=str(disk_root), disk_bytes=4 * kv_bytes)
                rows.append(measure(tier, offload, config, engine_args, args))
            elif tier == "redis":
                from benchmarks.support.redis_process import RedisServerProcess

                if shutil.which("redis-server") is None:
                    print("redis tier skipped: no redis-server on this machine")
                    continue
                server = RedisServerProcess().start()
                try:
                    with throttled_proxy(server.port, args.proxy_rate_mb * 1e6) as proxy_port:
                        offload = OffloadConfig(**fields, remote_url=f"redis://127.0.0.1:{proxy_port}")
                        row = measure(tier, offload, config, engine_args, args)
                        row["proxy_rate_mb_s"] = args.proxy_rate_mb
                        rows.append(row)
                finally:
                    server.close()
            else:
                parser.error(f"unknown tier {tier!r}: choose disk, redis")
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
    device_name = platform.processor() or "cpu"
    print(f"\npipelined loads: {args.tokens}-token prompt, {device_name}, median of {args.repeats}")
    print_table(rows)
    report = {
        "benchmark": "pipelined_load",
        "device": device_name,
        "model": f"llama, {args.layers} layers, 8 KV heads x 64, float32 (random weights)",
        "tokens": args.tokens,
        "chunk_size": args.chunk_size,
        "reads_in_flight": args.reads_in_flight,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "torch": torch.__version__,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
