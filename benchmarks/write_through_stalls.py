"""How long the engine's step thread is held up while the write-through thread copies
CPU-tier chunks to the disk tier (issue 23: CPU-tier hits of 27-30 ms took 40-45 ms
while round 1's chunks were still being written to disk, one with 14 ms inside
``get_prefix``).

A real :class:`~connector.tiers.TierManager` (the connector's pinned CPU tier over a
real disk tier in a temporary folder) holds ``--num-read-chunks`` chunks that a
"step" thread reads again and again, as ``CacheEngine.plan_load`` does. Three probes
run in threads of their own, first with nothing else running ("idle"), then while
``--num-write-chunks`` freshly stored chunks are written through to disk:

- ``ticker``: sleeps 0.5 ms in a loop and records how late it wakes up: the time it
  waits to get the GIL (or a core) back;
- ``ticker_proc``: the same in a child process: late only when no core is free (it
  needs no GIL of ours), so ``ticker`` minus ``ticker_proc`` is the GIL's share;
- ``get_prefix``: ``tiers.get_prefix(keys, cpu_only=True)`` then ``tiers.release``
  of the read chunks (the CPU-tier part of ``plan_load``);
- ``pin``: ``tiers.pin(keys)`` then ``tiers.unpin(keys)`` (the scheduler's lookup
  pins, which take the disk tier's lock too);
- ``gc``: the garbage collector's passes (in any thread; each holds the GIL);
- ``torch_ops``: 256 small torch calls (slices and views of a host tensor), each of
  which releases and takes back the GIL, as the step's host code does.

The write-through window starts once every chunk is stored and queued (the disk tier
waits for that: staging is not measured) and ends when ``flush`` returns. Reported per probe: count, median, p99 and max in ms.

    python benchmarks/write_through_stalls.py --out stalls.json
    python benchmarks/write_through_stalls.py --num-write-chunks 48 --io-threads 16 --dir /mnt/nvme/tmp
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from connector.cpu_tier import PinnedChunkPool  # noqa: E402
from connector.slot_grants import SlotGrants  # noqa: E402
from connector.tiers import TierManager  # noqa: E402
from connector.token_db import KV_LAYOUT  # noqa: E402
from storage_backends.disk_backend import DiskBackend  # noqa: E402
from storage_backends.disk_io import BLOCK  # noqa: E402

#: Llama-3.1-8B: 32 layers x 2 x 256 tokens x 8 KV heads x 128 dims of bf16 = 32 MiB per chunk
CHUNK_SHAPE_8B = (32, 2, 256, 8, 128)
TICK_S = 0.0005
PROBE_PAUSE_S = 0.002
NUM_TORCH_OPS = 256


class Samples:
    """(start time, seconds) pairs in two float arrays: appending creates no objects that the
    garbage collector tracks, so the probes do not cause the collector pauses they measure."""

    def __init__(self) -> None:
        self.starts = array.array("d")
        self.seconds = array.array("d")

    def add(self, started: float, seconds: float) -> None:
        self.starts.append(started)
        self.seconds.append(seconds)

    def window(self, start: float, end: float) -> list[float]:
        return [
            seconds
            for started, seconds in zip(self.starts, self.seconds, strict=True)
            if start <= started < end
        ]


class Probe:
    """Runs ``call`` in its own thread until stopped, recording (start time, seconds) per call."""

    def __init__(self, name: str, call: Callable[[], float], pause_s: float) -> None:
        self.name = name
        self._call = call
        self._pause_s = pause_s
        self.samples = Samples()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{name}", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self.samples.add(started, self._call())
            if self._pause_s:
                time.sleep(self._pause_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> list[float]:
        return self.samples.window(start, end)


class GcPauses:
    """Garbage-collector passes of this process (any thread's), timed by ``gc.callbacks``:
    a pass holds the GIL from start to end."""

    name = "gc"

    def __init__(self) -> None:
        self.samples = Samples()
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.samples.add(self._started, time.perf_counter() - self._started)

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def window(self, start: float, end: float) -> list[float]:
        return self.samples.window(start, end)


#: the ticker of another process: lateness there is CPU time (cores), not the GIL
_PROCESS_TICKER = """
import sys, time
tick_s = float(sys.argv[1])
while True:
    started = time.perf_counter()
    time.sleep(tick_s)
    late = time.perf_counter() - started - tick_s
    sys.stdout.write(f"{started!r} {late!r}\\n")
"""


class ProcessTicker:
    """A ticker in a child process; its samples share ``time.perf_counter``'s clock
    (CLOCK_MONOTONIC) with this process's probes."""

    name = "ticker_proc"

    def __init__(self) -> None:
        self.samples = Samples()
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-u", "-c", _PROCESS_TICKER, str(TICK_S)], stdout=subprocess.PIPE, text=True
        )
        self._reader = threading.Thread(target=self._read, name="probe-ticker-proc", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            started, late = line.split()
            self.samples.add(float(started), float(late))

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()
        self._reader.join()

    def window(self, start: float, end: float) -> list[float]:
        return self.samples.window(start, end)


def summarize(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"count": 0, "median_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(seconds)
    return {
        "count": len(ordered),
        "median_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


def make_probes(tiers: TierManager, read_keys: list[str]) -> list[Probe | ProcessTicker | GcPauses]:
    def tick() -> float:
        started = time.perf_counter()
        time.sleep(TICK_S)
        return time.perf_counter() - started - TICK_S

    def get_prefix() -> float:
        started = time.perf_counter()
        read = tiers.get_prefix(read_keys, cpu_only=True)
        tiers.release(read.held_keys)
        if len(read.chunks) != len(read_keys):
            raise RuntimeError(
                f"only {len(read.chunks)} of {len(read_keys)} read chunks were in the CPU tier"
            )
        return time.perf_counter() - started

    def pin() -> float:
        started = time.perf_counter()
        tiers.pin(read_keys)
        tiers.unpin(read_keys)
        return time.perf_counter() - started

    host = torch.zeros(NUM_TORCH_OPS, 16)

    def torch_ops() -> float:
        started = time.perf_counter()
        for index in range(NUM_TORCH_OPS):
            host[index : index + 1].view(-1)
        return time.perf_counter() - started

    return [
        GcPauses(),
        ProcessTicker(),
        Probe("ticker", tick, 0.0),
        Probe("get_prefix", get_prefix, PROBE_PAUSE_S),
        Probe("pin", pin, PROBE_PAUSE_S),
        Probe("torch_ops", torch_ops, PROBE_PAUSE_S),
    ]


class GatedDiskBackend(DiskBackend):
    """The real disk tier whose ``put_many`` waits for ``gate`` first: the chunks to write
    are stored and queued before the write-through may start, so staging them is not
    measured as write-through."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()

    def put_many(self, items) -> None:
        self.gate.wait()
        super().put_many(items)


def stage(tiers: TierManager, keys: list[str], shape: tuple[int, ...]) -> None:
    """Store ``keys`` the way a step does (a CPU-tier slot granted and filled, its write-through
    queued, then published as the scheduler side does at the step's report)."""
    grants = SlotGrants(tiers.cpu.index, write_through=bool(tiers.lower))
    for index, key in enumerate(keys):
        grants.write_through_done(tiers.take_written_through())  # the report's unpins
        (slot_id,) = grants.grant_save([key], [shape])
        pending = tiers.begin_put(key, shape, slot_id=slot_id, pin_memory=False)
        if pending is None or pending.slot_id is None:
            raise RuntimeError(f"the CPU tier refused {key}")
        pending.buffer.fill_(float(index % 97))
        tiers.end_put(pending)
        grants.apply_fills([(key, slot_id, True)])


def run(args: argparse.Namespace) -> dict:
    shape = tuple(args.chunk_shape)
    dtype = torch.bfloat16
    chunk_bytes = torch.Size(shape).numel() * dtype.itemsize
    num_slots = args.num_read_chunks + args.num_write_chunks + 2
    folder = tempfile.mkdtemp(prefix="kvstash-wt-stalls-", dir=args.dir)
    try:
        cpu = PinnedChunkPool(
            num_slots * chunk_bytes, shape, dtype, pin_memory=torch.cuda.is_available(), layout=KV_LAYOUT
        )
        disk = GatedDiskBackend(
            folder,
            capacity_bytes=(args.num_read_chunks + args.num_write_chunks + 4) * (chunk_bytes + (64 << 10)),
            fsync=args.fsync,
            io_threads=args.io_threads,
        )
        tiers = TierManager(cpu, [disk], dtype=dtype, save_queue_size=num_slots + 8, pin_timeout_s=600.0)
        read_keys = [f"read-{index}" for index in range(args.num_read_chunks)]
        write_keys = [f"write-{index}" for index in range(args.num_write_chunks)]
        stage(tiers, read_keys, shape)
        tiers.flush()  # the read chunks are on disk too: only the write chunks are in flight below
        # The disk tier writes a slot with O_DIRECT only when its memory is block-aligned.
        slots_aligned = cpu.get(read_keys[0]).tensor.data_ptr() % BLOCK == 0

        probes = make_probes(tiers, read_keys)
        for probe in probes:
            probe.start()
        time.sleep(0.2)  # warm
        idle_start = time.perf_counter()
        time.sleep(args.idle_s)
        idle_end = time.perf_counter()
        disk.gate.clear()
        stage(tiers, write_keys, shape)
        write_start = time.perf_counter()
        disk.gate.set()
        tiers.flush()
        write_end = time.perf_counter()
        for probe in probes:
            probe.stop()
        disk_stats = disk.stats()
        tiers.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    written_bytes = args.num_write_chunks * chunk_bytes
    return {
        "chunk_shape": list(shape),
        "chunk_mib": chunk_bytes / (1 << 20),
        "num_read_chunks": args.num_read_chunks,
        "num_write_chunks": args.num_write_chunks,
        "io_threads": args.io_threads,
        "fsync": args.fsync,
        "direct_io": disk_stats["direct_io"],
        "direct_writes": disk_stats["direct_io"] and slots_aligned,
        "idle_s": idle_end - idle_start,
        "write_through_s": write_end - write_start,
        "write_gbps_after_staging": written_bytes / max(write_end - write_start, 1e-9) / 1e9,
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "phases": {
            "idle": {probe.name: summarize(probe.window(idle_start, idle_end)) for probe in probes},
            "write_through": {
                probe.name: summarize(probe.window(write_start, write_end)) for probe in probes
            },
        },
    }


def print_table(result: dict) -> None:
    print(
        f"chunks of {result['chunk_mib']:.0f} MiB {tuple(result['chunk_shape'])}, "
        f"{result['num_write_chunks']} written through with io_threads={result['io_threads']} "
        f"(O_DIRECT writes={result['direct_writes']}, fsync={result['fsync']}) in {result['write_through_s']:.2f} s "
        f"({result['write_gbps_after_staging']:.2f} GB/s); get_prefix of {result['num_read_chunks']} chunks"
    )
    print(f"{'phase':<14} {'probe':<11} {'count':>6} {'median ms':>10} {'p99 ms':>8} {'max ms':>8}")
    for phase, probes in result["phases"].items():
        for name, row in probes.items():
            print(
                f"{phase:<14} {name:<11} {row['count']:>6} {row['median_ms']:>10.3f} "
                f"{row['p99_ms']:>8.3f} {row['max_ms']:>8.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunk-shape", type=int, nargs=5, default=list(CHUNK_SHAPE_8B))
    parser.add_argument("--num-read-chunks", type=int, default=32, help="chunks get_prefix reads (8k tokens)")
    parser.add_argument("--num-write-chunks", type=int, default=48, help="chunks written through (1.5 GiB)")
    parser.add_argument("--io-threads", type=int, default=16, help="the disk tier's io_threads")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false")
    parser.add_argument("--idle-s", type=float, default=2.0, help="seconds measured with no write-through")
    parser.add_argument("--dir", default=None, help="parent of the temporary disk-tier folder")
    parser.add_argument("--repeat", type=int, default=1, help="runs (each reported)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args()

    results = []
    for _ in range(args.repeat):
        result = run(args)
        print_table(result)
        results.append(result)
    if args.out:
        machine = {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        }
        args.out.write_text(json.dumps({"machine": machine, "runs": results}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
