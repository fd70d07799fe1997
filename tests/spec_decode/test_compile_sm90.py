"""The rejection sampler compiles for an H100 (sm_90) without a GPU, without spills and
with IEEE division (the CPU interpreter accepts code that real compilation rejects)."""

from __future__ import annotations

from pathlib import Path

import pytest
import triton

from tests.sm90_compile_runner import sm90_compile_rows

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

pytestmark = pytest.mark.skipif(
    not (NVIDIA_BIN / "ptxas").exists() or not (NVIDIA_BIN / "cuobjdump").exists(),
    reason="Triton's bundled ptxas/cuobjdump are missing",
)


def test_rejection_sampler_compiles_for_h100_without_spills():
    rows = sm90_compile_rows("tests.spec_decode.sm90_compile")
    assert len(rows) == 4
    for row in rows:
        assert row["stack"] == 0 and row["local"] == 0, row
        assert row["approx_divisions"] == 0, row
