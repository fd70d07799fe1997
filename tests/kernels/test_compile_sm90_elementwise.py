"""The glue kernels (RoPE on query and key, SiLU-and-mul, RoPE with the KV-cache write,
the residual add with RMSNorm) compile for an H100 (sm_90) without a GPU, without spills
and within its shared memory; RoPE (alone and with the cache write) moves whole heads with
16-byte accesses. Compiled in a subprocess (tests/kernels/sm90_compile_elementwise.py)."""

from __future__ import annotations

import pytest

from tests.sm90_compile_runner import H100_SHARED_MEMORY_BYTES, requires_sm90_tools, sm90_compile_rows

pytestmark = requires_sm90_tools


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    rows = sm90_compile_rows("tests.kernels.sm90_compile_elementwise")
    return {row["name"]: row for row in rows}


def test_every_configuration_compiled(results):
    assert len(results) == 3 + 2 + 2 + 2


def test_nothing_spills(results):
    for row in results.values():
        assert row["shared"] <= H100_SHARED_MEMORY_BYTES and row["stack"] == 0 and row["local"] == 0, row


# (the norms' masks follow a runtime `dim`, which this compile does not mark divisible by 16)
@pytest.mark.parametrize(
    "name", ["rotary bf16 heads=32/8 d=128/128", "rotary_and_cache bf16 heads=32/8 d=128/128"]
)
def test_rotary_of_the_8b_shape_is_vectorized(results, name):
    row = results[name]
    assert row["ld_v4"] > 0 and row["st_v4"] > 0, row
