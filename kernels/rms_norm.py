"""Row-wise RMSNorm, and the residual add fused with it: one program per row, the row
reduced in one fixed order.

Called for every norm of the model on CUDA, once per norm per step: by the deterministic
mode (engine.deterministic) and by the one-launch glue (engine.models.llama's
`use_glue_kernels`). `add_rms_norm` serves the add-then-norm of a decoder layer (twice per
layer, and the final norm): one launch writes the new residual stream and its norm, where
torch's add and the norm took two. torch's reduction kernels choose their work split from
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
    _store_normed_row(out_ptr + row * stride_out_row, x, weight_ptr, cols, mask, dim, eps)


@triton.jit
def _store_normed_row(
    out_row_ptr,  # [dim]
    x,  # [BLOCK_D] in the input dtype, 0 past dim
    weight_ptr,  # [dim]
    cols,
    mask,
    dim,
    eps,
):
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / dim
    normed = (x32 * (1.0 / tl.sqrt(mean_square + eps))).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # The product of two 16-bit floats is exact in float32, so this rounds once, like torch's
    # 16-bit multiply (and the CPU interpreter miscomputes 16-bit arithmetic).
    product = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_row_ptr + cols, product.to(out_row_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(
    out_ptr,  # [num_rows, dim], row-major
    residual_out_ptr,  # [num_rows, dim], row-major
    x_ptr,  # [num_rows, dim], dim contiguous
    residual_ptr,  # [num_rows, dim], dim contiguous
    weight_ptr,  # [dim]
    num_rows,
    dim,
    eps,
    stride_x_row,
    stride_residual_row,
    stride_out_row,
    BLOCK_D: tl.constexpr,  # a power of 2 >= dim
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    residual = tl.load(residual_ptr + row * stride_residual_row + cols, mask=mask, other=0.0)
    # torch adds 16-bit floats in float32 and rounds the sum once: the same bits
    total = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    tl.store(residual_out_ptr + row * stride_out_row + cols, total, mask=mask)
    _store_normed_row(out_ptr + row * stride_out_row, total, weight_ptr, cols, mask, dim, eps)


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
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


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x [..., dim] as [rows, dim] with dim contiguous. The model's norms get [T, hidden]
    rows: no reshape (each costs host time, 65 calls a step)."""
    x_2d = x if x.dim() == 2 else x.reshape(-1, dim)
    if dim > 1 and x_2d.stride(1) != 1:
        x_2d = x_2d.contiguous()
    return x_2d


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> weight * x / sqrt(mean(x^2) + eps), in x's dtype, row by row.

    Every row is bit-identical whatever the other rows. Raises ValueError on a bad
    shape, dtype or device.
    """
    _check_norm_args(x, weight, eps)
    check_kernel_device("x", x, _rms_norm_kernel)
    dim = x.shape[-1]
    x_2d = _rows(x, dim)
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


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, weight, eps), x + residual) in one launch, x and residual
    [..., dim] of one shape -> two new tensors of that shape. The sum is rounded to the
    input dtype before the norm, as torch's add then the norm: bit-identical to
    `rms_norm(x + residual, weight, eps)` and to that sum. Raises ValueError on a bad
    shape, dtype or device."""
    if not isinstance(residual, torch.Tensor) or not isinstance(x, torch.Tensor):
        raise ValueError("x and residual must be torch tensors")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual ({tuple(residual.shape)}, {residual.dtype} on {residual.device}) must match "
            f"x ({tuple(x.shape)}, {x.dtype} on {x.device})"
        )
    _check_norm_args(x, weight, eps)
    check_kernel_device("x", x, _add_rms_norm_kernel)
    dim = x.shape[-1]
    x_2d = _rows(x, dim)
    residual_2d = _rows(residual, dim)
    out = torch.empty((x_2d.shape[0], dim), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    if x_2d.shape[0] and dim:
        block_d = next_power_of_2(dim)
        _add_rms_norm_kernel[(x_2d.shape[0],)](
            out,
            residual_out,
            x_2d,
            residual_2d,
            weight,
            x_2d.shape[0],
            dim,
            float(eps),
            x_2d.stride(0),
            residual_2d.stride(0),
            out.stride(0),
            BLOCK_D=block_d,
            num_warps=max(1, min(16, block_d // 256)),
        )
    if x.dim() == 2:
        return out, residual_out
    return out.reshape(x.shape), residual_out.reshape(x.shape)
