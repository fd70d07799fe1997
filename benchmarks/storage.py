"""Storage tiers: put/get MB/s per backend, raw redis-py SET/GET as the baseline, lz4 on real KV.

For each value size (256 KiB, 2 MiB, 8 MiB of bf16 KV) and each tier (cpu, disk,
redis, redis-cluster), one client thread puts distinct keys one call at a time,
then gets them back (checksum verified, tensor decoded). In the same run raw
redis-py ``SET``/``GET`` of equally large byte strings on the same redis-server
give the baseline that the Redis tier's overhead (encoding, checksums, decoding)
is measured against. The script starts its own redis-server and 3-node cluster.

The lz4 section runs a tiny random-weight model (``bench.tiny_model``) with
transformers in bf16, takes its ``past_key_values`` as a ``[layers, 2, tokens,
kv_heads, head_dim]`` chunk and reports the compression ratio and MB/s.

    .venv/bin/python benchmarks/storage.py --out bench-out/storage.json

``--disk`` adds the disk tier against the raw device, cold (``benchmarks/disk_tier.py``):
read rate of 8B-shaped 32 MiB chunks into page-aligned (pinned with CUDA) slots vs
O_DIRECT reads of the same files and ``dd``, write rate, and the start-up time of
10,000 chunk files from the index and by a full scan; ``--disk-only`` runs just that,
``--disk-dir`` puts the files on the device under test:

    .venv/bin/python benchmarks/storage.py --disk-only --disk-dir /mnt/nvme/kvstash-bench --out bench-out/disk.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from storage_backends import KVChunk, create_backend, decode_chunk, encode_chunk  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = (256 * KIB, 2 * MIB, 8 * MIB)
# Llama-3-8B-like per-layer KV shape (8 KV heads x 128 dims, bf16), 4 layers: 16 KiB per token.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 4, 8, 128
BYTES_PER_TOKEN = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 2
BYTES_PER_SIZE_RUN = 64 * MIB  # data moved per (tier, size, repeat)


def make_chunk(num_bytes: int, seed: int) -> KVChunk:
    """A bf16 chunk of ``num_bytes`` with random bits (incompressible, like the worst case)."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = num_bytes // BYTES_PER_TOKEN
    raw = torch.randint(0, 256, (num_tokens * BYTES_PER_TOKEN,), dtype=torch.uint8, generator=generator)
    return KVChunk(raw.view(torch.bfloat16).reshape(NUM_LAYERS, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM))


def mb_per_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e6


def time_calls(calls: list[Callable[[], object]]) -> float:
    started = time.perf_counter()
    for call in calls:
        call()
    return time.perf_counter() - started


