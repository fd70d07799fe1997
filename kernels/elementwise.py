"""RoPE on query and key, and SiLU-and-mul: the elementwise glue of a decoder layer, one
launch each.

Called by the model on CUDA (engine.models.llama's `use_glue_kernels`) once per layer per
step, in the eager forward pass and inside the decode CUDA graphs. Eager torch spends
several kernels on each (RoPE: slices, a negation, a concatenation, two products and a
sum per tensor), and a `torch.compile`d function costs tens of microseconds of host time
per call in guards and wrappers, which an eager step pays 64 times; a Triton launch costs
a fraction of that.

Numerics follow the eager torch forms (engine.models.glue): every product and sum is
rounded to the input dtype where torch rounds it (a product of two 16-bit floats is exact
in float32, so rounding it once gives torch's 16-bit product), so RoPE is bit-identical
to the eager form (float32 too: it is compiled without fused multiply-adds); SiLU uses
the device's exp, which may differ from torch's in the last bit of float32 before the
rounding to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import check_kernel_device, next_power_of_2

GLUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(
    out_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM], contiguous
    x_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM], head_dim contiguous
    token,  # int64
    stride_x_token,
    stride_x_head,
    cos,  # [BLOCK_D] float32, 0 past ROTARY_DIM
    sin,  # [BLOCK_D] float32, signed: -sin on the first half, 0 past ROTARY_DIM
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    out = rotated_heads(
        x_ptr,
        token,
        stride_x_token,
        stride_x_head,
        cos,
        sin,
        NUM_HEADS,
        HEAD_DIM,
        ROTARY_DIM,
        BLOCK_H,
        BLOCK_D,
    )
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
    tl.store(
        out_ptr + token * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :], out, mask=mask
    )


@triton.jit
def rotary_cos_sin(
    cos_ptr,  # [num_tokens, ROTARY_DIM], rotary_dim contiguous
    sin_ptr,  # [num_tokens, ROTARY_DIM], rotary_dim contiguous
    token,  # int64
    stride_cos_token,
    stride_sin_token,
    ROTARY_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """-> token's (cos, signed sin) [BLOCK_D] in float32 for `rotated_heads`."""
    dims = tl.arange(0, BLOCK_D)
    rotary = dims < ROTARY_DIM
    cos = tl.load(cos_ptr + token * stride_cos_token + dims, mask=rotary, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin_token + dims, mask=rotary, other=0.0).to(tl.float32)
    sin = tl.where(dims < ROTARY_DIM // 2, -sin, sin)
    return cos, sin


@triton.jit
def rotated_heads(
    x_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM], head_dim contiguous
    token,  # int64
    stride_x_token,
    stride_x_head,
    cos,  # [BLOCK_D] float32, 0 past ROTARY_DIM
    sin,  # [BLOCK_D] float32, signed: -sin on the first half, 0 past ROTARY_DIM
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """-> token's heads after RoPE, [BLOCK_H, BLOCK_D] in x's dtype (0 past the heads and
    HEAD_DIM). Shared with kernels.rotary_cache."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # rotate-half: dim d < R/2 pairs with d + R/2 (negated), R/2 <= d < R with d - R/2
    partner = tl.where(dims < ROTARY_DIM // 2, dims + ROTARY_DIM // 2, dims - ROTARY_DIM // 2)
    partner = tl.where(dims < ROTARY_DIM, partner, dims)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
    row = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head
    x = tl.load(row + dims[None, :], mask=mask, other=0.0)
    x_partner = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    x32 = x.to(tl.float32)
    # torch rounds each product to the input dtype, then their sum
    term_cos = (x32 * cos[None, :]).to(x.dtype).to(tl.float32)
    term_sin = (x_partner * sin[None, :]).to(x.dtype).to(tl.float32)
    rotated = (term_cos + term_sin).to(x.dtype)
    return tl.where((dims < ROTARY_DIM)[None, :], rotated, x)


@triton.jit
def _rotary_qk_kernel(
    query_out_ptr,  # [num_tokens, NUM_Q_HEADS, HEAD_DIM], contiguous
    key_out_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM], contiguous
    query_ptr,  # [num_tokens, NUM_Q_HEADS, HEAD_DIM], head_dim contiguous
    key_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM], head_dim contiguous
    cos_ptr,  # [num_tokens, ROTARY_DIM], rotary_dim contiguous
    sin_ptr,  # [num_tokens, ROTARY_DIM], rotary_dim contiguous
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_cos_token,
    stride_sin_token,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,  # next power of 2 >= NUM_Q_HEADS
    BLOCK_HK: tl.constexpr,  # next power of 2 >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of 2 >= HEAD_DIM
):
    """One program per token: every query and key head of it."""
    token = tl.program_id(0).to(tl.int64)
    cos, sin = rotary_cos_sin(
        cos_ptr, sin_ptr, token, stride_cos_token, stride_sin_token, ROTARY_DIM, BLOCK_D
    )
    _rotate_heads(
        query_out_ptr,
        query_ptr,
        token,
        stride_query_token,
        stride_query_head,
        cos,
        sin,
        NUM_Q_HEADS,
        HEAD_DIM,
        ROTARY_DIM,
        BLOCK_HQ,
        BLOCK_D,
    )
    _rotate_heads(
        key_out_ptr,
        key_ptr,
        token,
        stride_key_token,
        stride_key_head,
        cos,
        sin,
        NUM_KV_HEADS,
        HEAD_DIM,
        ROTARY_DIM,
        BLOCK_HK,
        BLOCK_D,
    )


def rotary_qk(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], head_dim contiguous
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    cos: torch.Tensor,  # [num_tokens, rotary_dim]
    sin: torch.Tensor,  # [num_tokens, rotary_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of the first rotary_dim dims of every head (the others pass
    through) -> new contiguous (query, key), like engine.models.glue.rotary_qk.
    Raises ValueError on a bad shape, dtype or device."""
    rotary_dim = check_rotary_inputs(query, key, cos, sin)
    check_kernel_device("query", query, _rotary_qk_kernel)
    num_tokens, num_heads, head_dim = query.shape
    query_out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    key_out = torch.empty((num_tokens, key.shape[1], head_dim), dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    _rotary_qk_kernel[(num_tokens,)](
        query_out,
        key_out,
        query,
        key,
        cos,
        sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=key.shape[1],
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        BLOCK_HQ=next_power_of_2(num_heads),
        BLOCK_HK=next_power_of_2(key.shape[1]),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
        enable_fp_fusion=False,  # float32 too rounds each product, as torch does (no FMA)
    )
    return query_out, key_out


def check_rotary_inputs(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """The shape, dtype, device and stride checks of `rotary_qk` (and of
    kernels.rotary_cache) -> rotary_dim. Raises ValueError."""
    # Called 32 times per step: plain comparisons, no generators (each costs host time).
    if (
        not isinstance(query, torch.Tensor)
        or not isinstance(key, torch.Tensor)
        or query.dim() != 3
        or key.dim() != 3
    ):
        raise ValueError("query and key must be [num_tokens, heads, head_dim] tensors")
    num_tokens, num_heads, head_dim = query.shape
    rotary_dim = cos.shape[-1] if cos.dim() == 2 else -1
    if (
        key.shape[0] != num_tokens
        or key.shape[2] != head_dim
        or cos.shape != (num_tokens, rotary_dim)
        or sin.shape != cos.shape
        or rotary_dim % 2
        or not 0 < rotary_dim <= head_dim
    ):
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, cos {tuple(cos.shape)} and sin "
            f"{tuple(sin.shape)} must be [T, H, D], [T, KVH, D] and [T, R] with an even R <= D"
        )
    dtype, device = query.dtype, query.device
    if dtype not in GLUE_DTYPES or key.dtype != dtype or cos.dtype != dtype or sin.dtype != dtype:
        raise ValueError(
            f"query, key, cos and sin must share one of {GLUE_DTYPES}, got "
            f"{query.dtype}, {key.dtype}, {cos.dtype}, {sin.dtype}"
        )
    if key.device != device or cos.device != device or sin.device != device:
        raise ValueError("query, key, cos and sin must be on one device")
    if head_dim > 1 and (query.stride(2) != 1 or key.stride(2) != 1):
        raise ValueError(
            f"query and key must be contiguous along head_dim, got {query.stride()}, {key.stride()}"
        )
    if rotary_dim > 1 and (cos.stride(1) != 1 or sin.stride(1) != 1):
        raise ValueError("cos and sin must be contiguous along rotary_dim")
    return rotary_dim


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_rows, dim], contiguous
    gate_ptr,  # [num_rows, dim], dim contiguous
    up_ptr,  # [num_rows, dim], dim contiguous
    dim,
    stride_gate_row,
    stride_up_row,
    BLOCK: tl.constexpr,
):
    """One program per (row, BLOCK columns)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    gate = tl.load(gate_ptr + row * stride_gate_row + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up_row + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    # torch: silu computed in float32 and rounded to the input dtype, then the rounded product
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


#: columns per program of silu_and_mul (a row of a 14,336-wide MLP is 14 programs)
_SILU_BLOCK = 1024


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [num_rows, dim] (views of one fused projection are
    fine: dim contiguous) -> a new contiguous [num_rows, dim], like
    engine.models.glue.silu_and_mul. Raises ValueError on a bad shape, dtype or device."""
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise ValueError("gate and up must be torch tensors")
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(
            f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must be one [num_rows, dim] shape"
        )
    if gate.dtype not in GLUE_DTYPES or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"gate and up must share one of {GLUE_DTYPES} and a device")
    num_rows, dim = gate.shape
    if dim > 1 and (gate.stride(1) != 1 or up.stride(1) != 1):
        raise ValueError("gate and up must be contiguous along dim")
    check_kernel_device("gate", gate, _silu_and_mul_kernel)
    out = torch.empty((num_rows, dim), dtype=gate.dtype, device=gate.device)
    if num_rows == 0 or dim == 0:
        return out
    block = min(_SILU_BLOCK, next_power_of_2(dim))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(dim, block))](
        out,
        gate,
        up,
        dim,
        gate.stride(0),
        up.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out
