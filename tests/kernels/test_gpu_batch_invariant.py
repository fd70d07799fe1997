"""The deterministic mode's kernels compiled on a real GPU, 8B shapes (marker `gpu`):
rows and queries bit-identical whatever the batch, the chunking or the step kind.

Run with TRITON_INTERPRET unset: `python -m pytest tests/kernels/test_gpu_batch_invariant.py -m gpu -q`.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from engine.models import glue
from kernels import matmul, reference
from kernels.matmul import linear
from kernels.rms_norm import rms_norm
from tests.kernels.cases import ATTENTION_TOLERANCES, attention_batch, random_kv

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    torch.cuda.empty_cache()


def _in_batches(
    fn, x: torch.Tensor, rows: list[int], seed: int
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(row, fn's result for x[row] inside batches of 1, 3, 64, 129 and 2000 rows, at varied places, the expected row)."""
    full = fn(x)
    others = random_kv((2000, x.shape[1]), x.dtype, "cuda", seed)
    results = []
    for row in rows:
        for num_rows in (1, 3, 64, 129, 2000):
            place = (row * 7) % num_rows
            batch = others[:num_rows].clone()
            batch[place] = x[row]
            results.append((row, fn(batch)[place], full[row]))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096)])
def test_linear_rows_are_bit_identical_in_any_batch(dtype, k, n):
    x = random_kv((300, k), dtype, "cuda", seed=0)
    weight = random_kv((n, k), dtype, "cuda", seed=1) * 0.02
    for row, got, expected in _in_batches(lambda t: linear(t, weight), x, [0, 150, 299], seed=2):
        assert torch.equal(got, expected), (row, dtype, k, n)
    tolerance = {"atol": 5e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-3, "rtol": 1e-4}
    torch.testing.assert_close(
        linear(x, weight).float(), F.linear(x.double(), weight.double()).float(), **tolerance
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)])
def test_planned_tiles_give_the_baseline_bits_at_every_row_count(dtype, k, n):
    """The tile `linear` picks for M rows (kernels.matmul.tile_for: the baseline, or the
    proven plan when USE_TILE_PLAN), and every tile of the dtype's plan, give rows
    bit-identical to the baseline tile's over 8192 rows: a plan holding a tile whose
    tensor-core instruction rounds otherwise fails here."""
    x = random_kv((8192, k), dtype, "cuda", seed=30)
    weight = random_kv((n, k), dtype, "cuda", seed=31) * k**-0.5
    reference = matmul.linear(x, weight, tile=matmul.BASELINE_TILES[dtype])
    plan = matmul.PROVEN_TILE_PLANS.get(dtype)
    for num_rows in (1, 7, 64, 65, 300, 512, 1024, 1025, 2049, 8192):
        assert torch.equal(linear(x[:num_rows], weight), reference[:num_rows]), (num_rows, dtype, k, n)
        for tile in plan.tiles if plan is not None else ():
            got = linear(x[:num_rows], weight, tile=tile)
            assert torch.equal(got, reference[:num_rows]), (tile.name, num_rows, dtype, k, n)


def test_linear_with_bias_and_odd_shapes():
    x = random_kv((77, 200), torch.bfloat16, "cuda", seed=3)
    weight = random_kv((130, 200), torch.bfloat16, "cuda", seed=4)
    bias = random_kv((130,), torch.bfloat16, "cuda", seed=5)
    out = linear(x, weight, bias)
    torch.testing.assert_close(
        out.float(), F.linear(x.float(), weight.float(), bias.float()), atol=0.3, rtol=2e-2
    )
    assert torch.equal(linear(x[5:6], weight, bias)[0], out[5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [4096, 128])
def test_rms_norm_rows_are_bit_identical_in_any_batch(dtype, dim):
    x = random_kv((300, dim), dtype, "cuda", seed=6)
    weight = random_kv((dim,), dtype, "cuda", seed=7)
    for row, got, expected in _in_batches(lambda t: rms_norm(t, weight, 1e-5), x, [0, 299], seed=8):
        assert torch.equal(got, expected), (row, dtype, dim)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5).float(),
        glue.rms_norm(x, weight, 1e-5).float(),
        **ATTENTION_TOLERANCES[dtype],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_split_len", [None, 128])