def measure_tier(
    name: str,
    put_many: Callable[[list[tuple[str, object]]], object],
    get_many: Callable[[list[str]], list[object]],
    value: object,
    size: int,
    repeats: int,
    check: Callable[[object], bool],
    batch: int = 1,
) -> dict:
    """Best and median put and get MB/s over ``repeats`` runs of distinct keys, ``batch`` values
    per call, after one warm-up run that is not counted (first-touch page faults, connection
    set-up). The best run is the one that other work on a shared machine disturbed least."""
    num_values = max(4, BYTES_PER_SIZE_RUN // size) // batch * batch
    put_rates, get_rates = [], []
    for repeat in range(-1, repeats):
        keys = [f"bench:{size}:{repeat}:{i}" for i in range(num_values)]
        key_batches = [keys[i : i + batch] for i in range(0, num_values, batch)]
        started = time.perf_counter()
        for key_batch in key_batches:
            put_many([(key, value) for key in key_batch])
        put_seconds = time.perf_counter() - started
        started = time.perf_counter()
        results = [result for key_batch in key_batches for result in get_many(key_batch)]
        get_seconds = time.perf_counter() - started
        if len(results) != num_values or not all(check(result) for result in results):
            raise RuntimeError(f"{name}: a value read back differs from the one written")
        if repeat >= 0:
            put_rates.append(mb_per_s(size * num_values, put_seconds))
            get_rates.append(mb_per_s(size * num_values, get_seconds))
    return {
        "tier": name,
        "value_bytes": size,
        "values_per_call": batch,
        "num_values": num_values,
        "put_MBps": round(max(put_rates), 1),
        "get_MBps": round(max(get_rates), 1),
        "put_MBps_median": round(statistics.median(put_rates), 1),
        "get_MBps_median": round(statistics.median(get_rates), 1),
    }


def raw_redis_calls(client: object, batch: int) -> tuple[Callable, Callable]:
    """redis-py SET/GET of bytes: one command per call, or ``batch`` per pipelined round trip."""
    if batch == 1:
        return (lambda items: client.set(*items[0])), (lambda keys: [client.get(keys[0])])

    def set_many(items: list[tuple[str, bytes]]) -> None:
        pipe = client.pipeline(transaction=False)
        for key, data in items:
            pipe.set(key, data)
        pipe.execute()

    def get_many(keys: list[str]) -> list[bytes]:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    return set_many, get_many


def run_tiers(sizes: list[int], repeats: int, batch: int, workdir: str) -> list[dict]:
    from benchmarks.support.redis_process import RedisClusterProcess, RedisServerProcess

    rows: list[dict] = []
    have_redis = shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None
    if not have_redis:
        print("redis-server not found: the redis rows are skipped", file=sys.stderr)
    server = RedisServerProcess().start() if have_redis else None
    cluster = RedisClusterProcess().start() if have_redis else None
    try:
        for size in sizes:
            chunk = make_chunk(size, seed=size)
            encoded = encode_chunk(chunk, key="bench:raw")

            def same_chunk(result: KVChunk | None, chunk: KVChunk = chunk) -> bool:
                return result is not None and result.equal(chunk)

            def same_bytes(result: bytes | None, encoded: bytes = encoded) -> bool:
                return result == encoded

            # Later runs evict earlier ones: the steady state of a full tier.
            capacity = 2 * BYTES_PER_SIZE_RUN
            tier_urls = {
                "cpu": f"cpu://?capacity={capacity}&slot_bytes={size}",
                "disk": f"file://{workdir}/disk-{size}?capacity={capacity}",
                "disk fsync=1": f"file://{workdir}/disk-fsync-{size}?capacity={capacity}&fsync=1",
            }
            if server is not None:
                tier_urls["redis"] = server.url
                tier_urls["redis-cluster"] = cluster.url
            for name, url in tier_urls.items():
                backend = create_backend(url)
                batches = (1, batch) if name.startswith("redis") and batch > 1 else (1,)
                for values_per_call in batches:
                    label = name if values_per_call == 1 else f"{name} x{values_per_call} pipelined"
                    rows.append(
                        measure_tier(
                            label, backend.put_many, backend.get_many, chunk, size, repeats, same_chunk,
                            values_per_call,
                        )
                    )  # fmt: skip
                    if server is not None:
                        server.flushall()
                        cluster.flushall()
                backend.close()
            if server is not None:
                import redis

                client = redis.Redis(port=server.port)
                for values_per_call in (1, batch) if batch > 1 else (1,):
                    label = "raw redis-py SET/GET" + (
                        "" if values_per_call == 1 else f" x{values_per_call} pipelined"
                    )
                    set_many, get_many = raw_redis_calls(client, values_per_call)
                    rows.append(
                        measure_tier(
                            label, set_many, get_many, encoded, size, repeats, same_bytes, values_per_call
                        )
                    )
                    server.flushall()
                client.close()
            rows.append(measure_codec("encode/decode (codec none)", chunk, "none", repeats))
    finally:
        if server is not None:
            server.close()
            cluster.close()
    return rows


def measure_codec(name: str, chunk: KVChunk, codec: str, repeats: int) -> dict:
    """Serialization alone: best encode and decode MB/s (of uncompressed bytes) and the size ratio."""
    encoded = encode_chunk(chunk, codec, key="bench:codec")
    num_calls = max(2, BYTES_PER_SIZE_RUN // max(chunk.nbytes, 1) // 4)
    encode_rates, decode_rates = [], []
    for _ in range(repeats):
        encode_rates.append(
            mb_per_s(
                chunk.nbytes * num_calls,
                time_calls([lambda: encode_chunk(chunk, codec, key="bench:codec")] * num_calls),
            )
        )
        decode_rates.append(
            mb_per_s(
                chunk.nbytes * num_calls,
                time_calls([lambda: decode_chunk(encoded, key="bench:codec")] * num_calls),
            )
        )
    if not decode_chunk(encoded, key="bench:codec").equal(chunk):
        raise RuntimeError(f"{name}: decode(encode(x)) differs from x")
    return {
        "tier": name,
        "value_bytes": chunk.nbytes,
        "put_MBps": round(max(encode_rates), 1),
        "get_MBps": round(max(decode_rates), 1),
        "ratio": round(chunk.nbytes / len(encoded), 3),
    }


def model_kv_chunk(num_tokens: int, workdir: str) -> tuple[KVChunk, str]:
    """KV of a real forward pass of the tiny model in bf16, as one [layers, 2, tokens, heads, dim] chunk."""
    from transformers import AutoModelForCausalLM

    from bench.tiny_model import TINY_VOCAB_SIZE, make_tiny_model

    model_dir = make_tiny_model(Path(workdir) / "tiny-llama", arch="llama")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    token_ids = torch.randint(5, TINY_VOCAB_SIZE, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(token_ids, use_cache=True).past_key_values
    if hasattr(cache, "layers"):  # transformers >= 4.56: one object per layer
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    # [batch=1, kv_heads, tokens, head_dim] per layer -> [layers, 2, tokens, kv_heads, head_dim]
    stacked = torch.stack([torch.stack([k[0], v[0]]) for k, v in pairs]).transpose(2, 3).contiguous()
    config = model.config
    description = (
        f"tiny llama (random weights): {config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads, "
        f"head_dim {stacked.shape[-1]}, {num_tokens} tokens"
    )
    return KVChunk(stacked), description


def run_lz4(repeats: int, workdir: str) -> tuple[list[dict], str]:
    chunk, description = model_kv_chunk(4096, workdir)
    random_bits = KVChunk(
        torch.randint(0, 256, (chunk.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        .view(torch.bfloat16)
        .reshape(chunk.tensor.shape)
    )
    rows = [
        measure_codec("model KV, codec none", chunk, "none", repeats),
        measure_codec("model KV, codec lz4", chunk, "lz4", repeats),
        measure_codec("random bf16 bits, codec lz4", random_bits, "lz4", repeats),
    ]
    return rows, description


def print_table(title: str, rows: list[dict], put_label: str, get_label: str) -> None:
    print(f"\n{title}")
    print(f"{'tier':<36} {'value':>9} {put_label:>14} {get_label:>14} {'ratio':>7}")
    for row in rows:
        size = row["value_bytes"]
        size_text = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else ""
        print(
            f"{row['tier']:<36} {size_text:>9} {row['put_MBps']:>14.1f} {row['get_MBps']:>14.1f} {ratio:>7}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="value sizes in bytes"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per measurement (the best is in the table, the median in the JSON too)",
    )
    parser.add_argument(
        "--batch", type=int, default=8, help="values per pipelined call in the Redis batch rows"
    )
    parser.add_argument("--skip-lz4", action="store_true", help="skip the model run and lz4 section")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--disk", action="store_true", help="add the cold disk-tier vs raw-device section")
    parser.add_argument("--disk-only", action="store_true", help="run only the disk-tier section")
    parser.add_argument(
        "--disk-dir", type=Path, help="folder for the disk section's files (default: under the temp dir)"
    )
    parser.add_argument("--disk-gib", type=float, default=2.0, help="GiB read and written per disk run")
    parser.add_argument(
        "--io-threads", type=int, default=16, help="disk tier io_threads (and raw-read threads)"
    )
    parser.add_argument("--index-files", type=int, default=10_000, help="chunk files for the start-up test")
    args = parser.parse_args()
    for size in args.sizes:
        if size < BYTES_PER_TOKEN or size % BYTES_PER_TOKEN:
            parser.error(
                f"--sizes: {size} is not a positive multiple of {BYTES_PER_TOKEN} bytes (one token of KV)"
            )

    tier_rows, lz4_rows, model_description, disk = [], [], "", None
    with tempfile.TemporaryDirectory(prefix="kvstash-bench-storage-") as workdir:
        if not args.disk_only:
            tier_rows = run_tiers(args.sizes, args.repeats, args.batch, workdir)
            print_table(
                "Put/get throughput, one client thread (MB/s of KV, best run)",
                tier_rows,
                "put MB/s",
                "get MB/s",
            )
            lz4_rows, model_description = ([], "") if args.skip_lz4 else run_lz4(args.repeats, workdir)
            if lz4_rows:
                print_table(f"Codecs on {model_description}", lz4_rows, "encode MB/s", "decode MB/s")
        if args.disk or args.disk_only:
            from benchmarks.disk_tier import print_disk, run_disk_rates, run_index_startup

            disk_root = args.disk_dir or Path(workdir)
            rows, facts = run_disk_rates(
                disk_root / "rates", int(args.disk_gib * (1 << 30)), args.io_threads, args.repeats
            )
            startup = run_index_startup(disk_root / "startup", args.index_files, args.repeats)
            print_disk(rows, facts, startup)
            disk = {"rows": rows, **facts, "startup": startup, "folder": str(disk_root)}

    result = {
        "benchmark": "storage",
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work shares these cores
        },
        "kv_shape_per_token": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "tiers": tier_rows,
        "codecs": lz4_rows,
        "codec_model": model_description,
        "disk": disk,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
