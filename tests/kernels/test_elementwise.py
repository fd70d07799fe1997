"""The one-launch glue kernels (RoPE on query and key, SiLU-and-mul) under the CPU
interpreter against the eager torch glue they replace on CUDA (engine.models.glue).

RoPE is bit-identical in float32 and float16; the interpreter rounds float32 to
bfloat16 in its own way (a GPU rounds to nearest even, like torch: tests/kernels/test_gpu.py
checks bfloat16 bit for bit there), so bfloat16 is compared within one bf16 step here.
"""

from __future__ import annotations

import pytest
import torch

from engine.models import glue
from kernels.elementwise import rotary_qk, silu_and_mul
from tests.kernels.cases import random_kv

pytestmark = pytest.mark.usefixtures("interpreted")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_TOKENS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 4, 2, 24


def fused_qkv_views(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D] and key [T, KVH, D] as the model has them: views of one QKV output."""
    qkv = random_kv((NUM_TOKENS, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM), dtype, "cpu", seed)
    query, key, _ = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)
    return query.view(NUM_TOKENS, NUM_HEADS, HEAD_DIM), key.view(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM)


def cos_sin(rotary_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(NUM_TOKENS) * 1237 + 5
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        # one bf16 step (2^-7 relative) of the larger value: the interpreter's own rounding
        torch.testing.assert_close(actual.float(), expected.float(), atol=2**-7 * 4, rtol=2**-7)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 16])  # full and partial rotary (Phi-style pass-through)
def test_rotary_qk_matches_the_eager_glue(dtype, rotary_dim):
    query, key = fused_qkv_views(dtype, seed=rotary_dim)
    cos, sin = cos_sin(rotary_dim, dtype)
    expected_query, expected_key = glue.rotary_qk(query, key, cos, sin)
    out_query, out_key = rotary_qk(query, key, cos, sin)
    assert out_query.is_contiguous() and out_key.is_contiguous()
    assert_matches(out_query, expected_query, dtype)
    assert_matches(out_key, expected_key, dtype)
    if rotary_dim < HEAD_DIM:  # pass-through dims are copied as they are
        assert torch.equal(out_query[..., rotary_dim:], query[..., rotary_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [300, 2500])  # one partial block; several blocks per row
def test_silu_and_mul_matches_the_eager_glue(dtype, dim):
    gate_up = random_kv((5, 2 * dim), dtype, "cpu", seed=dim)
    gate, up = gate_up.split(dim, dim=-1)  # views of one fused projection, as in the MLP
    out = silu_and_mul(gate, up)
    assert out.shape == (5, dim) and out.is_contiguous()
    # the interpreter's exp may differ from torch's in the last float32 bit before rounding
    tolerance = (
        {"atol": 2**-7 * 4, "rtol": 2**-7} if dtype == torch.bfloat16 else {"atol": 1e-3, "rtol": 1e-3}
    )
    torch.testing.assert_close(out.float(), glue.silu_and_mul(gate, up).float(), **tolerance)


def test_empty_batches_give_empty_outputs():
    query, key = fused_qkv_views(torch.float32, seed=0)
    cos, sin = cos_sin(HEAD_DIM, torch.float32)
    out_query, out_key = rotary_qk(query[:0], key[:0], cos[:0], sin[:0])
    assert out_query.shape == (0, NUM_HEADS, HEAD_DIM) and out_key.shape == (0, NUM_KV_HEADS, HEAD_DIM)
    assert silu_and_mul(torch.zeros(0, 8), torch.zeros(0, 8)).shape == (0, 8)


def test_bad_inputs_are_value_errors():
    query, key = fused_qkv_views(torch.float32, seed=0)
    cos, sin = cos_sin(HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="even R <= D"):
        rotary_qk(query, key, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="even R <= D"):
        rotary_qk(query, key, *cos_sin(HEAD_DIM + 2, torch.float32))
    with pytest.raises(ValueError, match="share one of"):
        rotary_qk(query, key, cos.half(), sin.half())
    with pytest.raises(ValueError, match="contiguous along head_dim"):
        rotary_qk(query.transpose(1, 2).contiguous().transpose(1, 2), key, cos, sin)
    with pytest.raises(ValueError, match="one \\[num_rows, dim\\] shape"):
        silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 9))
    with pytest.raises(ValueError, match="share one of"):
        silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous along dim"):
        silu_and_mul(torch.zeros(8, 2).t(), torch.zeros(8, 2).t())


def causal_attention(_layer_idx: int, query, key, value) -> torch.Tensor:
    """The step's own tokens, causal (the model test needs no paged cache)."""
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    ).transpose(0, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: the q/k norms run the norm kernel too
def test_model_with_glue_kernels_matches_the_eager_model(arch):
    """float32: the same hidden states as the eager glue (to float32 noise); bfloat16: as close
    to the float32 model as the eager bf16 glue is (bf16 rounding noise is ~2% here)."""
    from bench.tiny_model import _arch_config
    from engine.config import ModelConfig
    from engine.models.loader import load_model
    from kernels.rms_norm import rms_norm

    config = ModelConfig.from_hf_config(_arch_config(arch, 512, bos_id=1, eos_id=2, pad_id=0))
    input_ids = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40, 49)
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        models[dtype] = load_model(config, None, torch.device("cpu"), dtype, dummy=True)
    models[torch.bfloat16].load_state_dict(
        {name: weight.to(torch.bfloat16) for name, weight in models[torch.float32].state_dict().items()}
    )
    eager = {dtype: model(input_ids, positions, causal_attention).float() for dtype, model in models.items()}
    for model in models.values():
        model.use_glue_kernels()
    layer = models[torch.float32].model.layers[0]
    assert layer.input_layernorm.impl is rms_norm
    assert layer.self_attn.rotary_impl is rotary_qk and layer.mlp.act_impl is silu_and_mul
    fused = {dtype: model(input_ids, positions, causal_attention).float() for dtype, model in models.items()}
    torch.testing.assert_close(fused[torch.float32], eager[torch.float32], atol=1e-4, rtol=1e-4)

    def error(hidden):
        return float((hidden - eager[torch.float32]).norm() / eager[torch.float32].norm())

    assert error(fused[torch.bfloat16]) < 1.5 * error(eager[torch.bfloat16]) + 5e-3
