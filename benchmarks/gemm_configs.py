"""Which tiles may the batch-invariant GEMM use? Speed against cuBLAS, and bit-identity proofs.

For every candidate tile of kernels/matmul.py (CANDIDATE_TILES_16BIT; same BLOCK_K as the
baseline, so the same order of K in the source program), on the GPU:

1. bit-identity: on the 8B's projection shapes (qkv with a bias, o_proj, gate_up, down,
   and the LM head), rows x[:M] through the candidate against the same rows of the baseline tile
   (kernels.matmul.BASELINE_TILES) run on all 8192 rows, at M in 1, 7, 64, 300, 512, 8192
   (the LM head up to 300), in bf16 and fp16. A candidate is "bit_identical" only if every
   element of every one of those matches: then its rows are the baseline's whatever M,
   so a plan may switch between such tiles by M without changing a bit. The float32
   candidates are checked the same way on the qkv and down shapes.
2. speed: TFLOP/s of each candidate and of cuBLAS (torch.nn.functional.linear), bf16, on
   qkv / o_proj / gate_up / down at M in 16, 64, 256, 512, 2048, 8192 and the LM head at 16, 64,
   256 (triton.testing.do_bench: L2 flushed between calls, median).

It then suggests, per M bucket and N band, the fastest bit-identical tile (geometric mean
over the layers there), prints it as the PROVEN_TILE_PLANS entry for kernels/matmul.py,
and the ratios to cuBLAS of the baseline tile, of the plan kernels/matmul.py uses now
("active", USE_TILE_PLAN) and of the suggested one. A tile that fails
to compile or run is reported with its error and never suggested.

    python benchmarks/gemm_configs.py --out gemm_configs.json          # H100, about 3 minutes
    python benchmarks/gemm_configs.py --quick --out /tmp/gemm.json    # fewer shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import matmul  # noqa: E402

#: (layer, K, N, has bias in the identity check): Llama-3.1-8B's projections and LM head
LAYERS = (
    ("qkv", 4096, 6144, True),
    ("o_proj", 4096, 4096, False),
    ("gate_up", 4096, 28672, False),
    ("down", 14336, 4096, False),
    ("lm_head", 4096, 128256, False),
)
IDENTITY_ROWS = (1, 7, 64, 300, 512, 8192)
LM_HEAD_MAX_ROWS = 300
TIMED_ROWS = (16, 64, 256, 512, 2048, 8192)
LM_HEAD_TIMED_ROWS = (16, 64, 256)
#: bucket bounds of the suggested plan (the timed row counts; the last bucket is open)
BUCKETS = TIMED_ROWS
#: column bands of the suggested plan (o_proj and down: 4096; qkv: 6144; gate_up, LM head: wider)
COLUMN_BANDS = (4096, 8192, None)


def _random(shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=generator, dtype=torch.float32) * scale).to(dtype)


def check_identity(tiles, baseline, dtype, layers, rows_list) -> dict[str, dict]:
    """tile name -> {"bit_identical": bool, "mismatches": [...], "error": str | None}."""
    results = {tile.name: {"bit_identical": True, "mismatches": [], "error": None} for tile in tiles}
    for layer, k, n, has_bias in layers:
        max_rows = LM_HEAD_MAX_ROWS if layer == "lm_head" else max(rows_list)
        x = _random((max_rows, k), dtype, seed=1)
        weight = _random((n, k), dtype, seed=2, scale=k**-0.5)
        bias = _random((n,), dtype, seed=3) if has_bias else None
        reference = matmul.linear(x, weight, bias, tile=baseline)
        for tile in tiles:
            result = results[tile.name]
            if result["error"]:
                continue
            for num_rows in rows_list:
                if num_rows > max_rows:
                    continue
                try:
                    got = matmul.linear(x[:num_rows], weight, bias, tile=tile)
                except Exception as error:  # a tile that does not compile or run here
                    result.update(bit_identical=False, error=f"{type(error).__name__}: {error}"[:2000])
                    traceback.print_exc()
                    break
                same = got == reference[:num_rows]
                if not bool(same.all()):
                    result["bit_identical"] = False
                    result["mismatches"].append(
                        {
                            "layer": layer,
                            "m": num_rows,
                            "num_differing_elements": int((~same).sum()),
                            "max_abs_diff": float((got.float() - reference[:num_rows].float()).abs().max()),
                        }
                    )
        del x, weight, bias, reference
        torch.cuda.empty_cache()
    return results


def tflops(fn, m: int, k: int, n: int) -> float:
    from triton.testing import do_bench

    milliseconds = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return 2 * m * k * n / (milliseconds * 1e-3) / 1e12


def time_tiles(tiles, failed: set[str], quick: bool) -> list[dict]:
    """Rows {layer, m, k, n, cublas, <tile name>: TFLOP/s, ...}, bf16."""
    rows = []
    for layer, k, n, _ in LAYERS:
        weight = _random((n, k), torch.bfloat16, seed=4, scale=k**-0.5)
        ms = LM_HEAD_TIMED_ROWS if layer == "lm_head" else TIMED_ROWS
        if quick:
            ms = tuple(m for m in ms if m in (64, 512, 8192)) or ms[:1]
        for m in ms:
            x = _random((m, k), torch.bfloat16, seed=5)
            row = {"layer": layer, "m": m, "k": k, "n": n}
            row["cublas"] = tflops(lambda x=x, w=weight: torch.nn.functional.linear(x, w), m, k, n)
            for tile in tiles:
                if tile.name in failed:
                    continue
                try:
                    row[tile.name] = tflops(
                        lambda x=x, w=weight, t=tile: matmul.linear(x, w, tile=t), m, k, n
                    )
                except Exception:
                    traceback.print_exc()
                    failed.add(tile.name)
            rows.append(row)
            print(
                f"{layer:>8} M {m:>5}: cuBLAS {row['cublas']:6.0f}  "
                + "  ".join(f"{name.split(' g')[0]}{' P' if 'persistent' in name else ''}"
                            f"{' T' if 'tma' in name else ''} {value:5.0f}"
                            for name, value in row.items() if isinstance(value, float) and name != "cublas"),
                flush=True,
            )  # fmt: skip
            del x
        del weight
        torch.cuda.empty_cache()
    return rows


def bucket_of(m: int) -> int:
    for bound in BUCKETS:
        if m <= bound:
            return bound
    return BUCKETS[-1]


def band_of(n: int) -> int | None:
    return next(bound for bound in COLUMN_BANDS if bound is None or n <= bound)


def suggest_plan(timings: list[dict], allowed: list[str]) -> list[tuple[int | None, int | None, str]]:
    """[(max_rows, max_cols, tile name)], kernels.matmul.TileRule's order: per row bucket and
    column band, the allowed tile of best geometric-mean TFLOP/s over the layers timed
    there; neighbours with the same tile merged; the last rule covers every size."""
    rules: list[tuple[int | None, int | None, str]] = []
    measured_buckets = [bound for bound in BUCKETS if any(bucket_of(r["m"]) == bound for r in timings)]
    for bucket_index, bound in enumerate(measured_buckets):
        max_rows = None if bucket_index == len(measured_buckets) - 1 else bound
        bucket_rules: list[tuple[int | None, int | None, str]] = []
        for band in COLUMN_BANDS:
            rows = [r for r in timings if bucket_of(r["m"]) == bound and band_of(r["n"]) == band]
            if not rows:
                continue

            def score(name: str, rows=rows) -> float:
                values = [r.get(name) for r in rows]
                if any(v is None for v in values):
                    return -1.0
                return math.exp(sum(math.log(v) for v in values) / len(values))

            best = max(allowed, key=score)
            if bucket_rules and bucket_rules[-1][2] == best:
                bucket_rules[-1] = (max_rows, band, best)
            else:
                bucket_rules.append((max_rows, band, best))
        if bucket_rules:  # the widest band measured covers every wider N
            bucket_rules[-1] = (max_rows, None, bucket_rules[-1][2])
        for rule in bucket_rules:
            previous = rules[-1] if rules else None
            if previous and len(bucket_rules) == 1 and previous[1] is None and previous[2] == rule[2]:
                rules[-1] = rule  # one tile for every N here, as in the bucket before: widen that rule
            else:
                rules.append(rule)
    return rules


def plan_source(rules: list[tuple[int | None, int | None, str]], tiles_by_name: dict) -> str:
    """The PROVEN_TILE_PLANS entry (bf16 and fp16 alike) for kernels/matmul.py."""
    lines = []
    for max_rows, max_cols, name in rules:
        tile = tiles_by_name[name]
        fields = ", ".join(f"{f.name}={getattr(tile, f.name)!r}" for f in dataclasses.fields(tile))
        lines.append(f"        TileRule({max_rows}, {max_cols}, GemmTile({fields})),")
    plan = "TilePlan((\n" + "\n".join(lines) + "\n    ))"
    return (
        "PROVEN_TILE_PLANS: dict[torch.dtype, TilePlan] = {\n"
        f"    torch.bfloat16: {plan},\n    torch.float16: {plan},\n}}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="time M 64, 512, 8192 only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    import triton

    started = time.perf_counter()
    report: dict = {
        "benchmark": "gemm_configs",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "baseline": {str(dtype): tile.name for dtype, tile in matmul.BASELINE_TILES.items()},
        "complete": False,
    }

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    tiles_16 = matmul.CANDIDATE_TILES_16BIT
    identity: dict[str, dict] = {}
    for dtype in (torch.bfloat16, torch.float16):
        print(
            f"bit-identity, {dtype}: {len(tiles_16)} tiles x {len(LAYERS)} shapes x M {IDENTITY_ROWS}",
            flush=True,
        )
        identity[str(dtype)] = check_identity(
            tiles_16, matmul.BASELINE_TILES[dtype], dtype, LAYERS, IDENTITY_ROWS
        )
        report["identity"] = identity
        save()
    fp32_layers = [layer for layer in LAYERS if layer[0] in ("qkv", "down")]
    print("bit-identity, torch.float32", flush=True)
    identity[str(torch.float32)] = check_identity(
        matmul.CANDIDATE_TILES_FP32,
        matmul.BASELINE_TILES[torch.float32],
        torch.float32,
        fp32_layers,
        IDENTITY_ROWS,
    )
    report["identity"] = identity
    save()
    for dtype_name, results in identity.items():
        for name, result in results.items():
            status = (
                "bit-identical"
                if result["bit_identical"]
                else (
                    f"ERROR {result['error'][:120]}"
                    if result["error"]
                    else f"DIFFERS {result['mismatches'][:3]}"
                )
            )
            print(f"{dtype_name:>15} {name:<40} {status}", flush=True)

    failed = {name for name, r in identity[str(torch.bfloat16)].items() if r["error"]}
    timings = time_tiles(tiles_16, failed, args.quick)
    report["timings_bf16_tflops"] = timings
    save()

    # Allowed in a plan: bit-identical in both 16-bit dtypes, timed everywhere.
    allowed = [
        tile.name
        for tile in tiles_16
        if identity[str(torch.bfloat16)][tile.name]["bit_identical"]
        and identity[str(torch.float16)][tile.name]["bit_identical"]
        and tile.name not in failed
    ]
    baseline_name = matmul.BASELINE_TILES[torch.bfloat16].name
    rules = suggest_plan(timings, allowed) if allowed else [(None, None, baseline_name)]
    tiles_by_name = {tile.name: tile for tile in tiles_16}
    suggested = matmul.TilePlan(tuple(matmul.TileRule(r, c, tiles_by_name[name]) for r, c, name in rules))
    report["allowed_tiles"] = allowed
    report["suggested_plan"] = [{"max_rows": r, "max_cols": c, "tile": name} for r, c, name in rules]
    report["suggested_plan_source"] = plan_source(rules, tiles_by_name)

    print(
        f"\n{'layer':>8} {'M':>5} {'cuBLAS':>7} {'baseline':>9} {'ratio':>6} {'active':>7} {'ratio':>6} "
        f"{'suggest':>7} {'ratio':>6}  suggested tile"
    )
    summary = []
    for row in timings:
        active_name = matmul.tile_for(torch.bfloat16, row["m"], row["n"]).name
        suggested_name = suggested.tile_for(row["m"], row["n"]).name
        values = {
            "baseline": row.get(baseline_name, float("nan")),
            "active_plan": row.get(active_name, float("nan")),
            "suggested": row.get(suggested_name, float("nan")),
        }
        summary.append(
            {
                "layer": row["layer"],
                "m": row["m"],
                "cublas_tflops": row["cublas"],
                "active_plan_tile": active_name,
                "suggested_tile": suggested_name,
                **{f"{key}_tflops": value for key, value in values.items()},
                **{f"{key}_ratio": value / row["cublas"] for key, value in values.items()},
            }
        )
        cells = [
            f"{value:>{width}.0f} {value / row['cublas']:>6.2f}"
            for value, width in zip(values.values(), (9, 7, 7), strict=True)
        ]
        print(f"{row['layer']:>8} {row['m']:>5} {row['cublas']:>7.0f} {' '.join(cells)}  {suggested_name}")
    report["summary"] = summary
    report["seconds"] = time.perf_counter() - started
    report["complete"] = True
    save()
    print(f"\nbit-identical to the baseline in bf16 and fp16: {len(allowed)} of {len(tiles_16)} tiles")
    print("suggested kernels/matmul.py entry ('active': the plan kernels/matmul.py uses now):")
    print(report["suggested_plan_source"])
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
