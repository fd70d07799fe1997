"""The one-launch glue kernels compiled on a real GPU, 8B shapes (marker `gpu`): RoPE is
bit-identical to the eager torch glue (the same roundings, no fused multiply-add),
SiLU-and-mul and the norm within one rounding of it.

Run with TRITON_INTERPRET unset: `python3 -m pytest tests/kernels/test_gpu_elementwise.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

from engine.models import glue
from kernels.elementwise import rotary_qk, silu_and_mul
from kernels.rms_norm import rms_norm
from tests.kernels.cases import random_kv

pytestmark = pytest.mark.gpu

#: Llama-3.1-8B: 32 query heads, 8 KV heads, head_dim 128, hidden 4096, MLP 14336
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336
NUM_TOKENS = [1, 80, 4100]


def fused_qkv_views(num_tokens: int, dtype: torch.dtype):
    qkv = random_kv((num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM), dtype, "cuda", seed=num_tokens)
    query, key, _ = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)
    return query.view(num_tokens, NUM_HEADS, HEAD_DIM), key.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)


def cos_sin(num_tokens: int, dtype: torch.dtype):
    positions = torch.arange(num_tokens, device="cuda") * 3 + 8000
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rotary_qk_is_bit_identical_to_the_eager_glue(dtype, num_tokens):
    query, key = fused_qkv_views(num_tokens, dtype)
    cos, sin = cos_sin(num_tokens, dtype)
    expected = glue.rotary_qk(query, key, cos, sin)
    actual = rotary_qk(query, key, cos, sin)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul_and_norm_match_the_eager_glue(dtype, num_tokens):
    gate, up = random_kv((num_tokens, 2 * INTERMEDIATE), dtype, "cuda", seed=num_tokens).split(
        INTERMEDIATE, -1
    )
    # one rounding step apart in 16 bits; float32: the device's exp and the norm's sum order
    step = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-17}[dtype]
    torch.testing.assert_close(
        silu_and_mul(gate, up).float(), glue.silu_and_mul(gate, up).float(), atol=4 * step, rtol=step
    )
    x = random_kv((num_tokens, HIDDEN), dtype, "cuda", seed=num_tokens + 1)
    weight = random_kv((HIDDEN,), dtype, "cuda", seed=2)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5).float(),
        glue.rms_norm(x, weight, 1e-5).float(),
        atol=8 * step,
        rtol=2 * step,
    )
