"""Batch-invariant linear layer: out = x @ weight.T (+ bias) with one fixed tile per dtype.

Called by the deterministic mode (engine.deterministic) for every linear layer of the
model on CUDA, once per layer per step. A row's result depends on that row of x and on
the weights only: the tile shape is a constant of the dtype (never chosen from the
number of rows), there is no split-K, and every program reduces K in BLOCK_K steps from
0 upwards in one float32 accumulator. cuBLAS, in contrast, picks its algorithm and
split-K factor from M, so one token's output changes with the batch it is computed in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import check_kernel_device

#: dtype -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). One tile per dtype, whatever M.
#: 16-bit: the vLLM batch-invariant tile (H100 wgmma, 96 KB of shared memory over 3 stages);
#: float32 dots run on FMA units, where smaller tiles keep the operands in registers.
TILE_CONFIGS: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 64, 32, 4, 2),
}
_GROUP_M = 8  # programs of one group share weight tiles in L2; changes no reduction


# M varies per step: without do_not_specialize Triton compiles a variant per value class of it.
@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(
    out_ptr,  # [num_rows, num_cols], row-major
    x_ptr,  # [num_rows, num_inner], inner dim contiguous
    weight_ptr,  # [num_cols, num_inner], inner dim contiguous
    bias_ptr,  # [num_cols] (HAS_BIAS only)
    num_rows,
    num_cols,
    num_inner,
    stride_x_row,
    stride_weight_col,
    stride_out_row,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_AS_SUM: tl.constexpr,  # CPU interpreter: an exact per-row product sum instead of a BLAS dot
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(num_cols, BLOCK_N)
    # Grouped order: GROUP_M row tiles walk the column tiles together (L2 reuse of the weights).
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    inner = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, num_inner, BLOCK_K):
        k = k_start + inner
        k_mask = k < num_inner
        x = tl.load(
            x_ptr + rows[:, None] * stride_x_row + k[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w_t = tl.load(
            weight_ptr + cols[None, :] * stride_weight_col + k[:, None],
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if DOT_AS_SUM:
            # Elementwise products summed along K in a fixed order (numpy reduces one axis of a
            # 3-D array element by element): no dependence on the other rows of the tile.
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w_t.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w_t, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_out_row + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, batch-invariantly.

    Every row of the result is bit-identical whatever the other rows (their number,
    values and order): one tile configuration per dtype and no split-K. Raises
    ValueError on mismatched shapes, dtypes or devices.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("x and weight must be torch tensors")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [out_features, in_features], got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must end with in_features={weight.shape[1]}")
    if x.dtype not in TILE_CONFIGS:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight ({weight.dtype} on {weight.device}) must match x ({x.dtype} on {x.device})")
    num_cols, num_inner = weight.shape
    if bias is not None and (bias.shape != (num_cols,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(
            f"bias must be [{num_cols}] {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )
    check_kernel_device("x", x, _linear_kernel)
    x_2d = x.reshape(-1, num_inner)
    if num_inner > 1 and x_2d.stride(1) != 1:
        x_2d = x_2d.contiguous()
    if num_inner > 1 and weight.stride(1) != 1:
        weight = weight.contiguous()
    num_rows = x_2d.shape[0]
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out.reshape(*x.shape[:-1], num_cols)
    if num_inner == 0:
        out.copy_(bias.expand_as(out) if bias is not None else torch.zeros_like(out))
        return out.reshape(*x.shape[:-1], num_cols)
    block_m, block_n, block_k, num_warps, num_stages = TILE_CONFIGS[x.dtype]
    grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(num_cols, block_n),)
    _linear_kernel[grid](
        out,
        x_2d,
        weight,
        bias if bias is not None else weight,
        num_rows,
        num_cols,
        num_inner,
        x_2d.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=_GROUP_M,
        DOT_AS_SUM=x.device.type == "cpu",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.reshape(*x.shape[:-1], num_cols)
