"""Offload transfer benchmark: the connector's store and retrieve against a plain copy.

For 256 / 1024 / 4096 / 16384 tokens of the Llama-3.1-8B KV shape (32 layers,
8 KV heads, head_dim 128, bf16, blocks of 16 in shuffled order) it times, in
one run:

- store: ``CacheEngine.store`` from the paged GPU cache into the CPU tier
  (chunk hashing, slot reservation, pack kernel, device→host copy into pinned
  slots, publish) — fresh tokens every call, so every chunk is really written;
- retrieve: ``CacheEngine.retrieve`` from the CPU tier into the paged GPU cache
  (hashing, pins, host→device copy, unpack kernel, ret_mask);
- xfer (CUDA only): the device time of the same copies and kernels alone, from
  the first queued operation to the last, between the paged cache and pinned
  host chunks;
- the baseline: a plain pinned ``copy_`` of the same bytes in each direction;
- the per-request overhead: ``lookup(pin=True)`` + ``retrieve`` minus the pinned
  host→device copy of the same bytes.

GB/s count the KV payload once (tokens × bytes per token). Each figure is the
median over repeats, with the device synchronized around every call. The
retrieved KV is checked bit-exact for every size. ``--quick`` runs small shapes
on CPU as a smoke test (its figures say nothing about a GPU).

    python benchmarks/offload.py --out offload.json          # on a CUDA machine
    python benchmarks/offload.py --quick --out offload-quick.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from connector import OffloadConfig, create_cache_engine  # noqa: E402

CHUNK_SIZE = 256
BLOCK_SIZE = 16
FULL_SHAPE = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": torch.bfloat16}
QUICK_SHAPE = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32, "dtype": torch.float32}
FULL_SIZES = (256, 1024, 4096, 16384)
QUICK_SIZES = (256, 1024)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[int], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``run(i)`` with the device idle before and after each call."""
    for index in range(warmup):
        run(index)
    times = []
    for index in range(warmup, warmup + repeats):
        synchronize(device)
        began = time.perf_counter()
        run(index)
        synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def shuffled_slots(num_tokens: int, num_blocks: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Two disjoint int64 [num_tokens] CPU slot maps over randomly ordered blocks
    (as real block tables): one to store from, one to retrieve into."""
    blocks_needed = (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_ids = torch.randperm(num_blocks, generator=generator)
    offsets = torch.arange(BLOCK_SIZE)
    return tuple(
        (ids[:, None] * BLOCK_SIZE + offsets).flatten()[:num_tokens]
        for ids in (block_ids[:blocks_needed], block_ids[blocks_needed : 2 * blocks_needed])
    )


def copy_baseline(num_bytes: int, device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one plain copy_ of ``num_bytes`` host→device and device→host (pinned host)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    h2d = median_seconds(lambda _: on_device.copy_(host, non_blocking=True), device, warmup, repeats)
    d2h = median_seconds(lambda _: host.copy_(on_device, non_blocking=True), device, warmup, repeats)
    return h2d, d2h


class DeviceTimer:
    """Device seconds from an event on ``first_stream`` to one on ``last_stream``, per use."""

    def __init__(self, first_stream: torch.cuda.Stream, last_stream: torch.cuda.Stream) -> None:
        self.first_stream, self.last_stream = first_stream, last_stream
        self.seconds: list[float] = []

    def __enter__(self) -> DeviceTimer:
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record(self.first_stream)
        return self

    def __exit__(self, *exc: object) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.last_stream)
        end.synchronize()
        self.seconds.append(self.start.elapsed_time(end) / 1e3)


def transfer_seconds(engine, kv_cache, source_slots, target_slots, *, warmup, repeats) -> tuple[float, float]:
    """Median device seconds of the mover's copies and kernels alone for one store and
    one load of every chunk, between the paged cache and pinned host chunks."""
    mover = engine.mover(kv_cache)
    num_tokens = source_slots.numel()
    chunk_size = engine.token_db.chunk_size
    bounds = [(start, min(start + chunk_size, num_tokens)) for start in range(0, num_tokens, chunk_size)]
    layers, _, _, heads, head_dim = engine.chunk_shape
    host_chunks = [
        torch.empty((layers, 2, end - start, heads, head_dim), dtype=engine.dtype, pin_memory=True)
        for start, end in bounds
    ]
    device_source = mover.to_device(source_slots, for_store=True)
    device_target = mover.to_device(target_slots)
    store_timer = DeviceTimer(mover.store_lane.kernel_stream, mover.store_lane.copy_stream)
    load_timer = DeviceTimer(mover.load_lane.copy_stream, mover.load_lane.kernel_stream)
    mover.wait_for_compute()
    for _ in range(warmup + repeats):
        with store_timer:
            for (start, end), chunk in zip(bounds, host_chunks, strict=True):
                mover.store(kv_cache, device_source[start:end], chunk)
        with load_timer:
            for (start, end), chunk in zip(bounds, host_chunks, strict=True):
                mover.load(chunk, kv_cache, device_target[start:end])
    mover.synchronize()
    flat = kv_cache.flatten(2, 3)
    if not torch.equal(flat[:, :, device_source], flat[:, :, device_target]):
        raise RuntimeError(f"mover round trip differs at {num_tokens} tokens")
    return statistics.median(store_timer.seconds[warmup:]), statistics.median(load_timer.seconds[warmup:])


def bench_size(engine, kv_cache, num_tokens, *, device, warmup, repeats, generator) -> dict:
    num_bytes = num_tokens * engine.bytes_per_token
    source_slots, target_slots = shuffled_slots(num_tokens, kv_cache.shape[2], generator)
    h2d, d2h = copy_baseline(num_bytes, device, warmup, repeats)

    def tokens_for(index: int) -> list[int]:
        # A first token distinct per call *and per size* gives every chunk a new key: the
        # KV here is random, not a function of the tokens, so a key stored by an earlier
        # size (same leading tokens, other slots) would be skipped by the store and hold
        # other KV than this size's source slots.
        return [1_000_000 + 1_000 * num_tokens + index + 1] + list(range(1, num_tokens))

    store_tokens = [tokens_for(index) for index in range(warmup + repeats)]  # built outside the timing
    store = median_seconds(
        lambda i: engine.store(store_tokens[i], kv_caches=kv_cache, slot_mapping=source_slots),
        device,
        warmup,
        repeats,
    )
    tokens = tokens_for(-1)
    engine.store(tokens, kv_caches=kv_cache, slot_mapping=source_slots)
    retrieve = median_seconds(
        lambda _: engine.retrieve(tokens, kv_caches=kv_cache, slot_mapping=target_slots),
        device,
        warmup,
        repeats,
    )

    def lookup_and_retrieve(_: int) -> None:
        if engine.lookup(tokens, pin=True) != num_tokens:
            raise RuntimeError("benchmark chunks were evicted from the CPU tier")
        engine.retrieve(tokens, kv_caches=kv_cache, slot_mapping=target_slots)

    request_path = median_seconds(lookup_and_retrieve, device, warmup, repeats)
    flat = kv_cache.flatten(2, 3)
    if not torch.equal(flat[:, :, source_slots.to(device)], flat[:, :, target_slots.to(device)]):
        raise RuntimeError(f"retrieved KV differs from the stored KV at {num_tokens} tokens")

    row = {
        "tokens": num_tokens,
        "bytes": num_bytes,
        "store_gbps": num_bytes / store / 1e9,
        "store_transfer_gbps": None,
        "d2h_copy_gbps": num_bytes / d2h / 1e9,
        "store_vs_copy": d2h / store,
        "store_transfer_vs_copy": None,
        "retrieve_gbps": num_bytes / retrieve / 1e9,
        "retrieve_transfer_gbps": None,
        "h2d_copy_gbps": num_bytes / h2d / 1e9,
        "retrieve_vs_copy": h2d / retrieve,
        "retrieve_transfer_vs_copy": None,
        "lookup_retrieve_ms": request_path * 1e3,
        "h2d_copy_ms": h2d * 1e3,
        "overhead_ms": (request_path - h2d) * 1e3,
        "overhead_vs_xfer_ms": None,
    }
    if device.type == "cuda":
        store_xfer, load_xfer = transfer_seconds(
            engine, kv_cache, source_slots, target_slots, warmup=warmup, repeats=repeats
        )
        row["store_transfer_gbps"] = num_bytes / store_xfer / 1e9
        row["store_transfer_vs_copy"] = d2h / store_xfer
        row["retrieve_transfer_gbps"] = num_bytes / load_xfer / 1e9
        row["retrieve_transfer_vs_copy"] = h2d / load_xfer
        row["overhead_vs_xfer_ms"] = (request_path - load_xfer) * 1e3
    return row


def figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def figure_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}ms"


def print_table(title: str, rows: list[dict]) -> None:
    print(title)
    header = (
        f"{'tokens':>6} {'MiB':>7} | {'store':>6} {'xfer':>6} {'D2H cp':>6} {'ratio':>9} | "
        f"{'retrieve':>8} {'xfer':>6} {'H2D cp':>6} {'ratio':>9} | {'lookup+ret':>10} {'H2D cp':>8} {'overhead':>8} {'vs xfer':>8}"
    )
    print(header + "\n" + "-" * len(header))
    for row in rows:
        store_ratios = f"{figure(row['store_vs_copy'])}/{figure(row['store_transfer_vs_copy'])}"
        retrieve_ratios = f"{figure(row['retrieve_vs_copy'])}/{figure(row['retrieve_transfer_vs_copy'])}"
        print(
            f"{row['tokens']:>6} {row['bytes'] / 2**20:>7.1f} | {figure(row['store_gbps']):>6} "
            f"{figure(row['store_transfer_gbps']):>6} {figure(row['d2h_copy_gbps']):>6} {store_ratios:>9} | "
            f"{figure(row['retrieve_gbps']):>8} {figure(row['retrieve_transfer_gbps']):>6} "
            f"{figure(row['h2d_copy_gbps']):>6} {retrieve_ratios:>9} | {row['lookup_retrieve_ms']:>8.3f}ms "
            f"{row['h2d_copy_ms']:>6.3f}ms {row['overhead_ms']:>6.3f}ms {figure_ms(row['overhead_vs_xfer_ms']):>8}"
        )
    print(
        "GB/s of the payload. store/retrieve = the whole call; xfer = device time of its copies and kernels "
        "(CUDA only);\nratio = call/xfer against the plain pinned copy; overhead = lookup(pin) + retrieve "
        "- the pinned H2D copy of the same bytes;\nvs xfer = lookup(pin) + retrieve - its own transfer (the "
        "host-side path: hashing, tier reads, pins, bookkeeping)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes on CPU (smoke test)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per figure")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="token counts")
    args = parser.parse_args()

    if args.quick:
        device, shape, sizes, repeats = torch.device("cpu"), QUICK_SHAPE, QUICK_SIZES, 5
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (use --quick for the CPU smoke test)")
        device, shape, sizes, repeats = torch.device("cuda"), FULL_SHAPE, FULL_SIZES, 20
    sizes = tuple(args.sizes or sizes)
    repeats = args.repeats or repeats
    max_tokens = max(sizes)
    num_blocks = 2 * max_tokens // BLOCK_SIZE + 16

    element_size = torch.empty((), dtype=shape["dtype"]).element_size()
    bytes_per_token = shape["num_layers"] * 2 * shape["num_kv_heads"] * shape["head_dim"] * element_size
    config = OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=2 * (max_tokens + CHUNK_SIZE) * bytes_per_token)
    engine = create_cache_engine(config, model_id="benchmark", device=device, **shape)
    kv_cache = torch.randn(
        (shape["num_layers"], 2, num_blocks, BLOCK_SIZE, shape["num_kv_heads"], shape["head_dim"]),
        device=device,
    ).to(shape["dtype"])
    generator = torch.Generator().manual_seed(0)
    rows = [
        bench_size(engine, kv_cache, n, device=device, warmup=3, repeats=repeats, generator=generator)
        for n in sizes
    ]
    engine.tiers.close()

    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    )
    title = (
        f"offload transfer on {device_name}: {shape['num_layers']} layers, {shape['num_kv_heads']} KV heads, "
        f"head_dim {shape['head_dim']}, {shape['dtype']}, block {BLOCK_SIZE}, chunk {CHUNK_SIZE}"
    )
    print_table(title, rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "device": device_name,
            "torch": torch.__version__,
            "shape": {
                **shape,
                "dtype": str(shape["dtype"]),
                "block_size": BLOCK_SIZE,
                "chunk_size": CHUNK_SIZE,
            },
            "repeats": repeats,
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
