"""Model identity cost: hashing every weight byte (XXH3-128) on a cold start, and a restart
that finds every file in the weight hash cache.

Writes a checkpoint folder of ``--mib`` MiB of random safetensors weights (split into
``--files`` files, like a sharded checkpoint), then times ``model_fingerprint`` three ways:
cold (empty cache, every byte hashed, page cache warm from the write), cached (a new
``WeightHashCache`` over the same folder: no weight byte read), and the XXH3-128 rate of
one file alone. Prints a table; ``--out`` writes JSON.

    .venv/bin/python benchmarks/fingerprint.py --mib 1024 --out bench-out/fingerprint.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from engine.models.fingerprint import WeightHashCache, file_digest, model_fingerprint  # noqa: E402

MIB = 1 << 20


def make_checkpoint(folder: Path, total_mib: int, num_files: int) -> None:
    (folder / "config.json").write_text('{"model_type": "llama"}')
    generator = torch.Generator().manual_seed(0)
    per_file = total_mib * MIB // num_files // 2  # bf16 elements
    for index in range(num_files):
        weights = {"w": torch.randn(per_file, generator=generator).to(torch.bfloat16)}
        save_file(weights, str(folder / f"model-{index:05d}-of-{num_files:05d}.safetensors"))


def best_of(repeats: int, call) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB")
    parser.add_argument("--files", type=int, default=4, help="safetensors files it is split into")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvstash-fingerprint-") as workdir:
        folder = Path(workdir) / "model"
        folder.mkdir()
        make_checkpoint(folder, args.mib, args.files)
        num_bytes = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
        cache_dir = Path(workdir) / "cache"

        def cold() -> None:
            (cache_dir / "weight_hashes.json").unlink(missing_ok=True)
            model_fingerprint(folder, WeightHashCache(cache_dir))

        cold_s = best_of(args.repeats, cold)
        warm_cache = WeightHashCache(cache_dir)
        cached_s = best_of(args.repeats, lambda: model_fingerprint(folder, WeightHashCache(cache_dir)))
        model_fingerprint(folder, warm_cache)
        assert warm_cache.num_files_hashed == 0, "the cached run read weight bytes"
        one_file = next(folder.glob("*.safetensors"))
        one_file_s = best_of(args.repeats, lambda: file_digest(one_file))
        one_file_bytes = one_file.stat().st_size

    rows = [
        {"case": "cold start (every byte hashed)", "seconds": cold_s, "gb_per_s": num_bytes / cold_s / 1e9},
        {"case": "restart (weight hash cache)", "seconds": cached_s, "gb_per_s": None},
        {
            "case": "XXH3-128 of one file",
            "seconds": one_file_s,
            "gb_per_s": one_file_bytes / one_file_s / 1e9,
        },
    ]
    print(f"checkpoint: {num_bytes / MIB:.0f} MiB in {args.files} files, best of {args.repeats}")
    print(f"{'case':<34} {'ms':>10} {'GB/s':>8}")
    for row in rows:
        rate = f"{row['gb_per_s']:.2f}" if row["gb_per_s"] is not None else "-"
        print(f"{row['case']:<34} {row['seconds'] * 1e3:>10.2f} {rate:>8}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "fingerprint",
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
            "settings": vars(args) | {"out": str(args.out)},
            "checkpoint_bytes": num_bytes,
            "rows": rows,
        }
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
