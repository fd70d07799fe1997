"""Row-wise RMSNorm: one program per row, the row reduced in one fixed order.

Called by the deterministic mode (engine.deterministic) for every norm of the model on
CUDA, once per norm per step. torch's reduction kernels choose their work split from
the tensor's shape, so the sum of squares of one row can change with the number of
rows; here each row is summed by its own program over BLOCK_D lanes, the same way
whatever the batch. Numerics follow Hugging Face: the norm in float32, the product
with the weight in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import check_kernel_device, next_power_of_2


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    out_ptr,  # [num_rows, dim], row-major
    x_ptr,  # [num_rows, dim], dim contiguous
    weight_ptr,  # [dim]
    num_rows,
    dim,
    eps,
    stride_x_row,
    stride_out_row,
    BLOCK_D: tl.constexpr,  # a power of 2 >= dim
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / dim
    normed = (x32 * (1.0 / tl.sqrt(mean_square + eps))).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # The product of two 16-bit floats is exact in float32, so this rounds once, like torch's
    # 16-bit multiply (and the CPU interpreter miscomputes 16-bit arithmetic).
    product = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, product.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> weight * x / sqrt(mean(x^2) + eps), in x's dtype, row by row.

    Every row is bit-identical whatever the other rows. Raises ValueError on a bad
    shape, dtype or device.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("x and weight must be torch tensors")
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} must end with the weight's size {tuple(weight.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight ({weight.dtype} on {weight.device}) must match x ({x.dtype} on {x.device})")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    check_kernel_device("x", x, _rms_norm_kernel)
    dim = x.shape[-1]
    # the model's norms get [T, hidden] rows: no reshape (each costs host time, 65 calls a step)
    x_2d = x if x.dim() == 2 else x.reshape(-1, dim)
    if dim > 1 and x_2d.stride(1) != 1:
        x_2d = x_2d.contiguous()
    out = torch.empty((x_2d.shape[0], dim), dtype=x.dtype, device=x.device)
    if x_2d.shape[0] and dim:
        block_d = next_power_of_2(dim)
        _rms_norm_kernel[(x_2d.shape[0],)](
            out,
            x_2d,
            weight,
            x_2d.shape[0],
            dim,
            float(eps),
            x_2d.stride(0),
            out.stride(0),
            BLOCK_D=block_d,
            num_warps=max(1, min(16, block_d // 256)),
        )
    return out if x.dim() == 2 else out.reshape(x.shape)
