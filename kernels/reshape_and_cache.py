"""Write new tokens' K and V into one layer's paged KV blocks.

Called once per layer per engine step on CUDA, before attention reads the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import validation
from kernels.launch import check_kernel_device, next_power_of_2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim], dense from num_blocks on
    slot_mapping_ptr,  # int64 [num_tokens], -1 = skip
    num_slots,  # num_blocks * block_size
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kv_kind,  # elements between the K and V planes of kv
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of 2 >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of 2 >= HEAD_DIM
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    dst = kv_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(dst, key, mask=mask)
    tl.store(dst + stride_kv_kind, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    *,
    check_values: bool = True,
    check_inputs: bool = True,
) -> None:
    """Write token t's key/value into slot slot_mapping[t] of `kv_layer`; slot -1 is skipped.

    `key`/`value` may be strided views (e.g. slices of a fused QKV output) as long as
    head_dim is contiguous. `check_values` reads slot_mapping to validate its range (a
    stream sync on CUDA); callers that built the slots themselves may pass False, in
    which case out-of-range slots are skipped by the kernel instead of reported.
    `check_inputs=False` skips the shape, dtype and device checks (the engine checks them
    at a step's first layer; the other layers pass the same kinds of tensors).
    """
    if check_inputs:
        validation.check_kv_layer(kv_layer)
        for name, tensor in (("key", key), ("value", value)):
            validation.check_ndim(name, tensor, 3, "[num_tokens, num_kv_heads, head_dim]")
            validation.check_same(name, tensor, "kv_layer", kv_layer)
            if tuple(tensor.shape[1:]) != tuple(kv_layer.shape[3:]):
                raise ValueError(
                    f"{name} shape {tuple(tensor.shape)} must be [num_tokens, {kv_layer.shape[3]}, "
                    f"{kv_layer.shape[4]}] to match kv_layer"
                )
            if tensor.shape[2] > 1 and tensor.stride(2) != 1:
                raise ValueError(f"{name} must be contiguous along head_dim, got strides {tensor.stride()}")
        if key.shape[0] != value.shape[0]:
            raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
        check_kernel_device("kv_layer", kv_layer, _reshape_and_cache_kernel)
        validation.check_slot_mapping(slot_mapping, key.shape[0], kv_layer.device)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    if check_values:
        validation.check_slot_values(slot_mapping, num_blocks * block_size)
    if key.shape[0] == 0:
        return
    _reshape_and_cache_kernel[(key.shape[0],)](
        key,
        value,
        kv_layer,
        slot_mapping,
        num_blocks * block_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_layer.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )
