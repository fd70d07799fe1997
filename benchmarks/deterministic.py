"""The deterministic mode on the 8B shape: identical tokens across the issue's matrix, and its cost.

Matrix (issue 18): KV source {offload off, CPU-tier hit, disk-tier hit} x
`max_num_batched_tokens` {512, 8192} x requests at once {1, all} x speculation
{off, n-gram}, plus for the batched runs drafts replayed from the reference run with
30% corrupted (n-gram rarely drafts for a random-weight model; replayed drafts make
every step verify): 30 runs, through one deterministic engine without offload and one
with a CPU tier over a disk tier (the token budget and the proposer are switched
between runs, the GPU prefix cache is reset before each, and the CPU tier is emptied
before each disk-tier run; the tier hit counters are printed per run).
Every request's tokens are compared with the reference run (offload off, 8192, all
at once, no speculation); the script prints the number of differing requests per run
and exits non-zero if any differs. "1 at once" runs the first `--num-alone` requests
one by one (the others only add minutes).

Cost: the same workload (all requests at once, 8192, offload off, no speculation)
through a default-mode engine, same run; throughput ratio deterministic / default
(target >= 0.8), printed as soon as it is known (the default engine runs between the
deterministic engine without offload and the one with tiers; the JSON is rewritten
after every run, so a run cut short keeps its figures). The default engine also runs
at 512 and one at a time, to show how many requests change there without the mode.

Scaled to about 3 minutes on an H100 (3 engine start-ups included): 64 requests of
256-768 random tokens (ending in a repeated segment, so n-gram matches exist), 32 greedy
tokens each. `--issue-size` is the issue's workload (prompts of 1024-4096 tokens, 128
new tokens); it takes longer than one 10-minute device call, so `--sources` runs part of
the matrix: `--sources off` (the reference, the default-mode engine and the throughput
ratio), then `--sources cpu disk --reference <the first JSON>`, which compares the tier
runs with the reference tokens stored in the first run's JSON (same prompts: checked).
On CUDA it also times the batch-invariant GEMM against cuBLAS on the 8B's shapes.

    python benchmarks/deterministic.py --out deterministic.json           # H100, 8B shape, bf16
    python benchmarks/deterministic.py --issue-size --sources off --out det_off.json
    python benchmarks/deterministic.py --issue-size --sources cpu disk --reference det_off.json --out det_tiers.json
    python benchmarks/deterministic.py --tiny --out /tmp/det.json         # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import llama_config  # noqa: E402
from connector import OffloadConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.spec_decode import NgramProposer  # noqa: E402
from engine.spec_decode.replay import ReplayProposer  # noqa: E402

SOURCES = ("offload off", "CPU-tier hit", "disk-tier hit")
#: --sources names -> SOURCES entries
SOURCE_NAMES = {"off": SOURCES[0], "cpu": SOURCES[1], "disk": SOURCES[2]}
CHUNK_SIZE = 256


def model_config(tiny: bool):
    """The 8B shape, or engine_throughput's tiny one with a 4k context (the runs' longest)."""
    config = llama_config(tiny)
    if tiny:
        config.max_position_embeddings = 4096
    return config


def make_prompts(num: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random prompts: a random head, then a random segment repeated up to the end, so the
    prompt's last tokens occurred before and the n-gram proposer drafts from the start."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        length = rng.randint(min_len, max_len)
        head = [rng.randrange(10, vocab_size) for _ in range(length // 4)]
        segment = [
            rng.randrange(10, vocab_size) for _ in range(rng.randint(4, max(4, (length - len(head)) // 3)))
        ]
        prompts.append(head + (segment * (length // len(segment) + 1))[: length - len(head)])
    return prompts


def prompts_digest(prompts: list[list[int]]) -> str:
    """blake2b of the prompts' token ids: a --reference file must come from the same prompts."""
    digest = hashlib.blake2b(digest_size=16)
    for prompt in prompts:
        digest.update(len(prompt).to_bytes(4, "little"))
        digest.update(b"".join(t.to_bytes(4, "little") for t in prompt))
    return digest.hexdigest()


