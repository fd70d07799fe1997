"""benchmarks/gemm_configs.py's plan suggestion (its GPU part runs on an H100 only): per row
bucket and column band the fastest bit-identical tile, as rules kernels/matmul.py accepts,
and a printed PROVEN_TILE_PLANS entry that is valid Python."""

from __future__ import annotations

import torch

from benchmarks import gemm_configs
from kernels import matmul

SMALL = matmul.GemmTile(64, 32, 64, 4, 6)
NARROW = matmul.GemmTile(64, 128, 64, 4, 4, tma=True)
BIG = matmul.GemmTile(128, 256, 64, 8, 3, persistent=True, tma=True)
UNPROVEN = matmul.GemmTile(128, 128, 64, 8, 4)


def _timings() -> list[dict]:
    """TFLOP/s where SMALL wins at 64 rows, NARROW for N <= 4096 at 512 rows, BIG elsewhere;
    UNPROVEN is fastest everywhere but not bit-identical (not allowed)."""
    rows = []
    for layer, n in (("down", 4096), ("qkv", 6144), ("gate_up", 28672)):
        for m in (64, 512, 8192):
            rows.append(
                {
                    "layer": layer,
                    "m": m,
                    "n": n,
                    "cublas": 100.0,
                    UNPROVEN.name: 1000.0,
                    SMALL.name: 90.0 if m == 64 else 10.0,
                    NARROW.name: 80.0 if m == 512 and n <= 4096 else 20.0,
                    BIG.name: 70.0 if m > 64 else 5.0,
                }
            )
    return rows


def test_the_suggestion_takes_the_fastest_allowed_tile_per_rows_and_columns():
    rules = gemm_configs.suggest_plan(_timings(), [SMALL.name, NARROW.name, BIG.name])
    assert rules == [(64, None, SMALL.name), (512, 4096, NARROW.name), (None, None, BIG.name)]
    plan = matmul.TilePlan(
        tuple(
            matmul.TileRule(r, c, t)
            for r, c, t in ((64, None, SMALL), (512, 4096, NARROW), (None, None, BIG))
        )
    )
    assert plan.tile_for(512, 28672) == BIG and plan.tile_for(300, 4096) == NARROW


def test_the_printed_entry_is_a_valid_plan():
    rules = gemm_configs.suggest_plan(_timings(), [SMALL.name, NARROW.name, BIG.name])
    source = gemm_configs.plan_source(rules, {tile.name: tile for tile in (SMALL, NARROW, BIG)})
    namespace = {
        "torch": torch,
        "TilePlan": matmul.TilePlan,
        "TileRule": matmul.TileRule,
        "GemmTile": matmul.GemmTile,
    }
    exec(source, namespace)
    plans = namespace["PROVEN_TILE_PLANS"]
    assert set(plans) == {torch.bfloat16, torch.float16}
    assert plans[torch.bfloat16].tiles == (SMALL, NARROW, BIG)
