"""paged_attention against paged_attention_ref under the CPU interpreter.

Mixed batches in one call: prefill over a cached prefix, whole-prompt prefill and
decode; GQA and MHA; block sizes 8 and 16; head_dim 24 (not a power of two);
shuffled block tables whose unused entries are -1.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import reference
from kernels.attention_launch import choose_num_kv_splits, kv_splits_for
from tests.kernels.cases import ATTENTION_TOLERANCES, attention_batch, random_kv

pytestmark = pytest.mark.usefixtures("interpreted")

# (new tokens per sequence, total KV length per sequence)
MIXED_BATCH = ([6, 1, 20, 1, 3], [19, 9, 20, 33, 3])


def _run(
    dtype,
    num_heads,
    num_kv_heads,
    block_size,
    head_dim,
    batch=MIXED_BATCH,
    max_query_len=None,
    num_kv_splits=None,
):
    num_new, seq_lens = batch
    tables, seq_lens_t, starts = attention_batch(num_new, seq_lens, 24, block_size, seed=0, device="cpu")
    kv_layer = random_kv((2, 24, block_size, num_kv_heads, head_dim), dtype, "cpu", seed=1)
    query = random_kv((sum(num_new), num_heads, head_dim), dtype, "cpu", seed=2)
    scale = 1 / math.sqrt(head_dim)
    out = kernels.paged_attention(
        query,
        kv_layer,
        tables,
        seq_lens_t,
        starts,
        scale,
        max_query_len=max_query_len,
        num_kv_splits=num_kv_splits,
    )
    expected = reference.paged_attention_ref(query, kv_layer, tables, seq_lens_t, starts, scale)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mixed_batch_gqa_matches_reference(dtype):
    _run(dtype, num_heads=6, num_kv_heads=3, block_size=8, head_dim=24)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,head_dim",
    [(3, 3, 16, 24), (8, 2, 16, 16), (6, 1, 8, 16)],
)
def test_head_layouts_and_block_sizes(num_heads, num_kv_heads, block_size, head_dim):
    _run(torch.float32, num_heads, num_kv_heads, block_size, head_dim)


def test_decode_only_batch():
    _run(torch.float16, 4, 2, 8, 16, batch=([1, 1, 1], [1, 17, 40]), max_query_len=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_kv_splits", [2, 3, 8])
def test_split_kv_decode_matches_reference(dtype, num_kv_splits):
    # 8 splits of a 1-, 17- or 40-key sequence leave most splits empty; 3 splits of 130 keys are uneven.
    batch = ([1, 1, 1, 1], [1, 17, 40, 130])
    _run(dtype, 8, 2, 16, 16, batch=batch, max_query_len=1, num_kv_splits=num_kv_splits)


def test_split_kv_with_several_new_tokens_per_sequence():
    # Speculative verification: early rows of a tile see no key of the last split.
    _run(torch.float32, 4, 2, 8, 16, batch=([4, 3, 1], [70, 3, 100]), max_query_len=4, num_kv_splits=3)


@pytest.mark.parametrize("num_kv_splits", [2, 4])
def test_split_kv_over_prefill_tiles(num_kv_splits):
    # Chunks of several tiles over a cached prefix: each tile splits its own key range;
    # rows before a split's first key get nothing from it.
    _run(torch.float32, 2, 1, 16, 16, batch=([70, 1], [90, 40]), num_kv_splits=num_kv_splits)
    _run(torch.bfloat16, 8, 2, 16, 16, batch=([37, 5, 1], [200, 5, 60]), num_kv_splits=num_kv_splits)


def test_kv_split_policy_for_short_chunks_over_long_prefixes():
    # 80 new tokens (5 tiles of 16) over 8,192 keys, 8 KV heads, 132 SMs: 40 programs alone
    # would leave most SMs idle; the split keeps the float32 partial rows bounded.
    splits = kv_splits_for(5, 8, 8192, 132, num_tokens=80)
    assert 1 < splits <= 2048 // 80
    assert kv_splits_for(32, 8, 8192, 132, num_tokens=512) <= 2048 // 512
    # decode keeps its sizing: one tile per sequence
    assert kv_splits_for(1, 8, 16384, 132, num_tokens=1) == 33
    assert kv_splits_for(256, 8, 16384, 132, num_tokens=256) == 1
    assert kv_splits_for(5, 8, 200, 132, num_tokens=80) == 1  # short keys: nothing to split


def test_num_kv_splits_on_cpu_and_bounds():
    assert choose_num_kv_splits(1, 8, 16384, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="num_kv_splits"):
        _run(torch.float32, 2, 1, 8, 16, batch=([1], [9]), max_query_len=1, num_kv_splits=0)


def test_single_long_prefill_spanning_several_tiles():
    _run(torch.float32, 2, 1, 16, 16, batch=([70], [90]))


def test_output_is_independent_of_other_sequences():
    tables, seq_lens, starts = attention_batch([4, 1], [12, 30], 12, 8, seed=3, device="cpu")
    kv_layer = random_kv((2, 12, 8, 1, 16), torch.float32, "cpu", seed=4)
    query = random_kv((5, 2, 16), torch.float32, "cpu", seed=5)
    both = kernels.paged_attention(query, kv_layer, tables, seq_lens, starts, 0.25)
    alone = kernels.paged_attention(query[:4], kv_layer, tables[:1], seq_lens[:1], starts[:2], 0.25)
    torch.testing.assert_close(both[:4], alone, atol=0, rtol=0)


def _inputs():
    tables, seq_lens, starts = attention_batch([3, 1], [10, 20], 8, 8, seed=6, device="cpu")
    return torch.zeros(4, 4, 16), torch.zeros(2, 8, 8, 2, 16), tables, seq_lens, starts


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, kv, t, s, starts: (q[:, :3], kv, t, s, starts), "multiple of num_kv_heads"),
        (lambda q, kv, t, s, starts: (q[..., :8], kv, t, s, starts), "head_dim"),
        (lambda q, kv, t, s, starts: (q.half(), kv, t, s, starts), "same dtype"),
        (lambda q, kv, t, s, starts: (q, kv, t.long(), s, starts), "block_tables must be int32"),
        (lambda q, kv, t, s, starts: (q, kv, t, s[:1], starts), r"seq_lens must have shape \(2,\)"),
        (
            lambda q, kv, t, s, starts: (q, kv, t, torch.tensor([2, 20], dtype=torch.int32), starts),
            "smaller than",
        ),
        (
            lambda q, kv, t, s, starts: (q, kv, t, s, torch.tensor([0, 3, 5], dtype=torch.int32)),
            "query_start_loc",
        ),
        (lambda q, kv, t, s, starts: (q, kv, t[:, :1], s, starts), "block_tables has 1 columns"),
        (lambda q, kv, t, s, starts: (q, kv, t + 8, s, starts), "block_tables entries"),
    ],
)
def test_bad_input_is_a_clear_error(change, message):
    args = change(*_inputs())
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(*args, 0.25)
    with pytest.raises(ValueError, match=message):
        reference.paged_attention_ref(*args, 0.25)


def test_strided_query_from_a_fused_projection():
    tables, seq_lens, starts = attention_batch([5, 1], [9, 17], 8, 8, seed=7, device="cpu")
    kv_layer = random_kv((2, 8, 8, 2, 16), torch.float32, "cpu", seed=8)
    fused = random_kv((6, 4 + 2 + 2, 16), torch.float32, "cpu", seed=9)  # [tokens, q + k + v heads, head_dim]
    query = fused[:, :4]
    out = kernels.paged_attention(query, kv_layer, tables, seq_lens, starts, 0.25)
    expected = reference.paged_attention_ref(query.contiguous(), kv_layer, tables, seq_lens, starts, 0.25)
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[torch.float32])
