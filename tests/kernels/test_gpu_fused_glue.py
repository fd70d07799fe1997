"""The fused decode glue compiled on a real GPU, 8B shapes (marker `gpu`): the residual
add with RMSNorm is bit-identical to torch's add then `rms_norm`, RoPE with the KV-cache
write to `rotary_qk` then `reshape_and_cache` (outputs and cache), in every dtype.

Run with TRITON_INTERPRET unset: `python3 -m pytest tests/kernels/test_gpu_fused_glue.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reshape_and_cache
from kernels.elementwise import rotary_qk
from kernels.rms_norm import add_rms_norm, rms_norm
from kernels.rotary_cache import rotary_and_cache
from tests.kernels.cases import random_kv, shuffled_slots
from tests.kernels.test_gpu_elementwise import HEAD_DIM, HIDDEN, NUM_HEADS, NUM_KV_HEADS, NUM_TOKENS, cos_sin

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCK_SIZE = 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_add_rms_norm_is_bit_identical_to_the_add_then_the_norm(dtype, num_tokens):
    x = random_kv((num_tokens, HIDDEN), dtype, "cuda", seed=num_tokens)
    residual = random_kv((num_tokens, HIDDEN), dtype, "cuda", seed=num_tokens + 1)
    weight = random_kv((HIDDEN,), dtype, "cuda", seed=2)
    normed, total = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, rms_norm(residual + x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rotary_and_cache_is_bit_identical_to_the_two_launches(dtype, num_tokens):
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = random_kv((num_tokens, width), dtype, "cuda", seed=num_tokens)
    query, key, value = qkv.split(
        [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1
    )
    query = query.view(num_tokens, NUM_HEADS, HEAD_DIM)
    key = key.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = value.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    cos, sin = cos_sin(num_tokens, dtype)
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 3
    kv_layer = random_kv((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype, "cuda", seed=5)
    expected_kv = kv_layer.clone()
    slots = shuffled_slots(
        num_blocks, BLOCK_SIZE, num_tokens, num_skipped=num_tokens // 7, seed=6, device="cuda"
    )
    out_query, out_key = rotary_and_cache(query, key, value, cos, sin, kv_layer, slots)
    expected_query, expected_key = rotary_qk(query, key, cos, sin)
    reshape_and_cache(expected_key, value, expected_kv, slots)
    assert torch.equal(out_query, expected_query) and torch.equal(out_key, expected_key)
    assert torch.equal(kv_layer, expected_kv)
