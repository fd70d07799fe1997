"""The fused decode glue under the CPU interpreter against the launches it replaces:
`add_rms_norm` (the residual add and the norm after it) against torch's add then
`rms_norm`, and `rotary_and_cache` (RoPE and the paged KV write) against `rotary_qk` then
`reshape_and_cache`.

RoPE + cache write is bit-identical in every dtype (the same rotation code). The add + norm
is bit-identical in float32 and float16; in bfloat16 the interpreter rounds the float32 sum
in its own way (a GPU rounds to nearest even, like torch: tests/kernels/test_gpu_fused_glue.py
checks bfloat16 bit for bit there), so bfloat16 is compared within one bf16 step here.
"""

from __future__ import annotations

import pytest
import torch

from engine.models import glue
from kernels import reshape_and_cache
from kernels.elementwise import rotary_qk
from kernels.rms_norm import add_rms_norm, rms_norm
from kernels.rotary_cache import rotary_and_cache
from tests.kernels.cases import random_kv, shuffled_slots
from tests.kernels.test_elementwise import assert_matches

pytestmark = pytest.mark.usefixtures("interpreted")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_TOKENS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 7, 6, 2, 24, 4, 5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,dim", [(1, 48), (5, 300)])  # a decode row; a partial block
def test_add_rms_norm_matches_the_add_then_the_norm(dtype, num_rows, dim):
    x = random_kv((num_rows, dim), dtype, "cpu", seed=dim)
    residual = random_kv((num_rows, dim), dtype, "cpu", seed=dim + 1)
    weight = random_kv((dim,), dtype, "cpu", seed=3)
    normed, total = add_rms_norm(x, residual, weight, 1e-5)
    expected_total = residual + x
    assert normed.shape == total.shape == x.shape and normed.is_contiguous() and total.is_contiguous()
    assert_matches(total, expected_total, dtype)
    assert_matches(normed, rms_norm(expected_total, weight, 1e-5), dtype)
    # and the torch glue it stands for (the norm's sum order differs in float32's last bits)
    reference_normed, reference_total = glue.add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(total, reference_total, dtype)
    tolerance = {"atol": 2**-7 * 8, "rtol": 2**-6} if dtype != torch.float32 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(normed.float(), reference_normed.float(), **tolerance)


def test_add_rms_norm_takes_strided_rows_and_leaves_its_inputs():
    x = random_kv((4, 2, 32), torch.float32, "cpu", seed=5)[:, 1]  # row stride 64
    residual = random_kv((4, 32), torch.float32, "cpu", seed=6)
    before = residual.clone(), x.clone()
    weight = random_kv((32,), torch.float32, "cpu", seed=7)
    normed, total = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, residual + x) and torch.equal(normed, rms_norm(residual + x, weight, 1e-6))
    assert torch.equal(residual, before[0]) and torch.equal(x, before[1])
    empty = add_rms_norm(x[:0], residual[:0], weight, 1e-6)
    assert empty[0].shape == empty[1].shape == (0, 32)


def test_add_rms_norm_rejects_bad_input():
    x, weight = torch.zeros(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="must match x"):
        add_rms_norm(x, torch.zeros(3, 9), weight, 1e-6)
    with pytest.raises(ValueError, match="must match x"):
        add_rms_norm(x, torch.zeros(3, 8, dtype=torch.float16), weight, 1e-6)
    with pytest.raises(ValueError, match="weight's size"):
        add_rms_norm(x, torch.zeros(3, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="eps must be > 0"):
        add_rms_norm(x, torch.zeros(3, 8), weight, 0.0)


def fused_qkv(dtype: torch.dtype, seed: int):
    """query, key, value as the model has them: views of one QKV projection output."""
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = random_kv((NUM_TOKENS, width), dtype, "cpu", seed)
    query, key, value = qkv.split(
        [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1
    )
    return (
        query.view(NUM_TOKENS, NUM_HEADS, HEAD_DIM),
        key.view(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM),
        value.view(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM),
    )


def cos_sin(rotary_dim: int, dtype: torch.dtype):
    positions = torch.arange(NUM_TOKENS) * 977 + 3
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    emb = torch.cat([positions[:, None].float() * inv_freq[None, :]] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 16])  # full and partial rotary
def test_rotary_and_cache_writes_what_the_two_launches_write(dtype, rotary_dim):
    query, key, value = fused_qkv(dtype, seed=rotary_dim)
    cos, sin = cos_sin(rotary_dim, dtype)
    kv_layer = random_kv((2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype, "cpu", seed=9)
    expected_kv = kv_layer.clone()
    slots = shuffled_slots(NUM_BLOCKS, BLOCK_SIZE, NUM_TOKENS, num_skipped=2, seed=10, device="cpu")
    out_query, out_key = rotary_and_cache(query, key, value, cos, sin, kv_layer, slots)
    expected_query, expected_key = rotary_qk(query, key, cos, sin)
    reshape_and_cache(expected_key, value, expected_kv, slots)
    assert out_query.is_contiguous() and out_key.is_contiguous()
    assert torch.equal(out_query, expected_query) and torch.equal(out_key, expected_key)
    assert torch.equal(kv_layer, expected_kv)
    assert_matches(out_query, glue.rotary_qk(query, key, cos, sin)[0], dtype)


def test_rotary_and_cache_skips_masked_and_out_of_range_slots_and_other_layers():
    query, key, value = fused_qkv(torch.float32, seed=1)
    cos, sin = cos_sin(HEAD_DIM, torch.float32)
    kv_cache = torch.zeros(3, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.full((NUM_TOKENS,), -1, dtype=torch.int64)
    slots[2], slots[4] = 5, NUM_BLOCKS * BLOCK_SIZE  # one real slot, one past the cache
    _, out_key = rotary_and_cache(query, key, value, cos, sin, kv_cache[1], slots)
    assert torch.equal(kv_cache[1, 0, 1, 1], out_key[2]) and torch.equal(kv_cache[1, 1, 1, 1], value[2])
    assert int((kv_cache != 0).sum()) == 2 * NUM_KV_HEADS * HEAD_DIM
    empty = rotary_and_cache(query[:0], key[:0], value[:0], cos[:0], sin[:0], kv_cache[1], slots[:0])
    assert empty[0].shape == (0, NUM_HEADS, HEAD_DIM) and empty[1].shape == (0, NUM_KV_HEADS, HEAD_DIM)


def test_rotary_and_cache_rejects_bad_input():
    query, key, value = fused_qkv(torch.float32, seed=2)
    cos, sin = cos_sin(HEAD_DIM, torch.float32)
    kv_layer = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.arange(NUM_TOKENS)
    with pytest.raises(ValueError, match="even R <= D"):
        rotary_and_cache(query, key, value, cos[:3], sin[:3], kv_layer, slots)
    with pytest.raises(ValueError, match="value shape"):
        rotary_and_cache(query, key, value[:3], cos, sin, kv_layer, slots)
    with pytest.raises(ValueError, match="to match query and kv_layer"):
        wide = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_DIM)
        rotary_and_cache(query, key, value, cos, sin, wide, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_and_cache(query, key, value, cos, sin, kv_layer, slots[:3])
