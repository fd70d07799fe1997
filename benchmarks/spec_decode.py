"""Decode speed with n-gram speculative decoding, and speedup versus acceptance rate.

Default (the GPU run): a Llama-3.1-8B-shaped model with random bf16 weights made on the
GPU, greedy decoding, EOS ignored. Two parts, each measured on one engine in the same run
(decode tokens/s = tokens generated after every request's first token / time of those steps,
median of --repeats runs):

1. "ngram": prompts that ask to edit a text (a random text, then its first tokens again),
   decoded without and with the n-gram proposer. Random weights rarely copy their input, so
   the acceptance rate here is whatever the model gives; it is printed beside the ratio.
2. "replay": drafts replayed from an earlier greedy run of the same prompts, each draft
   corrupted with a chosen probability: speed at known acceptance rates, the speedup curve
   (JSON + PNG next to --out).

"No speculation" is the same engine with its proposer removed (eager, like the speculative
steps); a separate plain engine with CUDA graphs (the production decode path) is measured
last, and the speedups against it are reported too.

    python benchmarks/spec_decode.py --out spec_decode.json
    python benchmarks/spec_decode.py --tiny --out /tmp/spec_tiny.json   # CPU smoke run, seconds
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import llama_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.spec_decode import NgramProposer  # noqa: E402
from engine.spec_decode.replay import ReplayProposer  # noqa: E402

DEFAULT_CORRUPT_FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


def edit_prompts(num_requests: int, text_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """A text followed by its first eighth again: continuing it means copying the text."""
    generator = torch.Generator().manual_seed(seed)
    texts = torch.randint(10, vocab_size, (num_requests, text_len), generator=generator).tolist()
    return [text + text[: max(text_len // 8, 4)] for text in texts]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, counter) -> dict:
    """Run the prompts to completion; time only the steps after every request has its first
    token. Returns decode seconds, tokens, tokens/s, the outputs and the spec counters."""
    engine = llm.engine
    requests = [engine.add_request(f"bench-{next(counter)}", p, params) for p in prompts]
    while any(not r.output_token_ids for r in requests):
        engine.step()
    stats = engine.stats.spec_decode
    drafts_before, accepted_before, verifications_before = (
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.num_verifications,
    )
    num_tokens_before = sum(len(r.output_token_ids) for r in requests)
    synchronize(engine.device)
    start = time.perf_counter()
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    synchronize(engine.device)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(r.output_token_ids) for r in requests) - num_tokens_before
    num_drafts = stats.num_draft_tokens - drafts_before
    num_accepted = stats.num_accepted_tokens - accepted_before
    num_verifications = stats.num_verifications - verifications_before
    return {
        "decode_seconds": seconds,
        "decode_tokens": num_tokens,
        "decode_tokens_per_s": num_tokens / seconds,
        "decode_steps": num_steps,
        "num_draft_tokens": num_drafts,
        "acceptance_rate": num_accepted / num_drafts if num_drafts else 0.0,
        "mean_accepted_length": num_accepted / num_verifications if num_verifications else 0.0,
        "outputs": [list(r.output_token_ids) for r in requests],
    }


def median_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, counter, repeats: int) -> dict:
    """`timed_decode` `repeats` times; the run with the median decode tokens/s."""
    runs = sorted(
        (timed_decode(llm, prompts, params, counter) for _ in range(repeats)),
        key=lambda run: run["decode_tokens_per_s"],
    )
    return runs[len(runs) // 2]


def make_llm(
    config,
    device: torch.device,
    dtype: str,
    speculative: bool,
    k: int,
    max_model_len: int,
    deterministic: bool = False,
) -> LLM:
    extra = dict(speculative="ngram", num_speculative_tokens=k) if speculative else {}
    return LLM(
        config,
        load_format="dummy",
        device=str(device),
        dtype=dtype,
        enable_prefix_caching=False,  # every run recomputes its prompts: runs stay comparable
        max_model_len=max_model_len,
        max_num_seqs=64,
        deterministic=deterministic,
        **extra,
    )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for batch_size in sorted({r["batch_size"] for r in rows}):
        points = sorted((r["acceptance_rate"], r["speedup"]) for r in rows if r["batch_size"] == batch_size)
        ax.plot(*zip(*points, strict=True), marker="o", label=f"batch {batch_size}")
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlabel("draft acceptance rate")
    ax.set_ylabel("decode speedup vs no speculation")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU in float32 (seconds)")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=None, help="default: 1 8 (1 2 with --tiny)"
    )
    parser.add_argument("--text-len", type=int, default=None, help="tokens of the text to edit")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--corrupt-fractions", type=float, nargs="+", default=list(DEFAULT_CORRUPT_FRACTIONS))
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs per point, median kept (3; 1 with --tiny)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write JSON here and the PNG beside it")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="the deterministic mode (batch-invariant kernels): n-gram outputs must equal plain ones in bf16",
    )
    args = parser.parse_args()

    batch_sizes = args.batch_sizes or ([1, 2] if args.tiny else [1, 8])
    text_len = args.text_len or (48 if args.tiny else 1024)
    new_tokens = args.new_tokens or (12 if args.tiny else 128)
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    k = args.num_speculative_tokens
    repeats = args.repeats or (1 if args.tiny else 3)
    config = llama_config(args.tiny)
    max_model_len = text_len + text_len // 8 + new_tokens + k + 16
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    counter = itertools.count()

    llm = make_llm(
        config,
        device,
        dtype,
        speculative=True,
        k=k,
        max_model_len=max_model_len,
        deterministic=args.deterministic,
    )
    scheduler = llm.engine.scheduler
    ngram = NgramProposer(k, min_n=2, max_n=4)
    warmup = edit_prompts(max(batch_sizes), text_len, config.vocab_size, seed=99)
    warmup_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    warmup_outputs = None
    for proposer in (None, ngram):  # compile kernels for decode and verification shapes
        scheduler.proposer = proposer
        run = timed_decode(llm, warmup, warmup_params, counter)
        warmup_outputs = warmup_outputs or run["outputs"]
    # ... and the replayed drafts' (K drafts in every verification, partly accepted): the
    # first timed replay run must not pay their first steps
    warmup_continuations = {tuple(p): o for p, o in zip(warmup, warmup_outputs, strict=True)}
    for fraction in (0.0, 0.5):
        scheduler.proposer = ReplayProposer(
            k, warmup_continuations, config.vocab_size, corrupt_fraction=fraction
        )
        timed_decode(llm, warmup, warmup_params, counter)

    ngram_rows, replay_rows = [], []
    batch_to_plain: dict[int, dict] = {}
    for batch_size in batch_sizes:
        prompts = edit_prompts(batch_size, text_len, config.vocab_size, seed=batch_size)
        scheduler.proposer = None
        plain = median_run(llm, prompts, params, counter, repeats)
        batch_to_plain[batch_size] = plain
        scheduler.proposer = ngram
        spec = median_run(llm, prompts, params, counter, repeats)
        if spec["outputs"] != plain["outputs"]:
            print(f"warning: batch {batch_size}: n-gram outputs differ from plain greedy outputs")
        ngram_rows.append(
            {
                "batch_size": batch_size,
                "plain_tokens_per_s": plain["decode_tokens_per_s"],
                "spec_tokens_per_s": spec["decode_tokens_per_s"],
                "speedup": spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                "acceptance_rate": spec["acceptance_rate"],
                "num_draft_tokens": spec["num_draft_tokens"],
                "outputs_identical": spec["outputs"] == plain["outputs"],
            }
        )
        continuations = {tuple(p): o for p, o in zip(prompts, plain["outputs"], strict=True)}
        for fraction in args.corrupt_fractions:
            scheduler.proposer = ReplayProposer(
                k, continuations, config.vocab_size, corrupt_fraction=fraction
            )
            run = median_run(llm, prompts, params, counter, repeats)
            replay_rows.append(
                {
                    "batch_size": batch_size,
                    "corrupt_fraction": fraction,
                    "acceptance_rate": run["acceptance_rate"],
                    "mean_accepted_length": run["mean_accepted_length"],
                    "tokens_per_s": run["decode_tokens_per_s"],
                    "decode_steps": run["decode_steps"],
                    "speedup": run["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                    "outputs_identical": run["outputs"] == plain["outputs"],
                }
            )

    spec_step_kinds = dict(llm.engine.runner.step_kinds)
    del llm, scheduler
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    graph_llm = make_llm(
        config,
        device,
        dtype,
        speculative=False,
        k=k,
        max_model_len=max_model_len,
        deterministic=args.deterministic,
    )
    timed_decode(graph_llm, warmup, warmup_params, counter)
    batch_to_graph_tps = {}
    for batch_size in batch_sizes:
        prompts = edit_prompts(batch_size, text_len, config.vocab_size, seed=batch_size)
        graph_run = median_run(graph_llm, prompts, params, counter, repeats)
        batch_to_graph_tps[batch_size] = graph_run["decode_tokens_per_s"]
    for row in replay_rows:
        row["speedup_vs_plain_engine"] = row["tokens_per_s"] / batch_to_graph_tps[row["batch_size"]]
    for row in ngram_rows:
        row["plain_engine_tokens_per_s"] = batch_to_graph_tps[row["batch_size"]]

    print(f"n-gram on an editing workload (K={k}, {text_len}-token text, {new_tokens} new tokens)")
    print(f"{'batch':>5} {'plain tok/s':>12} {'ngram tok/s':>12} {'ratio':>6} {'accept':>7} {'identical':>9}")
    for r in ngram_rows:
        print(
            f"{r['batch_size']:>5} {r['plain_tokens_per_s']:>12.1f} {r['spec_tokens_per_s']:>12.1f} "
            f"{r['speedup']:>6.2f} {r['acceptance_rate']:>7.2f} {str(r['outputs_identical']):>9}"
        )
    print("\nreplayed greedy drafts with a corrupted fraction (speedup vs the same engine without drafts)")
    print(
        f"{'batch':>5} {'corrupt':>7} {'accept':>7} {'acc.len':>7} {'tok/s':>9} {'speedup':>7} "
        f"{'vs graphs':>9} {'identical':>9}"
    )
    for r in replay_rows:
        print(
            f"{r['batch_size']:>5} {r['corrupt_fraction']:>7.2f} {r['acceptance_rate']:>7.2f} "
            f"{r['mean_accepted_length']:>7.2f} {r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f} "
            f"{r['speedup_vs_plain_engine']:>9.2f} {str(r['outputs_identical']):>9}"
        )
    print("plain engine (CUDA graphs where available) tok/s: " + str(batch_to_graph_tps))
    graph_step_kinds = dict(graph_llm.engine.runner.step_kinds)
    print(f"steps by kind: speculative engine {spec_step_kinds}, plain engine {graph_step_kinds}")
    all_identical = all(r["outputs_identical"] for r in ngram_rows + replay_rows)
    print(
        f"deterministic mode: {args.deterministic}; every speculative run's outputs identical: {all_identical}"
    )

    model_name = "tiny-llama" if args.tiny else "llama-3.1-8b-shaped (random weights)"
    result = {
        "benchmark": "spec_decode",
        "model": model_name,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "dtype": dtype,
        "deterministic": args.deterministic,
        "num_speculative_tokens": k,
        "text_len": text_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "ngram": ngram_rows,
        "replay": replay_rows,
        "plain_engine_tokens_per_s": batch_to_graph_tps,
        "step_kinds": {"speculative_engine": spec_step_kinds, "plain_engine": graph_step_kinds},
        "all_outputs_identical": all_identical,
        "torch": torch.__version__,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        plot(replay_rows, args.out.with_suffix(".png"), f"{model_name}, K={k}, {dtype}")


if __name__ == "__main__":
    main()
