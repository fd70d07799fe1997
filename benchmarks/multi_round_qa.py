"""Multi-round QA on the GPU, offload off vs on (issue 10).

Many users, each with a long context of their own, ask questions round after
round; each round's prompt is the previous prompt + the previous answer + a new
question. All users of a round arrive together (one batch through the engine),
so the engine's prefix cache competes for GPU blocks: with more context in total
than the GPU KV pool holds, offload off must recompute contexts that were
evicted, offload on loads them back from the CPU tier.

Both runs use fresh engines, the same prompts and greedy decoding; their output
tokens must be identical. Figures: throughput (generated tokens / wall seconds,
and prompt+generated tokens / s) and mean / p99 TTFT, overall and per round.

    python benchmarks/multi_round_qa.py --out mrqa.json --png mrqa.png      # GPU, 8B shape
    python benchmarks/multi_round_qa.py --tiny --out /tmp/mrqa.json         # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.results import Workload  # noqa: E402
from bench.workload import make_conversations, run_warmup  # noqa: E402
from benchmarks.engine_throughput import llama_config  # noqa: E402
from connector import OffloadConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run(llm: LLM, workload: Workload, conversations, label: str) -> dict:
    """All rounds on one engine; returns per-request TTFTs, outputs and wall time."""
    params = SamplingParams(max_tokens=workload.answer_len, temperature=0.0, ignore_eos=True)
    run_warmup(llm, workload, conversations.warmup, label)  # the same untimed warm-up as `kvstash bench`
    histories = [list(context) for context in conversations.contexts]
    rounds = []
    began = time.perf_counter()
    for round_index in range(workload.num_rounds):
        prompts = [histories[u] + conversations.questions[u][round_index] for u in range(workload.num_users)]
        round_began = time.perf_counter()
        outputs = llm.generate(prompts, params)
        round_seconds = time.perf_counter() - round_began
        rounds.append(
            {
                "round": round_index,
                "seconds": round_seconds,
                "ttft_s": [o.metrics.ttft_s for o in outputs],
                "num_prompt_tokens": sum(len(p) for p in prompts),
                "num_gpu_hit_tokens": sum(o.metrics.num_local_cached_tokens for o in outputs),
                "num_external_hit_tokens": sum(o.metrics.num_external_cached_tokens for o in outputs),
                "output_token_ids": [list(o.token_ids) for o in outputs],
            }
        )
        histories = [prompt + list(o.token_ids) for prompt, o in zip(prompts, outputs, strict=True)]
        print(
            f"{label:>12} round {round_index}: {round_seconds:7.2f} s, mean TTFT "
            f"{statistics.mean(rounds[-1]['ttft_s']) * 1e3:8.1f} ms, GPU hit "
            f"{rounds[-1]['num_gpu_hit_tokens']}, ext hit {rounds[-1]['num_external_hit_tokens']}",
            flush=True,
        )
    return {"rounds": rounds, "wall_s": time.perf_counter() - began}


def summarize(result: dict, workload: Workload) -> dict:
    ttfts = [t for r in result["rounds"] for t in r["ttft_s"]]
    num_generated = workload.num_users * workload.num_rounds * workload.answer_len
    num_prompt = sum(r["num_prompt_tokens"] for r in result["rounds"])
    return {
        "wall_s": result["wall_s"],
        "generated_tokens_per_s": num_generated / result["wall_s"],
        "total_tokens_per_s": (num_generated + num_prompt) / result["wall_s"],
        "mean_ttft_ms": statistics.mean(ttfts) * 1e3,
        "p99_ttft_ms": percentile(ttfts, 0.99) * 1e3,
        "per_round_mean_ttft_ms": [statistics.mean(r["ttft_s"]) * 1e3 for r in result["rounds"]],
        "gpu_hit_tokens": sum(r["num_gpu_hit_tokens"] for r in result["rounds"]),
        "external_hit_tokens": sum(r["num_external_hit_tokens"] for r in result["rounds"]),
    }


def plot(summary_off: dict, summary_on: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = range(1, len(summary_off["per_round_mean_ttft_ms"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(rounds, summary_off["per_round_mean_ttft_ms"], "-o", label="offload off")
    ax.plot(rounds, summary_on["per_round_mean_ttft_ms"], "-o", label="offload on (CPU tier)")
    ax.set_xlabel("round")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_xticks(list(rounds))
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke run)")
    parser.add_argument("--users", type=int, default=None)
    parser.add_argument("--context-len", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--question-len", type=int, default=None)
    parser.add_argument("--answer-len", type=int, default=None)
    parser.add_argument("--gpu-kv-tokens", type=int, default=None, help="engine KV pool size in tokens")
    parser.add_argument("--cpu-gb", type=float, default=None, help="CPU tier size")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="both engines in the deterministic mode (batch-invariant kernels): outputs must be identical in bf16",
    )
    args = parser.parse_args()

    tiny = args.tiny
    workload = Workload(
        num_users=args.users or (4 if tiny else 24),
        context_len=args.context_len or (256 if tiny else 8192),
        num_rounds=args.rounds or 3,
        question_len=args.question_len or (16 if tiny else 64),
        answer_len=args.answer_len or (8 if tiny else 64),
        seed=0,
    )
    workload.validate()
    device = "cpu" if tiny else "cuda"
    dtype = "float32" if tiny else "bfloat16"
    config = llama_config(tiny)
    block_size = 16
    # The GPU pool holds about a third of all users' contexts: most must be evicted per round.
    gpu_kv_tokens = args.gpu_kv_tokens or max(
        2 * workload.max_prompt_len, workload.num_users * workload.max_prompt_len // 3
    )
    engine_args = dict(
        device=device,
        dtype=dtype,
        num_gpu_blocks=gpu_kv_tokens // block_size,
        max_num_seqs=workload.num_users,
        max_num_batched_tokens=256 if tiny else 16384,
        deterministic=args.deterministic,
    )
    head_dim = config.hidden_size // config.num_attention_heads
    bytes_per_token = (
        config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * (4 if tiny else 2)
    )
    # Every slot of the CPU tier holds one chunk (a trailing partial chunk too): room
    # for each user's full chunks plus one partial chunk per round, so nothing is evicted.
    chunk_size = OffloadConfig().chunk_size
    slots_per_user = -(-workload.max_prompt_len // chunk_size) + workload.num_rounds
    chunk_bytes = chunk_size * bytes_per_token
    cpu_bytes = (
        int(args.cpu_gb * (1 << 30)) if args.cpu_gb else workload.num_users * slots_per_user * chunk_bytes
    )
    offload = OffloadConfig(cpu_bytes=cpu_bytes)

    summaries, results = {}, {}
    conversations = None
    for label, kv_offload in (("offload off", None), ("offload on", offload)):
        llm = LLM(config, load_format="dummy", kv_offload=kv_offload, **engine_args)
        if conversations is None:
            conversations = make_conversations(workload, list(range(10, config.vocab_size)))
        results[label] = run(llm, workload, conversations, label)
        summaries[label] = summarize(results[label], workload)
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    identical = [r["output_token_ids"] for r in results["offload off"]["rounds"]] == [
        r["output_token_ids"] for r in results["offload on"]["rounds"]
    ]
    device_name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    off, on = summaries["offload off"], summaries["offload on"]
    print(
        f"\nmulti-round QA{' (deterministic mode)' if args.deterministic else ''} — {device_name}, {workload.num_users} users x {workload.context_len}-token contexts, "
        f"{workload.num_rounds} rounds, GPU KV pool {gpu_kv_tokens} tokens"
    )
    print(
        f"{'':>12} {'gen tok/s':>10} {'all tok/s':>10} {'mean TTFT ms':>13} {'p99 TTFT ms':>12} {'ext hit':>9}"
    )
    for label, s in summaries.items():
        print(
            f"{label:>12} {s['generated_tokens_per_s']:>10.1f} {s['total_tokens_per_s']:>10.0f} "
            f"{s['mean_ttft_ms']:>13.1f} {s['p99_ttft_ms']:>12.1f} {s['external_hit_tokens']:>9}"
        )
    print(
        f"on / off: throughput {on['generated_tokens_per_s'] / off['generated_tokens_per_s']:.2f}x, "
        f"mean TTFT {off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}x lower; outputs identical: {identical}"
    )
    report = {
        "benchmark": "multi_round_qa",
        "device": device_name,
        "dtype": dtype,
        "model": "tiny-llama" if tiny else "llama-3.1-8b-shaped (random weights)",
        "workload": workload.__dict__,
        "gpu_kv_tokens": gpu_kv_tokens,
        "cpu_tier_bytes": cpu_bytes,
        "outputs_identical": identical,
        "deterministic": args.deterministic,
        "off": off,
        "on": on,
        "throughput_ratio": on["generated_tokens_per_s"] / off["generated_tokens_per_s"],
        "mean_ttft_ratio": off["mean_ttft_ms"] / on["mean_ttft_ms"],
        "torch": torch.__version__,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.png:
        plot(off, on, args.png, f"multi-round QA, {workload.num_users} users — {device_name}")
        print(f"wrote {args.png}")
    if not identical:
        raise SystemExit("outputs differ between offload off and on")


if __name__ == "__main__":
    main()
