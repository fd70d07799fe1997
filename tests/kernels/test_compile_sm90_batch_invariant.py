"""The deterministic mode's GEMM and RMSNorm compile for an H100 (sm_90) without a GPU:
the bf16 GEMM runs on Hopper tensor cores (wgmma) with a 3-stage shared-memory pipeline,
within the H100's shared memory and without spills; so does every candidate tile of
benchmarks/gemm_configs.py. Compiled in a subprocess
(tests/kernels/sm90_compile_batch_invariant.py)."""

from __future__ import annotations

import pytest

from kernels.matmul import CANDIDATE_TILES_16BIT, CANDIDATE_TILES_FP32
from tests.sm90_compile_runner import H100_SHARED_MEMORY_BYTES, requires_sm90_tools, sm90_compile_rows

pytestmark = requires_sm90_tools


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    rows = sm90_compile_rows("tests.kernels.sm90_compile_batch_invariant")
    return {row["name"]: row for row in rows}


def test_every_configuration_compiled(results):
    assert len(results) == 4 + len(CANDIDATE_TILES_16BIT) + len(CANDIDATE_TILES_FP32) + 3 + 6 + 1


def test_candidate_tiles_use_wgmma_from_64_rows_and_mma_sync_below(results):
    """benchmarks/gemm_configs.py's bit-identity proofs cover wgmma m64nNk16 of several N, and
    one mma.sync tile (the 32-row probe): the instruction is the one thing a tile may change."""
    candidates = [row for row in results.values() if row.get("candidate") and " bf16 " in f" {row['name']} "]
    assert len(candidates) == len(CANDIDATE_TILES_16BIT)
    for row in candidates:
        if row["block_m"] >= 64:
            assert row["wgmma"] > 0 and all(shape.startswith("m64n") for shape in row["mma_shapes"]), row
        else:
            assert row["wgmma"] == 0 and row["mma_shapes"] == ["m16n8k16"], row


@pytest.mark.parametrize("name", ["linear bf16", "linear bf16 bias"])
def test_bf16_gemm_uses_wgmma_and_a_pipeline(results, name):
    row = results[name]
    assert row["wgmma"] > 0, row
    # three stages of a 128x64 and a 64x128 bf16 tile
    assert row["shared"] >= 3 * 2 * 128 * 64 * 2, row
    assert row["shared"] <= H100_SHARED_MEMORY_BYTES and row["stack"] <= 64, row


def test_nothing_spills(results):
    for row in results.values():
        assert row["shared"] <= H100_SHARED_MEMORY_BYTES and row["stack"] <= 64 and row["local"] == 0, row
