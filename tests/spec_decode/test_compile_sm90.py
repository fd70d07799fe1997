"""The rejection sampler compiles for an H100 (sm_90) without a GPU, without spills and
with IEEE division (the CPU interpreter accepts code that real compilation rejects)."""

from __future__ import annotations

from tests.sm90_compile_runner import requires_sm90_tools, sm90_compile_rows

pytestmark = requires_sm90_tools


def test_rejection_sampler_compiles_for_h100_without_spills():
    rows = sm90_compile_rows("tests.spec_decode.sm90_compile")
    assert len(rows) == 4
    for row in rows:
        assert row["stack"] == 0 and row["local"] == 0, row
        assert row["approx_divisions"] == 0, row
