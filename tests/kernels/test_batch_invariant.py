"""The deterministic mode's kernels under the CPU interpreter (and their pure-torch CPU
forms): every row / query is bit-identical whatever the rest of the batch, the chunk
boundaries or the step kind, in bfloat16 and float32; results agree with the references.

Shapes cross the kernels' tile sizes (130 rows > BLOCK_M 128, sequences longer than
several BLOCK_N key tiles) so a row lands in different tiles and tile positions.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from engine.models import glue
from kernels import fixed_order, matmul, reference
from kernels.attention_launch import batch_invariant_num_kv_splits
from kernels.matmul import linear
from kernels.rms_norm import rms_norm
from tests.kernels.cases import ATTENTION_TOLERANCES, attention_batch, random_kv

DTYPES = [torch.bfloat16, torch.float32]
#: (num rows of x, K, N): K not a multiple of BLOCK_K, N not of BLOCK_N
LINEAR_SHAPE = (130, 72, 136)


def _rows(num_rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return random_kv((num_rows, dim), dtype, "cpu", seed)


def _batches_holding(x: torch.Tensor, row: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """(batch, index of x[row] in it): alone, among other random rows at several places and sizes."""
    others = _rows(200, x.shape[1], x.dtype, seed)
    return [
        (x[row : row + 1], 0),
        (torch.cat([others[:5], x[row : row + 1]]), 5),
        (torch.cat([others[:129], x[row : row + 1], others[129:140]]), 129),  # second row tile
        (torch.cat([x[row : row + 1], others[:63]]), 0),
    ]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_rows_do_not_depend_on_the_batch(dtype, with_bias):
    num_rows, k, n = LINEAR_SHAPE
    x = _rows(num_rows, k, dtype, seed=0)
    weight = random_kv((n, k), dtype, "cpu", seed=1)
    bias = random_kv((n,), dtype, "cpu", seed=2) if with_bias else None
    full = linear(x, weight, bias)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(full.float(), expected, **ATTENTION_TOLERANCES[dtype])
    for row in (0, 77, 129):
        for batch, index in _batches_holding(x, row, seed=3 + row):
            assert torch.equal(linear(batch, weight, bias)[index], full[row]), (row, batch.shape[0])


def _candidate_tiles():
    return [(torch.bfloat16, tile) for tile in matmul.CANDIDATE_TILES_16BIT] + [
        (torch.float32, tile) for tile in matmul.CANDIDATE_TILES_FP32
    ]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype,tile", _candidate_tiles(), ids=lambda v: getattr(v, "name", str(v)))
def test_every_candidate_tile_gives_the_baseline_rows(dtype, tile):
    """Each tile benchmarks/gemm_configs.py sweeps computes the same product (TMA loads, the
    persistent loop, ragged edges in M, N and K), row for row as the baseline tile, alone or
    in a batch. (On a GPU the bits may still differ by tensor-core instruction: the
    benchmark and the GPU test check that.)"""
    x = _rows(70, 136, dtype, seed=20)
    weight = random_kv((72, 136), dtype, "cpu", seed=21)
    bias = random_kv((72,), dtype, "cpu", seed=22)
    baseline = linear(x, weight, bias, tile=matmul.BASELINE_TILES[dtype])
    assert torch.equal(linear(x, weight, bias, tile=tile), baseline)
    assert torch.equal(linear(x[33:34], weight, bias, tile=tile)[0], baseline[33])


@pytest.mark.usefixtures("interpreted")
def test_tile_plan_picks_a_tile_by_size_only_when_switched_on(monkeypatch):
    small, narrow, large = (
        matmul.GemmTile(64, 32, 64, 4, 6),
        matmul.GemmTile(64, 128, 64, 4, 4, tma=True),
        matmul.GemmTile(128, 256, 64, 8, 3, persistent=True, tma=True),
    )
    plan = matmul.TilePlan(
        (
            matmul.TileRule(64, None, small),
            matmul.TileRule(1024, 48, narrow),
            matmul.TileRule(None, None, large),
        )
    )
    assert [plan.tile_for(m, 40) for m in (1, 64, 65, 1024, 1025)] == [small, small, narrow, narrow, large]
    assert plan.tile_for(65, 49) == large
    assert plan.tiles == (small, narrow, large)
    monkeypatch.setattr(matmul, "PROVEN_TILE_PLANS", {torch.bfloat16: plan})
    monkeypatch.setattr(matmul, "USE_TILE_PLAN", False)
    assert matmul.tile_for(torch.bfloat16, 1, 40) == matmul.BASELINE_TILES[torch.bfloat16]
    monkeypatch.setattr(matmul, "USE_TILE_PLAN", True)
    assert matmul.tile_for(torch.bfloat16, 1, 40) == small
    assert matmul.tile_for(torch.bfloat16, 65, 40) == narrow
    assert matmul.tile_for(torch.float32, 65, 40) == matmul.BASELINE_TILES[torch.float32]
    # with the plan on, rows still match across M (here: across the rules' boundary)
    x = _rows(70, 72, torch.bfloat16, seed=23)
    weight = random_kv((40, 72), torch.bfloat16, "cpu", seed=24)
    full = linear(x, weight)
    assert torch.equal(linear(x[:3], weight), full[:3])


def test_row_counts_per_tile_reach_every_tile_the_plan_picks():
    for dtype in (torch.bfloat16, torch.float32):
        for num_cols in (40, 4096, 6144, 128256):
            for max_rows in (1, 64, 300, 2100):
                counts = matmul.row_counts_per_tile(dtype, num_cols, max_rows)
                reached = [matmul.tile_for(dtype, m, num_cols) for m in counts]
                every = {matmul.tile_for(dtype, m, num_cols) for m in range(1, max_rows + 1)}
                assert set(reached) == every and len(reached) == len(every), (dtype, num_cols, max_rows)
                assert all(1 <= m <= max_rows for m in counts)


def test_the_proven_plans_hold_candidate_tiles_of_one_reduction_order():
    for dtype, plan in matmul.PROVEN_TILE_PLANS.items():
        assert set(plan.tiles) <= set(matmul.CANDIDATE_TILES_16BIT), dtype
        assert {tile.block_k for tile in plan.tiles} == {matmul.BASELINE_TILES[dtype].block_k}


def test_tile_plans_reject_mixed_reduction_orders_and_no_catch_all():
    with pytest.raises(ValueError, match="BLOCK_K"):
        matmul.TilePlan(
            (
                matmul.TileRule(64, None, matmul.GemmTile(64, 64, 32, 4, 2)),
                matmul.TileRule(None, None, matmul.GemmTile(64, 64, 64, 4, 2)),
            )
        )
    with pytest.raises(ValueError, match="every size"):
        matmul.TilePlan((matmul.TileRule(64, None, matmul.GemmTile(64, 64, 64, 4, 2)),))
    with pytest.raises(ValueError, match="every size"):
        matmul.TilePlan(())


@pytest.mark.usefixtures("interpreted")
def test_linear_rejects_a_tile_with_another_block_k():
    with pytest.raises(ValueError, match="another order"):
        linear(torch.zeros(2, 8), torch.zeros(3, 8), tile=matmul.GemmTile(64, 64, 64, 4, 2))


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_batch(dtype):
    x = _rows(130, 96, dtype, seed=4)
    weight = random_kv((96,), dtype, "cpu", seed=5)
    full = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(
        full.float(), glue.rms_norm(x, weight, 1e-6).float(), **ATTENTION_TOLERANCES[dtype]
    )
    for row in (0, 64, 129):
        for batch, index in _batches_holding(x, row, seed=6 + row):
            assert torch.equal(rms_norm(batch, weight, 1e-6)[index], full[row])


@pytest.mark.usefixtures("interpreted")
def test_linear_and_rms_norm_reject_bad_input():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="in_features"):
        linear(x, torch.zeros(4, 7))
    with pytest.raises(ValueError, match="must match x"):
        linear(x, torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        linear(x, torch.zeros(4, 8), torch.zeros(5))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        linear(x.double(), torch.zeros(4, 8).double())
    with pytest.raises(ValueError, match="weight's size"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(8), 0.0)


# One sequence of SEQ_LEN tokens (several BLOCK_N tiles) whose queries are computed in many ways.
SEQ_LEN = 100
NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM = 4, 2, 8, 24
NUM_BLOCKS = 96


class _Sequence:
    """The KV of a sequence and of a few unrelated ones in one paged layer, and its queries."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.kv_layer = random_kv((2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype, "cpu", seed=7)
        self.query = random_kv((SEQ_LEN, NUM_HEADS, HEAD_DIM), dtype, "cpu", seed=8)
        # Row 0: our sequence; rows 1..3: other sequences of other lengths.
        self.other_lens = [40, 97, 21]
        self.tables, _, _ = attention_batch(
            [1] * 4, [SEQ_LEN, *self.other_lens], NUM_BLOCKS, BLOCK_SIZE, seed=9, device="cpu"
        )
        self.other_queries = random_kv((40, NUM_HEADS, HEAD_DIM), dtype, "cpu", seed=10)

    def run(self, attention, begin: int, end: int, others: list[tuple[int, int]]) -> torch.Tensor:
        """Queries [begin, end) of the sequence in one call, placed after `others` =
        [(other sequence index 1..3, num new tokens)] -> [end - begin, H, D]."""
        seq_rows = [other for other, _ in others] + [0]
        num_new = [n for _, n in others] + [end - begin]
        seq_lens = [self.other_lens[other - 1] for other, _ in others] + [end]
        queries = torch.cat([self.other_queries[: sum(n for _, n in others)], self.query[begin:end]])
        tables = self.tables[seq_rows]
        starts = torch.tensor([0, *num_new]).cumsum(0).int()
        out = attention(
            queries,
            self.kv_layer,
            tables,
            torch.tensor(seq_lens, dtype=torch.int32),
            starts,
            1 / math.sqrt(HEAD_DIM),
        )
        return out[-(end - begin) :]


def _batch_invariant_kernel(*args):
    return kernels.paged_attention(*args, batch_invariant=True)


def _split_every(kv_split_len: int, *, one_program: bool = False):
    """The batch-invariant kernel with keys cut every `kv_split_len` positions; decode-sized
    calls run the ranges in programs of their own (CPU) unless `one_program`."""

    def attention(*args):
        return kernels.paged_attention(
            *args, batch_invariant=True, kv_split_len=kv_split_len, num_kv_splits=1 if one_program else None
        )

    return attention


def _assert_every_way_agrees(attention, dtype):
    seq = _Sequence(dtype)
    whole = seq.run(attention, 0, SEQ_LEN, [])
    # chunked prefill with other chunk boundaries, beside other sequences' prefill chunks and decodes
    for boundaries in ([0, 64, 100], [0, 37, 77, 100], [0, 1, 2, 70, 100]):
        for index, (begin, end) in enumerate(zip(boundaries, boundaries[1:], strict=False)):
            others = [(1, 3), (3, 1)] if index % 2 else [(2, 20)]
            assert torch.equal(seq.run(attention, begin, end, others), whole[begin:end]), (begin, end)
    # decode steps (one query), alone and in a batch of decodes
    for position in (0, 16, 63, 64, 99):
        for others in ([], [(1, 1), (2, 1), (3, 1)]):
            assert torch.equal(seq.run(attention, position, position + 1, others)[0], whole[position]), (
                position
            )
    # speculative verification: a few queries at the end of the sequence
    for begin in (80, 95):
        assert torch.equal(seq.run(attention, begin, begin + 5, [(2, 4)]), whole[begin : begin + 5])
    starts = torch.tensor([0, SEQ_LEN], dtype=torch.int32)
    expected = reference.paged_attention_ref(
        seq.query,
        seq.kv_layer,
        seq.tables[:1],
        torch.tensor([SEQ_LEN], dtype=torch.int32),
        starts,
        HEAD_DIM**-0.5,
    )
    torch.testing.assert_close(whole, expected, **ATTENTION_TOLERANCES[dtype])


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant_attention_is_the_same_in_any_chunk_decode_or_verification(dtype):
    _assert_every_way_agrees(_batch_invariant_kernel, dtype)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(
    "dtype,kv_split_len,one_program",
    [
        (torch.bfloat16, 64, False),  # 2 ranges of SEQ_LEN 100 (BLOCK_N 64)
        (torch.float32, 32, False),  # 4 ranges (BLOCK_N 16)
        (torch.float32, 16, True),  # 7 ranges, all walked by one program
    ],
)
def test_split_kv_at_fixed_positions_is_the_same_in_any_chunk_decode_or_verification(
    dtype, kv_split_len, one_program
):
    """Keys cut every kv_split_len positions: prefill chunks walk their ranges in one program,
    decodes and verifications of a few sequences run one program per range and merge after;
    every query's bits agree (and agree with the reference within tolerance)."""
    assert batch_invariant_num_kv_splits(
        4, 4, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SEQ_LEN, kv_split_len, torch.device("cpu")
    ) == -(-SEQ_LEN // kv_split_len)
    _assert_every_way_agrees(_split_every(kv_split_len, one_program=one_program), dtype)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_program_and_one_program_per_range_give_the_same_bits(dtype):
    """The same decode batch (several sequences, positions in several ranges) through both
    ways of running the positional ranges."""
    seq = _Sequence(dtype)
    num_seqs = 4
    seq_lens = torch.tensor([SEQ_LEN, *seq.other_lens], dtype=torch.int32)
    queries = torch.cat([seq.query[SEQ_LEN - 1 :], seq.other_queries[: num_seqs - 1]])
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    runs = [
        kernels.paged_attention(
            queries,
            seq.kv_layer,
            seq.tables,
            seq_lens,
            starts,
            0.2,
            batch_invariant=True,
            kv_split_len=kv_split_len,
            num_kv_splits=num_kv_splits,
        )  # fmt: skip
        for kv_split_len in (64, 128)
        for num_kv_splits in (None, 1)
    ]
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[2], runs[3])
    # 64-key ranges are a different reduction than one range over the 100 keys (a real split)
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_order_cpu_attention_is_the_same_in_any_chunk_decode_or_verification(dtype):
    _assert_every_way_agrees(fixed_order.paged_attention_rows, dtype)


