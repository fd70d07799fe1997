"""Soak: `kvstash serve` with CPU, disk and cache-server tiers under a steady mixed load
for ``--duration`` seconds, sampled over time, then checked for leaks, errors and
output drift (issue 35, item 5).

What runs, all real processes on free loopback ports:

- ``kvstash cache-server`` (``python -m cache_server``, the same command without the
  engine's CLI), memory only, capped at ``--cache-server-mib``;
- ``kvstash serve MODEL --kv-offload`` with a CPU tier (``--cpu-mib``), a disk tier in a
  fresh folder (``--disk-mib``) and the cache server as its remote tier, a small KV pool
  (``--num-gpu-blocks``) so that conversations fall out of the engine's prefix cache and
  come back from the tiers;
- ``--users`` concurrent users (at most ``--concurrency`` requests in flight): each holds a
  conversation, long (``--long-tokens`` of context) or short (``--short-tokens``), and
  each turn sends the whole conversation so far plus a new question (token ids over
  ``/v1/completions``), so later turns hit the tiers. A ``--stream-share`` of requests
  stream; a ``--abort-share`` of those are dropped by the client after a few events
  (the connection closes mid-stream). After ``--turns`` turns a user starts a new
  conversation;
- at ``--restart-at`` seconds the cache server gets SIGTERM, stays down
  ``--restart-down-s`` seconds and starts again on the same port (empty: memory only).
  A first restart of the same kind happens during the warm-up (``--warmup-restart-at``,
  a quarter of it by default; ``--no-warmup-restart``): an outage makes the engine's
  thread pools grow to their caps (calls wait for a dead server), once, and the figures
  after warm-up then tell whether the measured restart leaves anything behind.
  Request errors are counted apart for the restart windows (SIGTERM until the server
  is back plus ``--restart-grace-s``) and for the rest of the run;
- every ``--sample-interval`` seconds: the serve process's RSS, threads and open files
  (its children included), its GPU memory (``nvidia-smi``, when present), the disk
  tier's bytes on disk against its cap, the cache server's RSS, and ``/metrics``
  counters;
- at the end ``--greedy-prompts`` conversations seen during the soak are sent again
  greedily (temperature 0, ``--greedy-max-tokens`` tokens, one at a time) to the soaked
  server and to a fresh ``kvstash serve`` without offload (same model and engine flags);
  their texts and token counts must be identical.

It prints a table (figures after ``--warmup`` seconds), writes ``soak.json`` (every
sample, every error, the summary), ``soak.png`` (RSS, threads, open files, disk bytes,
GPU memory over time) and the processes' logs into ``--out``. With ``--check`` it exits
1 when a target fails: RSS, GPU memory, threads and open files after warm-up within
``--tolerance-pct`` (5) of the first sample after warm-up, serve's files towards the
cache server within its pool's bound, the disk tier within its cap, no request error
outside the restart window, no engine step error, no tier error outside the restart
window, the engine served after the restart, no differing output.

    python benchmarks/soak.py --duration 120 --out soak-out --check           # CPU: bench-size model
    python benchmarks/soak.py --duration 60 --model-size tiny --out /tmp/s --check   # the CI smoke run
    python benchmarks/soak.py --duration 600 --model-size 8b --out soak-h100 --check  # GPU (8B shape)
    python benchmarks/soak.py --model /path/to/checkpoint --duration 600 --out soak-out

``--model-size 8b`` writes a folder with the Llama-3.1-8B config and a tokenizer that
covers its vocabulary and serves it with ``--load-format dummy`` (random weights made on
the device; nothing is downloaded).

Its parts are in ``benchmarks/support/``: ``soak_children.py`` (the processes),
``soak_load.py`` (the users and the greedy requests), ``soak_sampler.py`` (the samples),
``soak_summary.py`` (the figures and the checks) and ``soak_report.py`` (table and plot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.support.model_folders import kv_bytes_per_token, make_8b_folder  # noqa: E402
from benchmarks.support.soak_children import Child, start_cache_server, start_serve  # noqa: E402
from benchmarks.support.soak_load import Load, greedy_outputs  # noqa: E402
from benchmarks.support.soak_report import plot, print_table  # noqa: E402
from benchmarks.support.soak_sampler import Sampler  # noqa: E402
from benchmarks.support.soak_summary import summarize  # noqa: E402

MIB = 1 << 20


# ---- the soak ---------------------------------------------------------------------------------
class Soak:
    def __init__(self, args: argparse.Namespace, model: str, serve_flags: list[str], vocab_size: int) -> None:
        self.args, self.model, self.serve_flags, self.vocab_size = args, model, serve_flags, vocab_size
        self.out = Path(args.out)
        self.work = Path(tempfile.mkdtemp(prefix="kvstash-soak-"))
        self.disk_dir = self.work / "disk-tier"
        self.disk_dir.mkdir()
        self.t0 = time.monotonic()
        self.serve: Child | None = None
        self.cache_server: Child | None = None
        #: the measured restart (at --restart-at) and the one during the warm-up
        self.restart: dict = {}
        self.warmup_restart: dict = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.serve.port}"

    def offload_flags(self) -> list[str]:
        args = self.args
        return [
            "--kv-offload",
            "--kv-offload-cpu-gb", f"{args.cpu_mib / 1024:.6f}",
            "--kv-offload-disk-path", str(self.disk_dir),
            "--kv-offload-disk-gb", f"{args.disk_mib / 1024:.6f}",
            "--kv-offload-remote", f"grpc://127.0.0.1:{self.cache_server.port}",
            "--kv-offload-chunk-size", str(args.chunk_size),
        ]  # fmt: skip

    def restart_cache_server(self, load: Load) -> None:
        """During the warm-up (at --warmup-restart-at, unless --no-warmup-restart) and at
        --restart-at: SIGTERM the cache server, wait, start it on the same port. The first
        restart lets every pool and connection of the engine reach the size an outage gives
        it (a pool grows to its cap while calls wait for a dead server) before the figures are
        taken; the measured one then shows whether a restart leaves anything behind."""
        args = self.args
        if args.no_restart:
            return
        if args.warmup_restart:
            self.warmup_restart.update(self._restart_at(args.warmup_restart_at))
        self.restart.update(self._restart_at(args.restart_at))

    def _restart_at(self, at_s: float) -> dict:
        args = self.args
        delay = self.t0 + at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        port = self.cache_server.port
        restart = {"sigterm_t_s": round(time.monotonic() - self.t0, 2)}
        restart["exit_code"] = self.cache_server.stop(timeout_s=30)
        restart["down_t_s"] = round(time.monotonic() - self.t0, 2)
        time.sleep(args.restart_down_s)
        self.cache_server = start_cache_server(port, args.cache_server_mib, self.out / "cache_server.log")
        restart["back_t_s"] = round(time.monotonic() - self.t0, 2)
        restart["port"] = port
        restart["window_end_t_s"] = round(restart["back_t_s"] + args.restart_grace_s, 2)
        return restart

    def run(self) -> dict:
        args = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("serve.log", "cache_server.log", "reference.log"):
            (self.out / name).unlink(missing_ok=True)
        try:
            print(f"starting the cache server and kvstash serve ({self.model}) ...", flush=True)
            self.cache_server = start_cache_server(0, args.cache_server_mib, self.out / "cache_server.log")
            self.serve = start_serve(
                self.model, self.serve_flags + self.offload_flags(), self.out / "serve.log", "kvstash serve"
            )
            print(f"serving on {self.url}; soaking for {args.duration:g} s", flush=True)
            self.t0 = time.monotonic()
            load = Load(args, self.url, self.vocab_size, self.t0)
            self.load = load
            sampler = Sampler(self, args.sample_interval)
            sampler.start()
            restarter_error: list[BaseException] = []

            def restarter() -> None:
                try:
                    self.restart_cache_server(load)
                except BaseException as error:  # noqa: BLE001 - reported in the summary
                    restarter_error.append(error)

            restart_thread = threading.Thread(target=restarter, name="soak-restart", daemon=True)
            restart_thread.start()
            asyncio.run(load.run())
            load_end_t = time.monotonic() - self.t0
            restart_thread.join()
            time.sleep(1.0)  # the server notices a dropped stream within half a second
            sampler.stop()
            if restarter_error:
                self.restart["error"] = f"{type(restarter_error[0]).__name__}: {restarter_error[0]}"
            prompts = self.greedy_prompts(load)
            print(
                f"load done at {load_end_t:.1f} s; {len(prompts)} greedy prompts to the soaked server ...",
                flush=True,
            )
            soaked = greedy_outputs(self.url, prompts, args.greedy_max_tokens)
            serve_exit = self.serve.stop(timeout_s=120)
            clean = (
                serve_exit in (0, -signal.SIGTERM) and "Application shutdown complete" in self.serve.output()
            )
            self.serve = None
            print("a fresh kvstash serve without offload for the reference outputs ...", flush=True)
            reference_server = start_serve(
                self.model, self.serve_flags, self.out / "reference.log", "reference serve"
            )
            try:
                reference = greedy_outputs(
                    f"http://127.0.0.1:{reference_server.port}", prompts, args.greedy_max_tokens
                )
            finally:
                reference_server.stop(timeout_s=120)
            return self.report(load, sampler, load_end_t, prompts, soaked, reference, clean)
        finally:
            for child in (self.serve, self.cache_server):
                if child is not None:
                    child.stop(timeout_s=30)
            shutil.rmtree(self.work, ignore_errors=True)

    def greedy_prompts(self, load: Load) -> list[list[int]]:
        """The last turns of the newest conversations (their KV is in the tiers), long and
        short alike, most recent first."""
        conversations = list(load.conversations.values())[::-1]
        return conversations[: self.args.greedy_prompts]

    def report(self, load, sampler, load_end_t, prompts, soaked, reference, clean_shutdown) -> dict:
        summary = summarize(
            self.args,
            self.restart,
            self.warmup_restart,
            load,
            sampler,
            load_end_t,
            prompts,
            soaked,
            reference,
            clean_shutdown,
        )
        return {
            "args": vars(self.args),
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "commit": git_commit(),
            "samples": sampler.samples,
            "requests": load.records,
            "summary": summary,
        }


def git_commit() -> str | None:
    try:
        return subprocess.run(
            # "-dirty" when the files differ from the commit (a copied work tree, local edits)
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None


# ---- model and arguments -------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    add(
        "--warmup",
        type=float,
        default=None,
        help="seconds before the steady figures are taken (default: 20%% of --duration)",
    )
    add("--out", required=True, help="folder for soak.json, soak.png and the processes' logs")
    add("--check", action="store_true", help="exit 1 when a target fails")
    add("--tolerance-pct", type=float, default=5.0, help="allowed deviation after warm-up (default 5)")
    add("--model", default=None, help="a model folder to serve instead of a generated one")
    add("--model-size", choices=("tiny", "bench", "8b"), default=None,
        help="generated model: tiny (~0.2M), bench (~25M; default on CPU) or 8b (Llama-3.1-8B shape, random "
        "weights made on the device with --load-format dummy; default on CUDA)")  # fmt: skip
    add("--device", default="auto", help="serve's --device (default auto)")
    add(
        "--dtype",
        default="float32",
        help="serve's --dtype (default float32: greedy outputs exact with or without offload)",
    )
    add(
        "--serve-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more flag for both serve processes (repeat)",
    )
    add("--users", type=int, default=6)
    add("--concurrency", type=int, default=None, help="most requests in flight (default: --users)")
    add("--long-share", type=float, default=0.5, help="share of conversations with a long context")
    add("--long-tokens", type=int, default=None, help="long context (default 1024; 8192 with 8b)")
    add("--short-tokens", type=int, default=192)
    add("--question-tokens", type=int, default=24)
    add("--answer-tokens", type=int, default=16)
    add("--turns", type=int, default=4, help="turns per conversation before a user starts a new one")
    add("--stream-share", type=float, default=0.5)
    add("--abort-share", type=float, default=0.3, help="share of streamed requests dropped mid-stream")
    add("--restart-at", type=float, default=None, help="seconds into the load (default: half of --duration)")
    add("--restart-down-s", type=float, default=3.0)
    add(
        "--no-restart",
        action="store_true",
        help="keep the cache server up (to tell what the restart changes)",
    )
    add("--restart-grace-s", type=float, default=10.0, help="seconds after the restart still in its window")
    add(
        "--warmup-restart-at",
        type=float,
        default=None,
        help="seconds into the load of a first restart, inside the warm-up (default: a quarter of --warmup)",
    )
    add(
        "--no-warmup-restart",
        dest="warmup_restart",
        action="store_false",
        help="restart only once, at --restart-at (the engine's pools then grow to their outage size there)",
    )
    add(
        "--sample-interval",
        type=float,
        default=None,
        help="seconds between samples (default: duration/60, 1 to 5)",
    )
    add("--greedy-prompts", type=int, default=8)
    add("--greedy-max-tokens", type=int, default=16)
    add("--chunk-size", type=int, default=256)
    add("--num-gpu-blocks", type=int, default=None, help="engine KV pool (default: 3 long conversations)")
    add("--cpu-mib", type=float, default=None, help="CPU tier (default: half the users' KV)")
    add("--disk-mib", type=float, default=None, help="disk tier cap (default: the users' KV)")
    add(
        "--cache-server-mib",
        type=float,
        default=None,
        help="cache server memory (default: twice the users' KV)",
    )
    add("--request-timeout-s", type=float, default=300.0)
    add(
        "--max-requests",
        type=int,
        default=1_000_000,
        help="stop after this many requests even before --duration",
    )
    add("--seed", type=int, default=0)
    return parser


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Defaults that depend on others; every bad value is a parser error (exit 2)."""
    if not math.isfinite(args.duration) or args.duration <= 0:
        parser.error(f"--duration must be a positive number of seconds, got {args.duration:g}")
    args.warmup = 0.2 * args.duration if args.warmup is None else args.warmup
    if not 0 <= args.warmup < args.duration:
        parser.error(f"--warmup must be in [0, --duration={args.duration:g}), got {args.warmup:g}")
    args.restart_at = 0.5 * args.duration if args.restart_at is None else args.restart_at
    if not 0 < args.restart_at < args.duration:
        parser.error(f"--restart-at must be inside the load (0, {args.duration:g}), got {args.restart_at:g}")
    args.warmup_restart_at = 0.25 * args.warmup if args.warmup_restart_at is None else args.warmup_restart_at
    if args.warmup_restart and not 0 < args.warmup_restart_at < args.restart_at:
        parser.error(
            f"--warmup-restart-at must be in (0, --restart-at={args.restart_at:g}), got {args.warmup_restart_at:g}"
        )
    if args.sample_interval is None:
        args.sample_interval = min(5.0, max(1.0, args.duration / 60))
    if args.sample_interval <= 0:
        parser.error(f"--sample-interval must be positive, got {args.sample_interval:g}")
    for name in ("long_share", "stream_share", "abort_share"):
        if not 0 <= getattr(args, name) <= 1:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name):g}")
    args.concurrency = args.users if args.concurrency is None else args.concurrency
    for name in ("users", "concurrency", "short_tokens", "question_tokens", "answer_tokens", "turns",
                 "greedy_prompts", "greedy_max_tokens", "chunk_size", "max_requests"):  # fmt: skip
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("restart_down_s", "restart_grace_s", "request_timeout_s", "tolerance_pct"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name):g}")
    for name in ("cpu_mib", "disk_mib", "cache_server_mib", "num_gpu_blocks", "long_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    if args.model is not None:
        if args.model_size is not None:
            parser.error("give --model or --model-size, not both")
        if not (Path(args.model) / "config.json").is_file():
            parser.error(f"--model {args.model!r} is not a model folder (no config.json in it)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {args.out!r} exists and is not a folder")


def on_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve(args, parser)
    cuda = on_cuda(args.device)
    serve_flags = ["--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(args.concurrency)]
    work_model = None
    if args.model is not None:
        model = str(Path(args.model).resolve())
    else:
        size = args.model_size or ("8b" if cuda else "bench")
        args.model_size = size
        work_model = Path(tempfile.mkdtemp(prefix=f"kvstash-soak-model-{size}-"))
        print(f"making the {size} model in {work_model} ...", flush=True)
        if size == "8b":
            model = str(make_8b_folder(work_model))
            serve_flags += ["--load-format", "dummy", "--model-id", "soak-llama-3.1-8b-shape-dummy"]
        else:
            from bench.tiny_model import make_tiny_model

            model = str(make_tiny_model(work_model, size=size))
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        dtype_bytes = 4 if args.dtype == "float32" else 2
        kv_token = kv_bytes_per_token(config, dtype_bytes)
        if args.long_tokens is None:
            args.long_tokens = 8192 if args.model_size == "8b" else 1024
        longest = (
            args.long_tokens + args.turns * (args.question_tokens + args.answer_tokens) + args.answer_tokens
        )
        max_len = config.get("max_position_embeddings", longest)
        if longest > max_len:
            parser.error(f"conversations reach {longest} tokens, more than the model's context of {max_len}")
        block_size = 16
        if args.num_gpu_blocks is None:
            args.num_gpu_blocks = math.ceil(3 * longest / block_size)
        mean_context = args.long_share * args.long_tokens + (1 - args.long_share) * args.short_tokens
        users_kv = (
            args.users * (mean_context + args.turns * (args.question_tokens + args.answer_tokens)) * kv_token
        )
        chunk_bytes = args.chunk_size * kv_token
        args.cpu_mib = args.cpu_mib or max(4 * chunk_bytes, 0.5 * users_kv) / MIB
        args.disk_mib = args.disk_mib or max(8 * chunk_bytes, users_kv) / MIB
        args.cache_server_mib = args.cache_server_mib or max(16 * chunk_bytes, 2 * users_kv, 64 * MIB) / MIB
        serve_flags += ["--num-gpu-blocks", str(args.num_gpu_blocks), *args.serve_arg]
        print(
            f"model {model} ({config.get('num_hidden_layers')} layers, {kv_token} KV bytes/token in {args.dtype}); "
            f"{args.users} users, {args.concurrency} in flight; KV pool {args.num_gpu_blocks} blocks; tiers: "
            f"cpu {args.cpu_mib:.1f} MiB, disk {args.disk_mib:.1f} MiB, cache server {args.cache_server_mib:.1f} MiB",
            flush=True,
        )
        result = Soak(args, model, serve_flags, config["vocab_size"]).run()
    finally:
        if work_model is not None:
            shutil.rmtree(work_model, ignore_errors=True)
    out = Path(args.out)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "soak.png")
    print_table(result)
    print(f"wrote {out / 'soak.json'}, {out / 'soak.png'} and the logs in {out}")
    if args.check and not result["summary"]["passed"]:
        failed = [f"{c['name']} ({c['detail']})" for c in result["summary"]["checks"] if not c["ok"]]
        print("soak: targets failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
