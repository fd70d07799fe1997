"""The kernels compile for an H100 (sm_90), without a GPU, within its limits.

Catches what the CPU interpreter cannot: code that does not compile for a real GPU,
shared memory over the H100 limit, register spills, and pack/unpack accesses that are
not 16-byte vectorized (which would cost bandwidth). The compiler runs in a subprocess
(tests/kernels/sm90_compile.py) because the interpreter's patches break it in-process.
"""

from __future__ import annotations

import pytest

from tests.sm90_compile_runner import H100_SHARED_MEMORY_BYTES, requires_sm90_tools, sm90_compile_rows

pytestmark = requires_sm90_tools


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    rows = sm90_compile_rows("tests.kernels.sm90_compile")
    return {row["name"]: row for row in rows}


def test_every_configuration_compiled(results):
    assert len(results) == 4 + 1 + 7 + 1 + 1


@pytest.mark.parametrize("name", ["pack bf16", "unpack bf16", "pack fp32", "unpack fp32"])
def test_pack_kernels_use_16_byte_vectors_without_spills(results, name):
    row = results[name]
    assert row["ld_v4"] == row["vectors_per_thread"] and row["st_v4"] == row["vectors_per_thread"], row
    assert row["stack"] == 0 and row["local"] == 0, row


def test_reshape_and_cache_is_vectorized(results):
    row = results["reshape_and_cache bf16"]
    assert row["st_v4"] > 0 and row["stack"] == 0, row


def test_attention_fits_an_h100(results):
    attention = [row for name, row in results.items() if name.startswith("attention")]
    for row in attention:
        assert row["shared"] <= H100_SHARED_MEMORY_BYTES, row
        # A few bytes of stack are call bookkeeping; a spilled tile is kilobytes.
        assert row["stack"] <= 64, row


def test_merge_of_kv_splits_does_not_spill(results):
    row = results["merge kv splits bf16"]
    assert row["stack"] <= 64 and row["local"] == 0, row


def test_host_unpack_compiles_with_16_byte_stores_and_no_spills(results):
    row = results["host_unpack bf16"]
    assert row["stack"] == 0 and row.get("local", 0) == 0
    assert row["st_v4"] > 0
