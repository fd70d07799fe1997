"""First-request and new-length penalties (issue 19): what a user sees right after
start-up and with prompt lengths the engine has never served.

Each mode runs in a fresh process with an empty Triton cache, so "first" really is
the first request after start (nothing compiled on disk from an earlier run):

- start-up: seconds from process start to a ready engine (warm-up included);
- first vs later: a long prompt arriving while another request decodes, its TTFT and
  the decode's longest gap between tokens, the first time and again in the same
  engine; then a lone long prompt the first time and again;
- new vs seen length: per length L, the TTFT of a fresh prompt of length L served
  right after another prompt of length L (seen) and of a fresh prompt of length
  L + 1 (never seen); medians over ``--repeats`` rounds at shifted lengths.

Modes: ``--warmup on`` (the default engine) and ``--warmup off`` (the engine before
issue 19), side by side in one table. Targets: first ≤ 1.2x later, new length ≤
1.05x seen, with warm-up on.

    python benchmarks/warmup.py --out warmup.json                 # GPU, Llama-3.1-8B shape, bf16
    python benchmarks/warmup.py --tiny --out /tmp/warmup.json     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

LENGTHS = (1500, 3000, 5000, 7000, 16000)
TINY_LENGTHS = (150, 300)


def _child(args: argparse.Namespace) -> dict:
    """One mode in this (fresh) process; returns its figures."""
    started = time.perf_counter()
    import torch

    from benchmarks.engine_throughput import llama_config
    from engine import EngineArgs, EngineCore, SamplingParams

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    lengths = TINY_LENGTHS if args.tiny else LENGTHS
    long_len = max(lengths)
    config = llama_config(args.tiny)
    engine = EngineCore(
        config,
        EngineArgs(
            dtype="bfloat16" if device == "cuda" else "float32",
            device=device,
            load_format="dummy",
            max_model_len=long_len + 64,
            warmup=args.warmup == "on",
            num_gpu_blocks=None if device == "cuda" else 256,
        ),
    )
    startup_s = time.perf_counter() - started
    vocab = config.vocab_size
    generator = torch.Generator().manual_seed(1234)

    def prompt(length: int) -> list[int]:
        return torch.randint(10, vocab, (length,), generator=generator).tolist()

    ids = iter(range(1 << 30))
    first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(requests: list[tuple[list[int], SamplingParams]]) -> dict[str, dict]:
        """Run to completion; per request: ttft_s and the largest gap between its tokens."""
        names = []
        for tokens, params in requests:
            names.append(f"q{next(ids)}")
            engine.add_request(names[-1], tokens, params)
        last_seen: dict[str, float] = {}
        gaps: dict[str, float] = {name: 0.0 for name in names}
        ttft: dict[str, float] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                now = time.perf_counter()
                if output.request_id in last_seen:
                    gaps[output.request_id] = max(gaps[output.request_id], now - last_seen[output.request_id])
                last_seen[output.request_id] = now
                if output.metrics.ttft_s is not None:
                    ttft.setdefault(output.request_id, output.metrics.ttft_s)
        return {name: {"ttft_s": ttft.get(name), "max_gap_s": gaps[name]} for name in names}

    def lone(length: int) -> float:
        (figures,) = run([(prompt(length), first_token)]).values()
        return figures["ttft_s"]

    def scenario() -> dict:
        """A long prompt arriving while another request decodes: its TTFT and the
        decoder's longest gap between steps (every step yields one of its tokens)."""
        decode = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        engine.add_request("decoder", prompt(64), decode)
        times = []
        while len(times) < 6:  # decoding steadily
            engine.step()
            times.append(time.perf_counter())
        engine.add_request("long", prompt(long_len), first_token)
        ttft = None
        last = time.perf_counter()
        gap = 0.0
        steps = []  # (ms, tokens computed) of each step until the long prompt's first token
        while engine.has_unfinished_requests():
            computed = engine.stats.num_computed_tokens_total
            for output in engine.step():
                if output.request_id == "long" and output.metrics.ttft_s is not None:
                    ttft = output.metrics.ttft_s
            now = time.perf_counter()
            if ttft is None or len(steps) < 4:
                steps.append(
                    (round((now - last) * 1e3, 1), engine.stats.num_computed_tokens_total - computed)
                )
            gap, last = max(gap, now - last), now
        return {"ttft_s": ttft, "decode_max_gap_s": gap, "steps": steps}

    first = scenario()
    later = scenario()
    lone_first = lone(long_len)
    lone_later = lone(long_len)
    per_length = {}
    for length in lengths:
        seen, new = [], []
        for repeat in range(args.repeats):
            base = length + 7 * repeat * 3  # a length no earlier round used, nor its +1
            lone(base)  # now seen
            seen.append(lone(base))
            new.append(lone(base + 1))
        per_length[length] = {
            "seen_ttft_s": statistics.median(seen),
            "new_ttft_s": statistics.median(new),
            "ratio": statistics.median(new) / statistics.median(seen),
        }
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "startup_s": startup_s,
        "first": first,
        "later": later,
        "first_over_later": first["ttft_s"] / later["ttft_s"],
        "lone_first_ttft_s": lone_first,
        "lone_later_ttft_s": lone_later,
        "lone_first_over_later": lone_first / lone_later,
        "per_length": per_length,
    }


def _run_mode(mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as triton_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, __file__, "--child", "--warmup", mode, "--repeats", str(args.repeats)]
        if args.tiny:
            command.append("--tiny")
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"mode {mode} failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="on,off", help="warm-up modes to run: on, off or both")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", default="on", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return
    results = {mode: _run_mode(mode, args) for mode in args.modes.split(",")}
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"warm-up and new lengths ({next(iter(results.values()))['device']})")
    table.add_column("figure")
    for mode in results:
        table.add_column(f"warm-up {mode}", justify="right")
    rows = [
        ("start-up s", lambda r: f"{r['startup_s']:.1f}"),
        ("long prompt while decoding: first TTFT ms", lambda r: f"{r['first']['ttft_s'] * 1e3:.0f}"),
        ("  later TTFT ms", lambda r: f"{r['later']['ttft_s'] * 1e3:.0f}"),
        ("  first / later (target <= 1.2)", lambda r: f"{r['first_over_later']:.2f}"),
        (
            "  decode's longest gap, first / later ms",
            lambda r: "{:.0f} / {:.0f}".format(
                r["first"]["decode_max_gap_s"] * 1e3, r["later"]["decode_max_gap_s"] * 1e3
            ),
        ),
        ("lone long prompt first / later", lambda r: f"{r['lone_first_over_later']:.2f}"),
    ]
    for length in next(iter(results.values()))["per_length"]:
        rows.append(
            (
                f"{length} tokens: new / seen TTFT (target <= 1.05)",
                lambda r, length=length: "{:.2f} ({:.0f} / {:.0f} ms)".format(
                    r["per_length"][length]["ratio"],
                    r["per_length"][length]["new_ttft_s"] * 1e3,
                    r["per_length"][length]["seen_ttft_s"] * 1e3,
                ),
            )
        )
    for name, cell in rows:
        table.add_row(name, *(cell(result) for result in results.values()))
    Console().print(table)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