@pytest.mark.parametrize("tile_follows_queries", [False, True])
def test_batch_invariant_attention_same_bits_in_prefill_chunks_decode_and_verification(
    dtype, kv_split_len, tile_follows_queries, monkeypatch
):
    """Llama-3.1-8B heads (32 query, 8 KV, head_dim 128), block size 16, a 1500-token
    sequence beside other sequences; its queries computed in every way the engine can.
    Keys are cut every 512 (default) or 128 positions: decodes of a few sequences run a
    program per range (split-KV), prefill chunks and decodes beside a prefill walk the
    ranges in one program, a CUDA graph's upper bound adds empty ranges. With
    BATCH_INVARIANT_TILE_FOLLOWS_QUERIES the decodes also run in 16-row tiles (prefill: 64)."""
    monkeypatch.setattr(
        importlib.import_module("kernels.paged_attention"),
        "BATCH_INVARIANT_TILE_FOLLOWS_QUERIES",
        tile_follows_queries,
    )
    num_heads, num_kv_heads, head_dim, block_size, seq_len = 32, 8, 128, 16, 1500
    other_lens = [700, 3000, 33]
    tables, _, _ = attention_batch([1] * 4, [seq_len, *other_lens], 400, block_size, seed=9, device="cuda")
    kv_layer = random_kv((2, 400, block_size, num_kv_heads, head_dim), dtype, "cuda", seed=10)
    query = random_kv((seq_len, num_heads, head_dim), dtype, "cuda", seed=11)
    other_queries = random_kv((600, num_heads, head_dim), dtype, "cuda", seed=12)
    scale = 1 / math.sqrt(head_dim)

    def run(begin: int, end: int, others: list[tuple[int, int]], **kwargs) -> torch.Tensor:
        num_new = [n for _, n in others] + [end - begin]
        seq_lens = [other_lens[i - 1] for i, _ in others] + [end]
        queries = torch.cat([other_queries[: sum(n for _, n in others)], query[begin:end]])
        starts = torch.tensor([0, *num_new], device="cuda").cumsum(0).int()
        out = kernels.paged_attention(
            queries,
            kv_layer,
            tables[[i for i, _ in others] + [0]],
            torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
            starts,
            scale,
            batch_invariant=True,
            kv_split_len=kv_split_len,
            **kwargs,
        )
        return out[-(end - begin) :]

    whole = run(0, seq_len, [])
    num_checked = 0
    for boundaries in ([0, 512, 1024, 1500], [0, 100, 1377, 1500], [0, 1, 8192 // 16, 1499, 1500]):
        for index, (begin, end) in enumerate(zip(boundaries, boundaries[1:], strict=False)):
            others = [(1, 5), (3, 1)] if index % 2 else [(2, 512)]
            assert torch.equal(run(begin, end, others), whole[begin:end]), (begin, end)
            num_checked += 1
    for position in (0, 63, 64, 511, 512, 1000, 1499):
        for others in ([], [(1, 1), (2, 1), (3, 1)], [(2, 300)]):
            assert torch.equal(run(position, position + 1, others)[0], whole[position]), position
        for kwargs in ({"num_kv_splits": 1}, {"max_seq_len": 8192}):
            got = run(position, position + 1, [(1, 1), (3, 1)], **kwargs)[0]
            assert torch.equal(got, whole[position]), (position, kwargs)
    for begin in (1200, 1495):
        assert torch.equal(run(begin, begin + 5, [(1, 5), (3, 1)]), whole[begin : begin + 5])
    starts = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    expected = reference.paged_attention_ref(
        query, kv_layer, tables[:1], torch.tensor([seq_len], dtype=torch.int32, device="cuda"), starts, scale
    )
    torch.testing.assert_close(whole, expected, **ATTENTION_TOLERANCES[dtype])
    assert num_checked == 10