@pytest.mark.usefixtures("interpreted")
def test_batch_invariant_attention_splits_only_at_fixed_positions():
    seq = _Sequence(torch.float32)
    args = (
        seq.query[:1],
        seq.kv_layer,
        seq.tables[:1],
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        0.25,
    )
    with pytest.raises(ValueError, match="fixed positions"):
        kernels.paged_attention(*args, num_kv_splits=2, batch_invariant=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.paged_attention(*args, batch_invariant=True, kv_split_len=24)
    with pytest.raises(ValueError, match="batch_invariant attention only"):
        kernels.paged_attention(*args, kv_split_len=32)


def test_pairwise_sum_ignores_zero_padding_and_matches_sum():
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(0))
    padded = torch.cat([x, torch.zeros(3, 90)], dim=1)
    assert torch.equal(fixed_order.pairwise_sum(x, -1), fixed_order.pairwise_sum(padded, -1))
    torch.testing.assert_close(fixed_order.pairwise_sum(x, -1), x.sum(-1))
    torch.testing.assert_close(fixed_order.pairwise_sum(x, 0), x.sum(0))


def test_per_row_linear_rows_do_not_depend_on_the_batch():
    for dtype in DTYPES:
        x = _rows(40, 72, dtype, seed=11)
        weight = random_kv((136, 72), dtype, "cpu", seed=12)
        full = fixed_order.per_row(F.linear, x, weight)
        for row in (0, 39):
            for batch, index in _batches_holding(x, row, seed=13):
                assert torch.equal(fixed_order.per_row(F.linear, batch, weight)[index], full[row])
