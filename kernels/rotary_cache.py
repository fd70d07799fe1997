"""RoPE on query and key, and the write of the step's K/V into one layer's paged KV
blocks, in one launch.

Called by the model runner on CUDA once per layer per engine step, in place of
kernels.elementwise.rotary_qk followed by kernels.reshape_and_cache (one launch per layer
fewer; at batch 1 a decode step is a chain of small launches between its GEMVs). The
rotation is kernels.elementwise's (`rotated_heads`, the same roundings, no fused
multiply-add), so query, key and the cache hold the bits the two launches wrote.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import validation
from kernels.elementwise import check_rotary_inputs, rotary_cos_sin, rotated_heads
from kernels.launch import check_kernel_device, next_power_of_2


@triton.jit
def _rotary_and_cache_kernel(
    query_out_ptr,  # [num_tokens, NUM_Q_HEADS, HEAD_DIM], contiguous
    key_out_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM], contiguous
    query_ptr,  # [num_tokens, NUM_Q_HEADS, HEAD_DIM], head_dim contiguous
    key_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM], head_dim contiguous
    value_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM], head_dim contiguous
    cos_ptr,  # [num_tokens, ROTARY_DIM], rotary_dim contiguous
    sin_ptr,  # [num_tokens, ROTARY_DIM], rotary_dim contiguous
    kv_ptr,  # [2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM], dense from num_blocks on
    slot_mapping_ptr,  # int64 [num_tokens], -1 = skip
    num_slots,  # num_blocks * block_size
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cos_token,
    stride_sin_token,
    stride_kv_kind,  # elements between the K and V planes of kv
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,  # next power of 2 >= NUM_Q_HEADS
    BLOCK_HK: tl.constexpr,  # next power of 2 >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of 2 >= HEAD_DIM
):
    """One program per token: its query and key heads rotated, its K/V written."""
    token = tl.program_id(0).to(tl.int64)
    cos, sin = rotary_cos_sin(
        cos_ptr, sin_ptr, token, stride_cos_token, stride_sin_token, ROTARY_DIM, BLOCK_D
    )
    dims = tl.arange(0, BLOCK_D)
    q_heads = tl.arange(0, BLOCK_HQ)
    query = rotated_heads(
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
    q_offsets = q_heads[:, None] * HEAD_DIM + dims[None, :]
    q_mask = (q_heads[:, None] < NUM_Q_HEADS) & (dims[None, :] < HEAD_DIM)
    tl.store(query_out_ptr + token * (NUM_Q_HEADS * HEAD_DIM) + q_offsets, query, mask=q_mask)
    kv_heads = tl.arange(0, BLOCK_HK)
    key = rotated_heads(
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
    kv_offsets = kv_heads[:, None] * HEAD_DIM + dims[None, :]
    kv_mask = (kv_heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    tl.store(key_out_ptr + token * (NUM_KV_HEADS * HEAD_DIM) + kv_offsets, key, mask=kv_mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        value = tl.load(
            value_ptr + token * stride_value_token + kv_heads[:, None] * stride_value_head + dims[None, :],
            mask=kv_mask,
        )
        dst = kv_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + kv_offsets
        tl.store(dst, key, mask=kv_mask)
        tl.store(dst + stride_kv_kind, value, mask=kv_mask)


def rotary_and_cache(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], head_dim contiguous
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    cos: torch.Tensor,  # [num_tokens, rotary_dim]
    sin: torch.Tensor,  # [num_tokens, rotary_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    *,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_qk(query, key, cos, sin)` -> new contiguous (query, key), and token t's
    rotated key and its value written into slot slot_mapping[t] of `kv_layer`, as
    `reshape_and_cache` writes them (slot -1 is skipped; so is a slot out of range, which
    is never read back: callers build the slots themselves). `check_inputs=False` skips the
    shape, dtype and device checks (the model runner checks at a step's first layer; the
    others pass the same kinds of tensors). Raises ValueError on bad inputs."""
    if check_inputs:
        check_rotary_inputs(query, key, cos, sin)
        validation.check_kv_layer(kv_layer)
        for name, tensor in (("key", key), ("value", value)):
            validation.check_ndim(name, tensor, 3, "[num_tokens, num_kv_heads, head_dim]")
            validation.check_same(name, tensor, "kv_layer", kv_layer)
            if tuple(tensor.shape[1:]) != tuple(kv_layer.shape[3:]) or tensor.shape[0] != query.shape[0]:
                raise ValueError(
                    f"{name} shape {tuple(tensor.shape)} must be [{query.shape[0]}, {kv_layer.shape[3]}, "
                    f"{kv_layer.shape[4]}] to match query and kv_layer"
                )
            if tensor.shape[2] > 1 and tensor.stride(2) != 1:
                raise ValueError(f"{name} must be contiguous along head_dim, got strides {tensor.stride()}")
        check_kernel_device("kv_layer", kv_layer, _rotary_and_cache_kernel)
        validation.check_slot_mapping(slot_mapping, query.shape[0], kv_layer.device)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query_out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    key_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    _rotary_and_cache_kernel[(num_tokens,)](
        query_out,
        key_out,
        query,
        key,
        value,
        cos,
        sin,
        kv_layer,
        slot_mapping,
        kv_layer.shape[1] * kv_layer.shape[2],
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos.stride(0),
        sin.stride(0),
        kv_layer.stride(0),
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROTARY_DIM=cos.shape[1],
        BLOCK_HQ=next_power_of_2(num_heads),
        BLOCK_HK=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
        enable_fp_fusion=False,  # float32 too rounds each product, as torch does (no FMA)
    )
    return query_out, key_out
