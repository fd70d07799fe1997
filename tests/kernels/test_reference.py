"""The torch references against plain per-token loops (the references are what the kernels are held to)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from tests.kernels.cases import attention_batch, random_kv, shuffled_slots


def test_pack_and_unpack_ref_match_per_token_loops():
    kv_cache = random_kv((2, 2, 6, 8, 3, 24), torch.float32, "cpu", seed=0)
    slots = shuffled_slots(6, 8, 13, num_skipped=3, seed=1, device="cpu")
    out = torch.full((2, 2, 13, 3, 24), 7.0)
    reference.pack_kv_ref(kv_cache, slots, out)
    for token, slot in enumerate(slots.tolist()):
        expected = torch.full_like(out[:, :, token], 7.0) if slot < 0 else kv_cache[:, :, slot // 8, slot % 8]
        assert torch.equal(out[:, :, token], expected)

    chunk = random_kv((2, 2, 13, 3, 24), torch.float32, "cpu", seed=2)
    expected_cache = kv_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_cache[:, :, slot // 8, slot % 8] = chunk[:, :, token]
    reference.unpack_kv_ref(chunk, kv_cache, slots)
    assert torch.equal(kv_cache, expected_cache)


def test_layer_refs_match_whole_cache_refs():
    kv_cache = random_kv((3, 2, 5, 16, 2, 16), torch.bfloat16, "cpu", seed=3)
    slots = shuffled_slots(5, 16, 20, num_skipped=2, seed=4, device="cpu")
    packed = reference.pack_kv_ref(kv_cache, slots)
    for layer in range(3):
        assert torch.equal(
            reference.pack_kv_layer_ref(kv_cache[layer], slots)[:, slots >= 0], packed[layer][:, slots >= 0]
        )
    chunk = random_kv(tuple(packed.shape), torch.bfloat16, "cpu", seed=5)
    by_layer = kv_cache.clone()
    reference.unpack_kv_ref(chunk, kv_cache, slots)
    for layer in range(3):
        reference.unpack_kv_layer_ref(chunk[layer], by_layer[layer], slots)
    assert torch.equal(by_layer, kv_cache)


def test_reshape_and_cache_ref_writes_only_mapped_slots():
    kv_layer = random_kv((2, 4, 8, 3, 24), torch.float16, "cpu", seed=6)
    before = kv_layer.clone()
    key = random_kv((5, 3, 24), torch.float16, "cpu", seed=7)
    value = random_kv((5, 3, 24), torch.float16, "cpu", seed=8)
    slots = torch.tensor([9, -1, 31, 0, 17])
    reference.reshape_and_cache_ref(key, value, kv_layer, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            before[0, slot // 8, slot % 8] = key[token]
            before[1, slot // 8, slot % 8] = value[token]
    assert torch.equal(kv_layer, before)


def _naive_attention(query, kv_layer, block_tables, seq_lens, query_start_loc, scale):
    """Token by token, head by head, in float64."""
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for seq_idx, seq_len in enumerate(seq_lens.tolist()):
        begin, end = query_start_loc[seq_idx].item(), query_start_loc[seq_idx + 1].item()
        positions = range(seq_len)
        blocks = [block_tables[seq_idx, pos // block_size].item() for pos in positions]
        keys = torch.stack(
            [kv_layer[0, b, pos % block_size] for b, pos in zip(blocks, positions, strict=True)]
        ).double()
        values = torch.stack(
            [kv_layer[1, b, pos % block_size] for b, pos in zip(blocks, positions, strict=True)]
        ).double()
        for token in range(begin, end):
            position = seq_len - (end - begin) + (token - begin)
            for head in range(query.shape[1]):
                scores = keys[: position + 1, head // group] @ query[token, head].double() * scale
                out[token, head] = torch.softmax(scores, 0) @ values[: position + 1, head // group]
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 3), (3, 3), (4, 1)])
def test_paged_attention_ref_matches_naive_attention(num_heads, num_kv_heads):
    num_new, seq_lens = [5, 1, 19, 3], [13, 10, 19, 3]
    block_tables, seq_lens_t, starts = attention_batch(num_new, seq_lens, 16, 8, seed=9, device="cpu")
    kv_layer = random_kv((2, 16, 8, num_kv_heads, 24), torch.float32, "cpu", seed=10)
    query = random_kv((sum(num_new), num_heads, 24), torch.float32, "cpu", seed=11)
    scale = 1 / math.sqrt(24)
    out = reference.paged_attention_ref(query, kv_layer, block_tables, seq_lens_t, starts, scale)
    expected = _naive_attention(query, kv_layer, block_tables, seq_lens_t, starts, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_keeps_query_dtype_and_computes_in_float32():
    block_tables, seq_lens, starts = attention_batch([4], [40], 8, 8, seed=12, device="cpu")
    kv_layer = random_kv((2, 8, 8, 2, 16), torch.bfloat16, "cpu", seed=13)
    query = random_kv((4, 4, 16), torch.bfloat16, "cpu", seed=14)
    out = reference.paged_attention_ref(query, kv_layer, block_tables, seq_lens, starts, 0.25)
    expected = _naive_attention(query, kv_layer, block_tables, seq_lens, starts, 0.25)
    assert out.dtype == torch.bfloat16
    # Only the final rounding to bfloat16 differs from float64 math.
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=8e-3)
