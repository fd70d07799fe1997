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
``--tolerance-pct`` (5) of the first sample after warm-up, the disk tier within its
cap, no request error outside the restart window, no engine step error, no tier error
outside the restart window, the engine served after the restart, no differing output.

    python benchmarks/soak.py --duration 120 --out soak-out --check           # CPU: bench-size model
    python benchmarks/soak.py --duration 60 --model-size tiny --out /tmp/s --check   # the CI smoke run
    python benchmarks/soak.py --duration 600 --model-size 8b --out soak-h100 --check  # GPU (8B shape)
    python benchmarks/soak.py --model /path/to/checkpoint --duration 600 --out soak-out

``--model-size 8b`` writes a folder with the Llama-3.1-8B config and a tokenizer that
covers its vocabulary and serves it with ``--load-format dummy`` (random weights made on
the device; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MIB = 1 << 20
GIB = 1 << 30
START_TIMEOUT_S = 300.0
#: /metrics samples kept per sample (name, label to keep or None)
METRICS = (
    ("kvstash_requests_total", "finish_reason"),
    ("kvstash_prompt_tokens_total", None),
    ("kvstash_generation_tokens_total", None),
    ("kvstash_gpu_prefix_hit_tokens_total", None),
    ("kvstash_external_hit_tokens_total", None),
    ("kvstash_kv_loaded_tokens_total", None),
    ("kvstash_kv_saved_tokens_total", None),
    ("kvstash_tier_hit_chunks_total", "tier"),
    ("kvstash_tier_errors_total", "tier"),
    ("kvstash_tier_breaker_trips_total", "tier"),
    ("kvstash_engine_step_errors_total", None),
    ("kvstash_engine_retried_requests_total", None),
    ("kvstash_kv_blocks_used", None),
)
#: what the plot and the drift table show: (sample key, label, unit divisor)
TRACKED = (
    ("serve_rss_bytes", "serve RSS (MiB)", MIB),
    ("serve_threads", "serve threads", 1),
    ("serve_fds", "serve open files*", 1),
    ("disk_bytes", "disk tier (MiB)", MIB),
    ("gpu_bytes", "GPU memory (MiB)", MIB),
)
#: the figures that must stay within --tolerance-pct after warm-up
STEADY = ("serve_rss_bytes", "serve_threads", "serve_fds", "gpu_bytes")
#: figures that count things (threads, open files): a change of one is within any tolerance
COUNTED = ("serve_threads", "serve_fds")


# ---- child processes -------------------------------------------------------------------
def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in [n for n in env if n.startswith("KVSTASH_") and n != "KVSTASH_CACHE_DIR"]:
        del env[name]  # the flags alone configure the children
    return env


class Child:
    """A child process whose output goes to ``log_path``; ``port`` is read from its
    output with ``port_pattern``. ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(self, command: list[str], log_path: Path, port_pattern: str, what: str) -> None:
        self.command, self.log_path, self.what = command, log_path, what
        self._pattern = re.compile(port_pattern)
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self) -> Child:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=REPO_ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            match = self._pattern.search(self.output()[offset:])
            if match:
                self.port = int(match.group(1))
                return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.output()[offset:][-3000:]
                self.kill()
                raise RuntimeError(f"{self.what} did not start ({' '.join(self.command)}):\n{tail}")
            time.sleep(0.1)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_serve(model: str, flags: list[str], log_path: Path, what: str) -> Child:
    command = [sys.executable, "-m", "engine.cli", "serve", model, "--host", "127.0.0.1", "--port", "0"]
    command += ["--served-model-name", "soak", *flags]
    child = Child(command, log_path, r"Uvicorn running on http://127\.0\.0\.1:(\d+)", what).start()
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while httpx.get(f"http://127.0.0.1:{child.port}/health", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            child.kill()
            raise RuntimeError(f"{what}: /health never answered 200\n{child.output()[-3000:]}")
        time.sleep(0.5)
    return child


def cache_server_command(port: int, memory_mib: float) -> list[str]:
    return [
        sys.executable, "-m", "cache_server", "--host", "127.0.0.1", "--port", str(port),
        "--memory-gb", f"{memory_mib / 1024:.6f}", "--heap-reserve-mb", "0", "--grace-s", "2",
    ]  # fmt: skip


def start_cache_server(port: int, memory_mib: float, log_path: Path, attempts: int = 20) -> Child:
    """Start the cache server on ``port`` (0: a free one); a restart on a port that the
    old process just left is retried for a few seconds."""
    for attempt in range(attempts):
        child = Child(
            cache_server_command(port, memory_mib),
            log_path,
            r"listening on grpc://127\.0\.0\.1:(\d+)",
            "cache server",
        )
        try:
            return child.start()
        except RuntimeError:
            if port == 0 or attempt == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


# ---- sampling ----------------------------------------------------------------------------
def process_tree(pid: int):
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_figures(pid: int) -> dict:
    """RSS, threads and open files of the process and its children (a pipeline stage, a
    tokenizer helper)."""
    import psutil

    rss = threads = fds = 0
    pids = []
    for proc in process_tree(pid):
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                threads += proc.num_threads()
                fds += proc.num_fds()
                pids.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return {"rss_bytes": rss, "threads": threads, "fds": fds, "pids": pids}


def thread_names(pids: list[int]) -> dict[str, int]:
    """How many threads of each OS name (Linux /proc; empty elsewhere): says which grew."""
    names: dict[str, int] = {}
    for pid in pids:
        for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
            try:
                name = comm.read_text().strip()
            except OSError:
                continue
            names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def fd_kinds(pids: list[int]) -> dict[str, int]:
    """Open files by kind (socket, pipe, anon_inode:..., file; Linux /proc; empty elsewhere)."""
    kinds: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
            if target.startswith("anon_inode:"):
                kind = target.split("[")[0]
            kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def shm_mappings(pids: list[int]) -> dict[str, int]:
    """Shared-memory mappings (/dev/shm, memfd) of the processes: how many and their bytes
    (the cache server's staging areas live there; Linux /proc; zeros elsewhere)."""
    count = size = 0
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if "/dev/shm/" in line or "memfd:" in line:
                begin, end = (int(x, 16) for x in line.split()[0].split("-"))
                count += 1
                size += end - begin
    return {"count": count, "bytes": size}


def client_connections(pids: list[int], port: int) -> int:
    """Established TCP connections of clients to the server's HTTP ``port`` (the load's
    own connections: they come and go with the requests and the aborts)."""
    import psutil

    count = 0
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        count += sum(
            1 for c in connections if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
        )
    return count


def gpu_bytes(pids: list[int]) -> int | None:
    """GPU memory used by ``pids`` (nvidia-smi's per-process figures), None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return None
    total = 0
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids and parts[1].isdigit():
            total += int(parts[1]) * MIB
    return total


def folder_bytes(path: Path) -> tuple[int, int]:
    """(sum of file sizes, bytes allocated on disk as du counts them) of a folder tree."""
    size = allocated = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue  # evicted meanwhile
            size += st.st_size
            allocated += st.st_blocks * 512
    return size, allocated


def read_metrics(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = dict(METRICS)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                label = wanted[sample.name]
                key = (
                    sample.name
                    if label is None
                    else f"{sample.name}{{{label}={sample.labels.get(label, '')}}}"
                )
                values[key] = sample.value
    return values


class Sampler:
    """Every ``interval_s`` on a thread: one sample of the serve process tree, the GPU,
    the disk tier, the cache server and /metrics."""

    def __init__(self, soak: Soak, interval_s: float) -> None:
        self.soak, self.interval_s = soak, interval_s
        self.samples: list[dict] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        soak = self.soak
        t = time.monotonic() - soak.t0
        try:
            serve = tree_figures(soak.serve.process.pid)
            size, allocated = folder_bytes(soak.disk_dir)
            cache = soak.cache_server
            cache_rss = None
            if cache is not None and cache.process is not None and cache.process.poll() is None:
                cache_rss = tree_figures(cache.process.pid)["rss_bytes"]
            connections = client_connections(serve["pids"], soak.serve.port)
            sample = {
                "t_s": round(t, 2),
                "serve_rss_bytes": serve["rss_bytes"],
                "serve_threads": serve["threads"],
                # open files other than the load's own connections to the HTTP port
                "serve_fds": serve["fds"] - connections,
                "serve_fds_all": serve["fds"],
                "client_connections": connections,
                "thread_names": thread_names(serve["pids"]),
                "fd_kinds": fd_kinds(serve["pids"]),
                "shm_mappings": shm_mappings(serve["pids"]),
                "gpu_bytes": gpu_bytes(serve["pids"]),
                # what the tier's cap counts (its files' sizes), and what du shows
                "disk_bytes": size,
                "disk_du_bytes": allocated,
                "cache_server_rss_bytes": cache_rss,
                "requests_done": soak.load.num_done,
                "metrics": read_metrics(soak.url),
            }
        except Exception as error:  # noqa: BLE001 - a failed sample is reported, the soak goes on
            self.failures.append(f"t={t:.1f}s {type(error).__name__}: {error}")
            return
        self.samples.append(sample)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the last one, after the load stopped


# ---- load ----------------------------------------------------------------------------------
class Load:
    """The users: asyncio tasks over one httpx client, at most ``concurrency`` requests in
    flight, until the deadline (or ``max_requests``)."""

    def __init__(self, args: argparse.Namespace, url: str, vocab_size: int, t0: float) -> None:
        self.args, self.url, self.vocab_size, self.t0 = args, url, vocab_size, t0
        self.records: list[dict] = []
        self.num_done = 0
        #: conversations sent, newest last: (user, prompt token ids) of each one's last turn
        self.conversations: dict[tuple[int, int], list[int]] = {}
        self.deadline = t0 + args.duration

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        # ids 5.. (the tiny tokenizer's special tokens are 0-4)
        return [rng.randrange(5, self.vocab_size) for _ in range(n)]

    async def run(self) -> None:
        import httpx

        limits = httpx.Limits(
            max_connections=self.args.concurrency * 2, max_keepalive_connections=self.args.concurrency
        )
        semaphore = asyncio.Semaphore(self.args.concurrency)
        async with httpx.AsyncClient(timeout=self.args.request_timeout_s, limits=limits) as client:
            await asyncio.gather(*(self.user(client, semaphore, u) for u in range(self.args.users)))

    def stopped(self) -> bool:
        return time.monotonic() >= self.deadline or len(self.records) >= self.args.max_requests

    async def user(self, client, semaphore: asyncio.Semaphore, user: int) -> None:
        args = self.args
        rng = random.Random(args.seed * 1000 + user)
        conversation_index = 0
        while not self.stopped():
            long = rng.random() < args.long_share
            context = self.tokens(rng, args.long_tokens if long else args.short_tokens)
            key = (user, conversation_index)
            conversation_index += 1
            for turn in range(args.turns):
                if self.stopped():
                    return
                prompt = context + self.tokens(rng, args.question_tokens)
                stream = rng.random() < args.stream_share
                abort_after = rng.randint(1, 3) if stream and rng.random() < args.abort_share else None
                async with semaphore:
                    if self.stopped():
                        return
                    record = await self.request(client, prompt, stream, abort_after)
                record.update(user=user, conversation=key[1], turn=turn, long=long)
                self.records.append(record)
                self.num_done += 1
                if record["ok"] and not record["aborted"]:
                    self.conversations[key] = prompt
                # the conversation goes on with a fixed-length answer of its own
                context = prompt + self.tokens(rng, args.answer_tokens)

    async def request(self, client, prompt: list[int], stream: bool, abort_after: int | None) -> dict:
        body = {
            "model": "soak",
            "prompt": prompt,
            "max_tokens": self.args.answer_tokens,
            "temperature": 0.8,
            "seed": len(prompt),
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        started = time.monotonic()
        record = {
            "t_s": round(started - self.t0, 3),
            "prompt_tokens": len(prompt),
            "stream": stream,
            "aborted": False,
            "ok": False,
            "error": None,
            "external_hit_tokens": 0,
            "cached_tokens": 0,
        }
        try:
            if stream:
                await self._stream(client, body, record, abort_after)
            else:
                response = await client.post(f"{self.url}/v1/completions", json=body)
                if response.status_code != 200:
                    record["error"] = f"HTTP {response.status_code}: {response.text[:300]}"
                else:
                    self._usage(record, response.json().get("usage"))
                    record["ok"] = True
        except Exception as error:  # noqa: BLE001 - every failure is counted, none stops the soak
            record["error"] = f"{type(error).__name__}: {error}"
        record["latency_s"] = round(time.monotonic() - started, 4)
        return record

    async def _stream(self, client, body: dict, record: dict, abort_after: int | None) -> None:
        events = 0
        async with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    if events == 0:
                        record["error"] = "stream ended without a token"
                    else:
                        record["ok"] = True
                    return
                event = json.loads(payload)
                if "error" in event:
                    record["error"] = f"error event: {event['error']}"
                    return
                self._usage(record, event.get("usage"))
                if event.get("choices"):
                    events += 1
                if abort_after is not None and events >= abort_after:
                    # leaving the block closes the response and its connection mid-stream
                    record["aborted"] = record["ok"] = True
                    return
        record["error"] = f"stream ended after {events} events without [DONE]"

    @staticmethod
    def _usage(record: dict, usage: dict | None) -> None:
        if not usage:
            return
        record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        record["external_hit_tokens"] = (usage.get("kvstash") or {}).get("external_hit_tokens") or 0


# ---- greedy check ----------------------------------------------------------------------------
def greedy_outputs(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Each prompt alone, greedily -> its text, token count, finish reason and hits."""
    import httpx

    outputs = []
    with httpx.Client(timeout=600) as client:
        for prompt in prompts:
            body = {"model": "soak", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = client.post(f"{url}/v1/completions", json={**body, "ignore_eos": True})
            response.raise_for_status()
            reply = response.json()
            usage = reply["usage"]
            outputs.append(
                {
                    "text": reply["choices"][0]["text"],
                    "completion_tokens": usage["completion_tokens"],
                    "finish_reason": reply["choices"][0]["finish_reason"],
                    "external_hit_tokens": (usage.get("kvstash") or {}).get("external_hit_tokens", 0),
                }
            )
    return outputs


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
        args = self.args
        restart = self.restart
        windows = [
            (r.get("sigterm_t_s", math.inf), r.get("window_end_t_s", math.inf))
            for r in (self.warmup_restart, restart)
        ]

        def in_window(t: float) -> bool:
            return any(begin <= t <= end for begin, end in windows)

        records = load.records
        errors = [r for r in records if r["error"]]
        errors_in_window = [r for r in errors if in_window(r["t_s"]) or in_window(r["t_s"] + r["latency_s"])]
        errors_outside = [r for r in errors if r not in errors_in_window]
        served_after = [r for r in records if r["ok"] and r["t_s"] > restart.get("back_t_s", math.inf)]
        samples = sampler.samples
        after_warmup = [s for s in samples if s["t_s"] >= args.warmup]
        # the drift is taken outside the restart window: while the cache server is down its
        # connections (sockets, shared-memory staging areas) are gone, by design
        steady = [s for s in after_warmup if not in_window(s["t_s"])]
        figures = {}
        for key, _label, _unit in TRACKED:
            values = [s[key] for s in after_warmup if s.get(key) is not None]
            steady_values = [s[key] for s in steady if s.get(key) is not None]
            if not values or not steady_values:
                figures[key] = None
                continue
            # medians of the first and the last quarter (at least 3 samples each): a leak is a
            # trend, a write or a request in flight at one sample is not (a serve process holds
            # ~20 files, so one file open for a write in flight is 5% of them)
            k = max(3, len(steady_values) // 4)
            start, end = statistics.median(steady_values[:k]), statistics.median(steady_values[-k:])
            figures[key] = {
                "first": values[0],
                "last": values[-1],
                "min": min(values),
                "max": max(values),
                "start_median": start,
                "end_median": end,
                "samples_per_median": k,
                "drift_pct": 100.0 * (end - start) / start if start else 0.0,
                # the farthest any sample after warm-up (outside the window) went from the start
                "max_deviation_pct": 100.0 * max(abs(v - start) for v in steady_values) / start
                if start
                else 0.0,
            }
        disk_cap = int(args.disk_mib * MIB)
        disk_max = max((s["disk_bytes"] for s in samples), default=0)
        disk_du_max = max((s["disk_du_bytes"] for s in samples), default=0)

        # tier errors per interval between samples, apart for intervals touching the window
        tier_errors_outside: dict[str, float] = {}
        tier_errors_window: dict[str, float] = {}
        for before, after in zip(samples, samples[1:], strict=False):
            touches = any(before["t_s"] <= end and after["t_s"] >= begin for begin, end in windows)
            for name, value in after["metrics"].items():
                if name.startswith("kvstash_tier_errors_total"):
                    delta = value - before["metrics"].get(name, 0.0)
                    if delta:
                        bucket = tier_errors_window if touches else tier_errors_outside
                        bucket[name] = bucket.get(name, 0.0) + delta
        first_metrics = samples[0]["metrics"] if samples else {}
        last = samples[-1]["metrics"] if samples else {}

        def counter(name: str) -> float:
            return last.get(name, 0.0) - first_metrics.get(name, 0.0)

        grpc_hits_after = 0.0
        back = restart.get("back_t_s", math.inf)
        after_back = [s for s in samples if s["t_s"] >= back]
        if after_back:
            before_back = [s for s in samples if s["t_s"] < back]
            base = before_back[-1]["metrics"] if before_back else first_metrics
            name = "kvstash_tier_hit_chunks_total{tier=grpc}"
            grpc_hits_after = after_back[-1]["metrics"].get(name, 0.0) - base.get(name, 0.0)
        differing = [
            {"prompt_tokens": len(p), "soaked": s, "reference": r}
            for p, s, r in zip(prompts, soaked, reference, strict=True)
            if (s["text"], s["completion_tokens"]) != (r["text"], r["completion_tokens"])
        ]
        summary = {
            "duration_s": args.duration,
            "load_end_t_s": round(load_end_t, 2),
            "warmup_s": args.warmup,
            "requests": len(records),
            "requests_ok": sum(1 for r in records if r["ok"]),
            "streamed": sum(1 for r in records if r["stream"]),
            "aborted_streams": sum(1 for r in records if r["aborted"]),
            "errors": len(errors),
            "errors_in_restart_window": len(errors_in_window),
            "errors_outside_restart_window": len(errors_outside),
            "error_examples": [{k: r[k] for k in ("t_s", "stream", "error")} for r in errors[:20]],
            "requests_with_external_hits": sum(1 for r in records if r["external_hit_tokens"] > 0),
            "client_external_hit_tokens": sum(r["external_hit_tokens"] for r in records),
            "prompt_tokens_sent": sum(r["prompt_tokens"] for r in records),
            "server_counters": {
                "requests_finished": {
                    reason: counter(f"kvstash_requests_total{{finish_reason={reason}}}")
                    for reason in ("stop", "length", "abort", "error")
                },
                "prompt_tokens": counter("kvstash_prompt_tokens_total"),
                "gpu_prefix_hit_tokens": counter("kvstash_gpu_prefix_hit_tokens_total"),
                "external_hit_tokens": counter("kvstash_external_hit_tokens_total"),
                "kv_loaded_tokens": counter("kvstash_kv_loaded_tokens_total"),
                "kv_saved_tokens": counter("kvstash_kv_saved_tokens_total"),
                "tier_hit_chunks": {
                    t: counter(f"kvstash_tier_hit_chunks_total{{tier={t}}}") for t in ("cpu", "disk", "grpc")
                },
                "tier_errors": {
                    t: counter(f"kvstash_tier_errors_total{{tier={t}}}") for t in ("cpu", "disk", "grpc")
                },
                "tier_breaker_trips": {
                    t: counter(f"kvstash_tier_breaker_trips_total{{tier={t}}}")
                    for t in ("cpu", "disk", "grpc")
                },
                "engine_step_errors": counter("kvstash_engine_step_errors_total"),
            },
            "tier_errors_in_restart_window": tier_errors_window,
            "tier_errors_outside_restart_window": tier_errors_outside,
            "restart": {
                **restart,
                "served_after": len(served_after),
                "grpc_hit_chunks_after": grpc_hits_after,
            },
            "warmup_restart": dict(self.warmup_restart),
            "figures_after_warmup": figures,
            "disk_cap_bytes": disk_cap,
            "disk_max_bytes": disk_max,
            "disk_max_du_bytes": disk_du_max,
            "sample_failures": sampler.failures,
            "num_samples": len(samples),
            "greedy": {
                "prompts": len(prompts),
                "max_tokens": args.greedy_max_tokens,
                "with_external_hits_on_soaked": sum(1 for s in soaked if s["external_hit_tokens"]),
                "differing": len(differing),
                "differing_examples": differing[:5],
            },
            "serve_shutdown_clean": clean_shutdown,
        }
        summary["checks"] = self.checks(summary)
        summary["passed"] = all(c["ok"] for c in summary["checks"])
        return {
            "args": vars(args),
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "commit": git_commit(),
            "samples": samples,
            "requests": records,
            "summary": summary,
        }

    def checks(self, summary: dict) -> list[dict]:
        args = self.args
        tol = args.tolerance_pct
        checks = []

        def check(name: str, ok: bool, detail: str) -> None:
            checks.append({"name": name, "ok": bool(ok), "detail": detail})

        for key in STEADY:
            fig = summary["figures_after_warmup"].get(key)
            if fig is None:
                check(f"{key} within {tol:g}%", True, "n/a (not measured here)")
            else:
                # Threads and open files are counts of ~20-80: one more or fewer (a write or a
                # connection in flight at the sampled moment) is the resolution, not a trend.
                change = abs(fig["end_median"] - fig["start_median"])
                within_one = key in COUNTED and change <= 1
                check(
                    f"{key} within {tol:g}%",
                    abs(fig["drift_pct"]) <= tol or within_one,
                    f"drift {fig['drift_pct']:+.1f}%{' (one unit)' if within_one and abs(fig['drift_pct']) > tol else ''} "
                    f"(median of the first {fig['samples_per_median']} samples "
                    f"after warm-up -> of the last {fig['samples_per_median']}; farthest sample "
                    f"{fig['max_deviation_pct']:.1f}% away)",
                )
        check(
            "disk tier within its cap",
            summary["disk_max_bytes"] <= summary["disk_cap_bytes"],
            f"max {summary['disk_max_bytes'] / MIB:.2f} MiB of files (du: "
            f"{summary['disk_max_du_bytes'] / MIB:.2f}) of {summary['disk_cap_bytes'] / MIB:.2f} MiB",
        )
        check(
            "no request error outside the restart window",
            summary["errors_outside_restart_window"] == 0,
            f"{summary['errors_outside_restart_window']} (in the window: {summary['errors_in_restart_window']})",
        )
        counters = summary["server_counters"]
        check(
            "no engine error",
            counters["engine_step_errors"] == 0 and counters["requests_finished"]["error"] == 0,
            f"{counters['engine_step_errors']:g} step errors, {counters['requests_finished']['error']:g} failed requests",
        )
        outside = sum(summary["tier_errors_outside_restart_window"].values())
        check("no tier error outside the restart window", outside == 0, f"{outside:g}")
        restart = summary["restart"]
        check(
            "cache server restarted, engine served after it",
            args.no_restart
            or ("back_t_s" in restart and "error" not in restart and restart["served_after"] > 0),
            f"{restart.get('error') or ''}{restart['served_after']} requests served after the restart",
        )
        check("requests served", summary["requests_ok"] > 0, f"{summary['requests_ok']}")
        greedy = summary["greedy"]
        check(
            "greedy outputs identical to an engine without offload",
            greedy["prompts"] > 0 and greedy["differing"] == 0,
            f"{greedy['differing']} of {greedy['prompts']} differ",
        )
        check("serve shut down cleanly", summary["serve_shutdown_clean"], "SIGTERM -> exit 0")
        return checks


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


# ---- report ------------------------------------------------------------------------------------
def warmup_restart_line(summary: dict) -> str:
    """The warm-up restart in a few words (empty when there was none)."""
    warmup = summary.get("warmup_restart") or {}
    if "back_t_s" not in warmup:
        return ""
    late = warmup["window_end_t_s"] > summary["warmup_s"]
    return (
        f"; a first restart during the warm-up: SIGTERM at {warmup['sigterm_t_s']} s, back at "
        f"{warmup['back_t_s']} s{' (its window outlasted the warm-up)' if late else ''}"
    )


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    summary = result["summary"]
    console = Console(soft_wrap=True)
    table = Table(
        title=f"soak: figures after {summary['warmup_s']:g} s of warm-up ({summary['num_samples']} samples)"
    )
    for column in ("figure", "first", "last", "min", "max", "drift %", "farthest %"):
        table.add_column(column, justify="right" if column != "figure" else "left")
    for key, label, unit in TRACKED:
        fig = summary["figures_after_warmup"].get(key)
        if fig is None:
            table.add_row(label, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a")
            continue
        cells = [fig[k] for k in ("first", "last", "min", "max")]
        table.add_row(
            label,
            *(f"{v / unit:,.1f}" if unit != 1 else f"{v:,.0f}" for v in cells),
            f"{fig['drift_pct']:+.1f}",
            f"{fig['max_deviation_pct']:.1f}",
        )
    console.print(table)
    counters = summary["server_counters"]
    restart = summary["restart"]
    hits = counters["tier_hit_chunks"]
    console.print(
        "* open files other than the load's own connections to the HTTP port\n"
        f"disk tier: max {summary['disk_max_bytes'] / MIB:.2f} MiB of files (du: "
        f"{summary['disk_max_du_bytes'] / MIB:.2f}) of a {summary['disk_cap_bytes'] / MIB:.2f} MiB cap\n"
        f"requests: {summary['requests']} ({summary['requests_ok']} ok, {summary['streamed']} streamed, "
        f"{summary['aborted_streams']} aborted mid-stream; server counted "
        f"{counters['requests_finished']['abort']:g} aborts)\n"
        f"errors: {summary['errors_outside_restart_window']} outside the restart window, "
        f"{summary['errors_in_restart_window']} in it; tier errors in it "
        f"{sum(summary['tier_errors_in_restart_window'].values()):g}, outside "
        f"{sum(summary['tier_errors_outside_restart_window'].values()):g}; engine step errors "
        f"{counters['engine_step_errors']:g}\n"
        f"hits: {summary['requests_with_external_hits']} requests loaded KV; external hit tokens "
        f"{counters['external_hit_tokens']:,.0f} of {counters['prompt_tokens']:,.0f} prompt tokens "
        f"(GPU prefix cache {counters['gpu_prefix_hit_tokens']:,.0f}); chunks read: cpu {hits['cpu']:g}, "
        f"disk {hits['disk']:g}, grpc {hits['grpc']:g}\n"
        f"cache-server restart: SIGTERM at {restart.get('sigterm_t_s', '-')} s, back at "
        f"{restart.get('back_t_s', '-')} s (window until {restart.get('window_end_t_s', '-')} s); "
        f"{restart['served_after']} requests served after it, {restart['grpc_hit_chunks_after']:g} grpc chunks read "
        f"after it{'; ERROR ' + restart['error'] if 'error' in restart else ''}"
        f"{warmup_restart_line(summary)}\n"
        f"greedy: {summary['greedy']['differing']} of {summary['greedy']['prompts']} outputs differ from an engine "
        f"without offload ({summary['greedy']['with_external_hits_on_soaked']} of them loaded KV on the soaked server)"
    )
    for check in summary["checks"]:
        console.print(
            f"  [{'ok' if check['ok'] else 'FAIL'}] {check['name']}: {check['detail']}", markup=False
        )
    if summary["sample_failures"]:
        console.print(f"sample failures: {summary['sample_failures'][:5]}", markup=False)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    summary = result["summary"]
    restart = summary["restart"]
    rows = [(k, label, unit) for k, label, unit in TRACKED if any(s.get(k) is not None for s in samples)]
    fig, axes = plt.subplots(len(rows), 1, figsize=(7, 1.6 * len(rows) + 0.6), sharex=True)
    for ax, (key, label, unit) in zip(axes, rows, strict=True):
        points = [(s["t_s"], s[key] / unit) for s in samples if s.get(key) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", markersize=3, linewidth=1)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.axvspan(0, summary["warmup_s"], color="0.9", linewidth=0)
        for down in (restart, summary.get("warmup_restart") or {}):
            if "sigterm_t_s" in down and "back_t_s" in down:
                ax.axvspan(down["sigterm_t_s"], down["back_t_s"], color="tab:red", alpha=0.15, linewidth=0)
        if key == "disk_bytes":
            ax.axhline(summary["disk_cap_bytes"] / unit, color="tab:red", linestyle="--", linewidth=0.8)
        if key in STEADY:
            first = summary["figures_after_warmup"].get(key)
            if first:
                ax.set_ylim(
                    min(ax.get_ylim()[0], first["first"] / unit * 0.9),
                    max(ax.get_ylim()[1], first["first"] / unit * 1.1),
                )
    axes[-1].set_xlabel("seconds (grey: warm-up, red: cache server down; dashed: disk cap)", fontsize=8)
    fig.suptitle(f"kvstash soak, {summary['requests']} requests in {summary['duration_s']:g} s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- model and arguments -------------------------------------------------------------------------
def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def make_8b_folder(directory: Path) -> Path:
    """A folder `kvstash serve --load-format dummy` can serve: the Llama-3.1-8B config and
    a tokenizer whose vocabulary covers every id of it (the tiny model's, padded with
    plain added tokens), so that generated text decodes token for token."""
    from bench.presets import llama31_8b_config
    from bench.tiny_model import TINY_VOCAB_SIZE, _build_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE)
    config = llama31_8b_config()
    tokenizer.add_tokens([f"<t{i}>" for i in range(len(tokenizer), config.vocab_size)])
    vocab = tokenizer.get_vocab()
    config.bos_token_id, config.eos_token_id = vocab["<|bos|>"], vocab["<|eos|>"]
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


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
        print("soak: a target failed (see FAIL above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