def kv_bytes_per_token(config) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2  # bf16


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Runner:
    """One engine and the runs made with it."""

    def __init__(self, config, prompts, args, *, deterministic: bool, disk_path: Path | None) -> None:
        """`disk_path` None: offload off; else a CPU tier over a disk tier there (the
        disk-tier runs empty the CPU tier first, so their hits come from disk)."""
        self.prompts = prompts
        self.args = args
        self.device = "cpu" if args.tiny else "cuda"
        tokens = [len(p) + args.new_tokens + args.num_speculative_tokens + 1 for p in prompts]
        num_blocks = sum(-(-n // 16) for n in tokens) + 64
        chunk_slots = sum(-(-len(p) // CHUNK_SIZE) + 1 for p in prompts)
        tier_bytes = chunk_slots * CHUNK_SIZE * kv_bytes_per_token(config)
        offload = None
        if disk_path is not None:
            # load_policy "always": every hit is loaded (the planner would recompute a prefix
            # whenever that is faster than reading the disk, and the disk runs would test less)
            offload = OffloadConfig(
                chunk_size=CHUNK_SIZE,
                cpu_bytes=tier_bytes,
                disk_path=str(disk_path),
                disk_bytes=2 * tier_bytes,
                load_policy="always",
            )
        started = time.perf_counter()
        self.llm = LLM(
            config,
            load_format="dummy",
            device=self.device,
            dtype="bfloat16",
            deterministic=deterministic,
            kv_offload=offload,
            num_gpu_blocks=num_blocks,
            max_num_seqs=len(prompts),
            max_num_batched_tokens=max(args.budgets),
            max_model_len=max(tokens) + 16,
        )
        self.startup_s = time.perf_counter() - started
        self.ngram = NgramProposer(args.num_speculative_tokens, 2, 4)
        #: set by main from the reference run: drafts that verification always has to check
        self.replay: ReplayProposer | None = None
        self.params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        # warm-up beyond the engine's own: a short batch through plain and speculative steps
        for proposer in (None, self.ngram):
            self.llm.engine.scheduler.proposer = proposer
            self.llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        self.tiers = None
        if offload is not None:  # the seed run stores every prompt in both tiers
            self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            self.llm.flush_kv_offload()
            self.tiers = self.llm.engine.offload_cache_engine.tiers

    def _empty_cpu_tier(self) -> None:
        """Drop every chunk of the CPU tier (the disk tier keeps its copies)."""
        cpu = self.tiers.cpu
        for key in cpu.keys(""):
            cpu.delete(key)
        if cpu.keys(""):
            raise RuntimeError("the CPU tier kept chunks: the disk-tier run would not read from disk")

    def run(self, source: str, budget: int, all_at_once: bool, speculative: str) -> dict:
        """One run; `speculative`: "off", "ngram" or "replay" (self.replay's drafts)."""
        llm, scheduler = self.llm, self.llm.engine.scheduler
        if (source == "offload off") != (self.tiers is None):
            raise ValueError(f"this engine cannot run source {source!r}")
        scheduler.max_num_batched_tokens = budget
        scheduler.proposer = {"off": None, "ngram": self.ngram, "replay": self.replay}[speculative]
        if speculative != "off" and scheduler.proposer is None:
            raise ValueError(f"no {speculative} proposer set")
        llm.reset_prefix_cache()  # prefixes come from recompute or the tier, never the GPU cache
        if source == "disk-tier hit":
            llm.flush_kv_offload()  # promotions of an earlier run are written through first
            self._empty_cpu_tier()
        counters_before = self.tiers.counters() if self.tiers is not None else {}
        drafts_before = llm.stats.spec_decode.num_draft_tokens
        prompts = self.prompts if all_at_once else self.prompts[: self.args.num_alone]
        synchronize(self.device)
        started = time.perf_counter()
        if all_at_once:
            outputs = llm.generate(prompts, self.params)
        else:
            outputs = [llm.generate([p], self.params)[0] for p in prompts]
        synchronize(self.device)
        seconds = time.perf_counter() - started
        generated = sum(len(o.token_ids) for o in outputs)
        counters_after = self.tiers.counters() if self.tiers is not None else {}
        tier_hits = {
            name: counters_after[name] - counters_before.get(name, 0)
            for name in counters_after
            if name.startswith("hits_") and counters_after[name] != counters_before.get(name, 0)
        }
        return {
            "source": source,
            "tier_chunk_hits": tier_hits,
            "num_draft_tokens": llm.stats.spec_decode.num_draft_tokens - drafts_before,
            "max_num_batched_tokens": budget,
            "at_once": len(prompts) if all_at_once else 1,
            "speculative": speculative,
            "num_requests": len(prompts),
            "token_ids": [o.token_ids for o in outputs],
            "external_hit_tokens": sum(o.metrics.num_external_cached_tokens for o in outputs),
            "seconds": seconds,
            "generated_tokens_per_s": generated / seconds,
            "total_tokens_per_s": (generated + sum(len(p) for p in prompts)) / seconds,
        }

    def close(self) -> None:
        del self.llm
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def time_gemms(num_repeats: int = 20) -> list[dict]:
    """Batch-invariant GEMM (the tiles kernels.matmul picks now) vs cuBLAS (bf16) on the 8B's
    projection shapes, decode and prefill rows."""
    from kernels.matmul import linear

    rows = []
    for name, k, n in (
        ("qkv", 4096, 6144),
        ("o_proj", 4096, 4096),
        ("gate_up", 4096, 28672),
        ("down", 14336, 4096),
    ):
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (64, 512, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"layer": name, "m": m, "k": k, "n": n}
            for label, fn in (("cublas", torch.nn.functional.linear), ("batch_invariant", linear)):
                fn(x, weight)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(num_repeats):
                    fn(x, weight)
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1e3 / num_repeats
                row[f"{label}_tflops"] = 2 * m * k * n / seconds / 1e12
            row["ratio"] = row["batch_invariant_tflops"] / row["cublas_tflops"]
            rows.append(row)
        del weight
    return rows


def replay_of(reference_tokens: list[list[int]], prompts, args, vocab_size: int) -> ReplayProposer:
    """Drafts that replay the reference run's tokens with 30% of them corrupted: every
    step verifies drafts, some accepted, some rejected (n-gram drafts need repeats that a
    random-weight model rarely produces)."""
    continuations = {tuple(p): t for p, t in zip(prompts, reference_tokens, strict=True)}
    return ReplayProposer(args.num_speculative_tokens, continuations, vocab_size, corrupt_fraction=0.3)


def num_differing(run: dict, reference: list[list[int]]) -> int:
    return sum(tokens != ref for tokens, ref in zip(run["token_ids"], reference, strict=False))


def print_cost(report: dict, runs: list[dict], default_runs: list[dict], startup_s: dict, args) -> None:
    """The deterministic / default throughput ratios (all at once, each budget) and what the
    default mode changes; adds them to `report`."""
    reference = runs[0]  # deterministic, offload off, the big budget, all at once, no speculation
    if reference["source"] != "offload off" or reference["speculative"] != "off":
        raise RuntimeError("the first run must be the reference (offload off, no speculation)")
    default_reference = default_runs[0]
    for r in default_runs[1:]:
        r["num_differing_vs_default_reference"] = num_differing(r, default_reference["token_ids"])
    ratio_total = reference["total_tokens_per_s"] / default_reference["total_tokens_per_s"]
    ratio_generated = reference["generated_tokens_per_s"] / default_reference["generated_tokens_per_s"]
    small_budget = args.budgets[1]
    deterministic_small = next(
        r
        for r in runs
        if r["source"] == "offload off"
        and r["max_num_batched_tokens"] == small_budget
        and r["at_once"] > 1
        and r["speculative"] == "off"
    )
    ratio_small = deterministic_small["total_tokens_per_s"] / default_runs[1]["total_tokens_per_s"]
    print(
        "default mode, same prompts: "
        f"{default_runs[1]['num_differing_vs_default_reference']} of {args.num_requests} requests change at "
        f"budget {small_budget}, "
        f"{default_runs[2]['num_differing_vs_default_reference']} of {args.num_alone} when run one at a time"
    )
    print(
        f"throughput (all at once, budget {args.budgets[0]}, offload off): deterministic "
        f"{reference['total_tokens_per_s']:.0f} tok/s, default {default_reference['total_tokens_per_s']:.0f} tok/s, "
        f"ratio {ratio_total:.2f} (target >= 0.8; generated tokens/s ratio {ratio_generated:.2f}); "
        f"at budget {small_budget}: ratio {ratio_small:.2f}"
    )
    print("engine start-up s: " + ", ".join(f"{k} {v:.1f}" for k, v in startup_s.items()))
    report.update(
        throughput_ratio_total=ratio_total,
        throughput_ratio_generated=ratio_generated,
        throughput_ratio_total_small_budget=ratio_small,
        default_mode_differing_at_small_budget=default_runs[1]["num_differing_vs_default_reference"],
        default_mode_differing_one_at_a_time=default_runs[2]["num_differing_vs_default_reference"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke run)")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="requests of the 'all at once' runs (64)"
    )
    parser.add_argument("--num-alone", type=int, default=None, help="requests of the '1 at once' runs (4)")
    parser.add_argument("--min-prompt", type=int, default=None)
    parser.add_argument("--max-prompt", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--budgets",
        type=int,
        nargs=2,
        default=None,
        help="max_num_batched_tokens of the reference runs and of the chunked runs (8192 512; 8192 24 with --tiny)",
    )
    parser.add_argument(
        "--issue-size",
        action="store_true",
        help="the issue's workload: --min-prompt 1024 --max-prompt 4096 --new-tokens 128 (unless given)",
    )
    parser.add_argument(
        "--sources",
        nargs="+",
        choices=sorted(SOURCE_NAMES),
        default=sorted(SOURCE_NAMES),
        help="KV sources of the matrix to run (off: the reference, the default-mode cost; cpu, disk: tier hits)",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="a JSON of an earlier run with --sources off, same prompts: its reference tokens (needed without 'off')",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tiny = args.tiny
    if args.issue_size:
        args.min_prompt = args.min_prompt or 1024
        args.max_prompt = args.max_prompt or 4096
        args.new_tokens = args.new_tokens or 128
    args.num_requests = args.num_requests or (6 if tiny else 64)
    args.num_alone = min(args.num_alone or (2 if tiny else 4), args.num_requests)
    args.min_prompt = args.min_prompt or (40 if tiny else 256)
    args.max_prompt = args.max_prompt or (120 if tiny else 768)
    args.new_tokens = args.new_tokens or (8 if tiny else 32)
    args.budgets = args.budgets or ([8192, 24] if tiny else [8192, 512])
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("need 1 <= --min-prompt <= --max-prompt")
    if not tiny and not torch.cuda.is_available():
        parser.error("needs CUDA (or --tiny)")
    sources = tuple(source for name, source in SOURCE_NAMES.items() if name in args.sources)
    run_reference = SOURCES[0] in sources
    if not run_reference and args.reference is None:
        parser.error("without --sources off, --reference must name the JSON of a run that had it")

    config = model_config(tiny)
    if args.issue_size:  # 4096-token prompts + drafts + new tokens: more than model_config's 4k context
        config.max_position_embeddings = max(
            config.max_position_embeddings, args.max_prompt + args.new_tokens + 64
        )
    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, config.vocab_size)
    digest = prompts_digest(prompts)
    reference_tokens: list[list[int]] | None = None
    if args.reference is not None:
        earlier = json.loads(args.reference.read_text())
        if earlier.get("prompts_digest") != digest or "reference_token_ids" not in earlier:
            parser.error(
                f"{args.reference} holds no reference tokens for these prompts (other sizes or seed?)"
            )
        reference_tokens = earlier["reference_token_ids"]
    device_name = torch.cuda.get_device_name() if not tiny else platform.processor() or "cpu"
    report: dict = {
        "benchmark": "deterministic",
        "device": device_name,
        "model": "tiny-llama" if tiny else "llama-3.1-8b-shaped (random weights)",
        "dtype": "bfloat16",
        "num_requests": args.num_requests,
        "num_alone": args.num_alone,
        "prompt_len_range": [args.min_prompt, args.max_prompt],
        "new_tokens": args.new_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "budgets": args.budgets,
        "sources": list(sources),
        "prompts_digest": digest,
        "complete": False,
        "torch": torch.__version__,
    }
    runs: list[dict] = []
    default_runs: list[dict] = []
    startup_s: dict[str, float] = {}

    def save() -> None:
        """Write what is measured so far (a failure later leaves the earlier figures)."""
        report["runs"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]
        report["default_runs"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in default_runs]
        report["startup_s"] = startup_s
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    disk_root = Path(tempfile.mkdtemp(prefix="kvstash-deterministic-"))

    def set_reference(run: dict) -> None:
        nonlocal reference_tokens
        reference_tokens = run["token_ids"]
        report["reference_token_ids"] = reference_tokens

    def run_matrix(runner: Runner, sources: tuple[str, ...]) -> None:
        for source in sources:
            for budget in args.budgets:
                for all_at_once in (True, False):
                    for speculative in ("off", "ngram", "replay") if all_at_once else ("off", "ngram"):
                        r = {"mode": "deterministic", **runner.run(source, budget, all_at_once, speculative)}
                        if reference_tokens is None:  # the first run is the reference
                            set_reference(r)
                            runner.replay = replay_of(reference_tokens, prompts, args, config.vocab_size)
                        r["num_differing"] = num_differing(r, reference_tokens)
                        runs.append(r)
                        save()
                        print(
                            f"deterministic {source:>13} budget {budget:>5} at once {r['at_once']:>3} "
                            f"spec {r['speculative']:>6}: {r['seconds']:.2f} s, differing {r['num_differing']}, "
                            f"drafts {r['num_draft_tokens']}, tier chunk hits {r['tier_chunk_hits']}",
                            flush=True,
                        )

    try:
        if run_reference:
            # 1. the deterministic engine without offload (its first run is the reference)
            runner = Runner(config, prompts, args, deterministic=True, disk_path=None)
            startup_s["deterministic, offload off"] = runner.startup_s
            run_matrix(runner, SOURCES[:1])
            runner.close()
            # 2. the default engine on the same workload: the cost, printed at once
            default = Runner(config, prompts, args, deterministic=False, disk_path=None)
            startup_s["default, offload off"] = default.startup_s
            big, small = args.budgets
            for budget, all_at_once in ((big, True), (small, True), (big, False)):
                default_runs.append(default.run("offload off", budget, all_at_once, "off"))
                save()
            default.close()
            ratio = runs[0]["total_tokens_per_s"] / default_runs[0]["total_tokens_per_s"]
            report["throughput_ratio_total"] = ratio
            save()
            print(f"throughput deterministic / default: {ratio:.2f} (target >= 0.8)", flush=True)
        tier_sources = tuple(source for source in sources if source != SOURCES[0])
        if tier_sources:
            # 3. the deterministic engine with a CPU tier over a disk tier
            runner = Runner(config, prompts, args, deterministic=True, disk_path=disk_root)
            runner.replay = replay_of(reference_tokens, prompts, args, config.vocab_size)
            startup_s["deterministic, CPU + disk tiers"] = runner.startup_s
            run_matrix(runner, tier_sources)
            runner.close()
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)

    print(
        f"\ndeterministic mode — {device_name}, {'tiny llama' if tiny else 'Llama-3.1-8B shape'} bf16, "
        f"{args.num_requests} requests of {args.min_prompt}-{args.max_prompt} tokens, {args.new_tokens} new tokens"
        + ("" if run_reference else f" (reference tokens from {args.reference})")
    )
    print(
        f"{'source':>13} {'budget':>6} {'at once':>7} {'spec':>6} {'reqs':>4} {'differ':>6} {'ext hit':>9} {'s':>7}"
    )
    for r in runs:
        print(
            f"{r['source']:>13} {r['max_num_batched_tokens']:>6} {r['at_once']:>7} {r['speculative']:>6} "
            f"{r['num_requests']:>4} {r['num_differing']:>6} {r['external_hit_tokens']:>9} {r['seconds']:>7.2f}"
        )
    total_differing = sum(r["num_differing"] for r in runs)
    print(f"differing requests over the {len(runs)} runs: {total_differing} (target 0)")
    report.update(total_differing_requests=total_differing)
    if run_reference:
        print_cost(report, runs, default_runs, startup_s, args)
    save()
    gemms = [] if tiny or not run_reference else time_gemms()
    if gemms:
        print(f"{'GEMM':>8} {'M':>5} {'cuBLAS TFLOP/s':>15} {'invariant TFLOP/s':>18} {'ratio':>6}")
        for g in gemms:
            print(
                f"{g['layer']:>8} {g['m']:>5} {g['cublas_tflops']:>15.0f} "
                f"{g['batch_invariant_tflops']:>18.0f} {g['ratio']:>6.2f}"
            )
    report.update(gemms=gemms, complete=True)
    save()
    if args.out:
        print(f"wrote {args.out}")
    if total_differing:
        raise SystemExit(f"{total_differing} requests differ across the deterministic matrix")


if __name__ == "__main__":
    main()
