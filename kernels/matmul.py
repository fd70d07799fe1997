"""Batch-invariant linear layer: out = x @ weight.T (+ bias) without split-K, tile by a proven table.

Called by the deterministic mode (engine.deterministic) for every linear layer of the
model on CUDA, once per layer per step. A row's result depends on that row of x and on
the weights only: there is no split-K, and every program reduces K in BLOCK_K steps
from 0 upwards in one float32 accumulator. cuBLAS, in contrast, picks its algorithm and
split-K factor from M, so one token's output changes with the batch it is computed in.

Which tile: the order in which one output element's K is summed in the source program
depends only on K and BLOCK_K. BLOCK_M, BLOCK_N, warps, stages, the launch order
(grouped rows, persistent programs) and how tiles are loaded (pointers or TMA) do not
change it, but they change which tensor-core instruction the compiler emits (Hopper's
wgmma m64nNk16 for BLOCK_M >= 64, mma.sync below), and whether that instruction's
internal rounding is the same for every N is the hardware's business. So the tile may
follow the problem size (M, N) only through `PROVEN_TILE_PLANS`: tiles that
benchmarks/gemm_configs.py found bit-identical, row for row, to the baseline tile on
the GPU at every row count it tried; and only while `USE_TILE_PLAN` is True (on the
H100 every candidate was; the plan picks the fastest per size band).
tests/kernels/test_gpu_batch_invariant.py asserts that bit-identity for every tile of
the plans, so a wrong table fails there. With the switch off, every size uses the
baseline tile (one tile per dtype).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import check_kernel_device


@dataclass(frozen=True)
class GemmTile:
    """One launch configuration of `_linear_kernel`. Every tile of a dtype has the same
    BLOCK_K (the reduction order); the rest only changes speed (and possibly, on some
    hardware, the tensor-core instruction: hence the proofs)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    #: row tiles that walk the column tiles together (L2 reuse of the weights)
    group_m: int = 8
    #: one program per SM looping over tiles, instead of one program per tile
    persistent: bool = False
    #: load x and weight tiles with Hopper's TMA (host tensor descriptors); falls back to
    #: pointer loads when the operands are not 16-byte aligned
    tma: bool = False

    @property
    def name(self) -> str:
        flags = "".join((" persistent" if self.persistent else "", " tma" if self.tma else ""))
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
            f" g{self.group_m}{flags}"
        )


#: dtype -> the baseline tile: the reference of every bit-identity proof, and the tile of every
#: size when USE_TILE_PLAN is off (or a dtype has no plan, as float32). 16-bit: the
#: vLLM batch-invariant tile (H100 wgmma, 96 KB of shared memory over 3 stages); float32 dots
#: run on FMA units (input_precision="ieee"), where smaller tiles keep operands in registers.
BASELINE_TILES: dict[torch.dtype, GemmTile] = {
    torch.bfloat16: GemmTile(128, 128, 64, 8, 3),
    torch.float16: GemmTile(128, 128, 64, 8, 3),
    torch.float32: GemmTile(64, 64, 32, 4, 2),
}

#: Hopper-friendly 16-bit tiles that benchmarks/gemm_configs.py sweeps (all BLOCK_K 64, as
#: the baseline): bigger tiles for many rows, narrow ones for decode-sized M (more programs
#: stream the weights), persistent and TMA variants. The 32-row tile is a probe: below 64 rows
#: Triton emits mma.sync instead of wgmma, so it shows whether the instruction matters.
CANDIDATE_TILES_16BIT: tuple[GemmTile, ...] = (
    GemmTile(128, 128, 64, 8, 3),
    GemmTile(128, 128, 64, 8, 4),
    GemmTile(128, 256, 64, 8, 3),
    GemmTile(128, 256, 64, 8, 4),
    GemmTile(64, 256, 64, 4, 4),
    GemmTile(64, 128, 64, 4, 4),
    GemmTile(64, 64, 64, 4, 5),
    GemmTile(64, 32, 64, 4, 6),
    GemmTile(128, 128, 64, 8, 3, persistent=True),
    GemmTile(128, 256, 64, 8, 3, persistent=True),
    GemmTile(128, 128, 64, 8, 3, tma=True),
    GemmTile(128, 256, 64, 8, 3, tma=True),
    GemmTile(64, 128, 64, 4, 4, tma=True),
    GemmTile(128, 256, 64, 8, 3, persistent=True, tma=True),
    GemmTile(32, 64, 64, 4, 4),
    # after the first H100 sweep: deeper pipelines for decode-sized M (qkv at 64 rows was 0.57x
    # cuBLAS), 128-wide TMA tiles for the middle band
    GemmTile(64, 32, 64, 4, 8),
    GemmTile(64, 16, 64, 4, 8),
    GemmTile(128, 128, 64, 8, 4, tma=True),
    GemmTile(128, 128, 64, 8, 4, persistent=True, tma=True),
    GemmTile(64, 128, 64, 4, 5, persistent=True, tma=True),
)

#: float32 tiles (FMA dots: the order of K is the source's by construction); interpreter tests
#: run them, the benchmark checks them too. (A TMA float32 tile spills 336 bytes on sm_90.)
CANDIDATE_TILES_FP32: tuple[GemmTile, ...] = (
    GemmTile(64, 64, 32, 4, 2),
    GemmTile(32, 64, 32, 4, 2),
    GemmTile(64, 64, 32, 4, 2, persistent=True),
)


@dataclass(frozen=True)
class TileRule:
    """Use `tile` for M <= max_rows rows and N <= max_cols columns (None: no bound)."""

    max_rows: int | None
    max_cols: int | None
    tile: GemmTile

    def matches(self, num_rows: int, num_cols: int) -> bool:
        return (self.max_rows is None or num_rows <= self.max_rows) and (
            self.max_cols is None or num_cols <= self.max_cols
        )


@dataclass(frozen=True)
class TilePlan:
    """Tile by problem size: the first rule that matches (M, N) wins; the last rule matches
    everything. Only a speed choice: every tile of a plan must give the same bits (same
    BLOCK_K here, proven on the GPU by benchmarks/gemm_configs.py), so a row's result does
    not depend on which rule M picks."""

    rules: tuple[TileRule, ...]

    def __post_init__(self) -> None:
        if not self.rules or self.rules[-1].max_rows is not None or self.rules[-1].max_cols is not None:
            raise ValueError("a tile plan must end with a rule for every size (max_rows=max_cols=None)")
        if len({rule.tile.block_k for rule in self.rules}) != 1:
            raise ValueError("every tile of a plan must share BLOCK_K (the reduction order)")

    def tile_for(self, num_rows: int, num_cols: int) -> GemmTile:
        return next(rule.tile for rule in self.rules if rule.matches(num_rows, num_cols))

    @property
    def tiles(self) -> tuple[GemmTile, ...]:
        return tuple(dict.fromkeys(rule.tile for rule in self.rules))


def _hopper_16bit_plan() -> TilePlan:
    """From `benchmarks/gemm_configs.py --quick` on an H100 80GB HBM3 (Triton 3.6, 02:06 UTC
    on 24 Nov 2026, at 1733707): all 15 candidate tiles bit-identical to the baseline in bf16
    and fp16 at M 1 to 8192 on the 8B's shapes; the fastest per (M, N) band (TFLOP/s, cuBLAS
    in brackets): M <= 64 narrow N 64x32 (qkv 63 [110], down 114 [131]), wide N 64x64 (gate_up
    154 [155], LM head 176 [170]); M 512 N <= 4096 64x128 TMA (down 550 [704]), wider
    128x256 persistent TMA (qkv 479 [624], gate_up 605 [702]); M 8192 128x256 persistent TMA
    (qkv 645 [712], gate_up 670 [639], down 697 [708]). The quick run timed M 64, 512 and
    8192 only: the 1024-row bound of the narrow band is a guess between them (the full run
    times 16 to 8192 rows and o_proj)."""
    big = GemmTile(128, 256, 64, 8, 3, persistent=True, tma=True)
    return TilePlan(
        (
            TileRule(64, 8192, GemmTile(64, 32, 64, 4, 6)),
            TileRule(64, None, GemmTile(64, 64, 64, 4, 5)),
            TileRule(1024, 4096, GemmTile(64, 128, 64, 4, 4, tma=True)),
            TileRule(None, None, big),
        )
    )


#: dtype -> tile plan, only tiles that benchmarks/gemm_configs.py reported bit-identical to
#: BASELINE_TILES[dtype] on the GPU (its JSON's "suggested_plan_source" prints an entry).
PROVEN_TILE_PLANS: dict[torch.dtype, TilePlan] = {
    torch.bfloat16: _hopper_16bit_plan(),
    torch.float16: _hopper_16bit_plan(),
}

#: The switch: False -> BASELINE_TILES for every size; True -> PROVEN_TILE_PLANS where a dtype
#: has one. Change the plans only from a GPU run of benchmarks/gemm_configs.py, and run
#: tests/kernels/test_gpu_batch_invariant.py (it checks every planned tile's bits) on that GPU.
USE_TILE_PLAN = True


def tile_for(dtype: torch.dtype, num_rows: int, num_cols: int) -> GemmTile:
    """The tile `linear` uses for an [M = num_rows, N = num_cols] output of `dtype`."""
    if USE_TILE_PLAN and dtype in PROVEN_TILE_PLANS:
        return PROVEN_TILE_PLANS[dtype].tile_for(num_rows, num_cols)
    return BASELINE_TILES[dtype]


def row_counts_per_tile(dtype: torch.dtype, num_cols: int, max_rows: int) -> list[int]:
    """One row count in 1..max_rows for each tile `tile_for` picks for `num_cols` columns:
    running `linear` at these compiles every tile a layer can meet (the start-up warm-up).
    The tile only changes at a rule's max_rows + 1, so 1 and those bounds cover them all."""
    bounds = {1}
    if USE_TILE_PLAN and dtype in PROVEN_TILE_PLANS:
        bounds |= {rule.max_rows + 1 for rule in PROVEN_TILE_PLANS[dtype].rules if rule.max_rows is not None}
    by_tile: dict[GemmTile, int] = {}
    for num_rows in sorted(bound for bound in bounds if bound <= max_rows):
        by_tile.setdefault(tile_for(dtype, num_rows, num_cols), num_rows)
    return list(by_tile.values())


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles walk the column tiles together."""
    group_size = GROUP_M * num_pid_n
    first_m = (tile_id // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_size) % rows_in_group
    pid_n = (tile_id % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def _linear_tile(
    out_ptr,
    x_src,
    weight_src,
    bias_ptr,
    pid_m,
    pid_n,
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
    USE_TMA: tl.constexpr,
    DOT_AS_SUM: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile: K from 0 up in BLOCK_K steps, one fp32 accumulator."""
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    inner = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, num_inner, BLOCK_K):
        if USE_TMA:
            # Out-of-bounds rows, columns and K are zero-filled, as the masked loads below.
            x = x_src.load([pid_m * BLOCK_M, k_start])  # [BLOCK_M, BLOCK_K]
            w_t = weight_src.load([pid_n * BLOCK_N, k_start]).T  # [BLOCK_K, BLOCK_N]
        else:
            k = k_start + inner
            k_mask = k < num_inner
            x = tl.load(
                x_src + rows[:, None] * stride_x_row + k[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            w_t = tl.load(
                weight_src + cols[None, :] * stride_weight_col + k[:, None],
                mask=col_mask[None, :] & k_mask[:, None],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
        if DOT_AS_SUM:
            # Rank-1 updates k by k: each element's K is summed sequentially whatever the tile
            # (a BLAS dot's order may follow the shapes; a 3-D product would outgrow the
            # interpreter's block limit at 128x256x64).
            x_f32 = x.to(tl.float32)
            w_f32 = w_t.to(tl.float32)
            for kk in tl.static_range(BLOCK_K):
                x_col = tl.gather(x_f32, tl.full([BLOCK_M, 1], kk, tl.int32), axis=1)  # [BLOCK_M, 1]
                w_row = tl.gather(w_f32, tl.full([1, BLOCK_N], kk, tl.int32), axis=0)  # [1, BLOCK_N]
                acc += x_col * w_row
        else:
            acc = tl.dot(x, w_t, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_out_row + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# M varies per step: without do_not_specialize Triton compiles a variant per value class of it.
@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(
    out_ptr,  # [num_rows, num_cols], row-major
    x_src,  # [num_rows, num_inner], inner dim contiguous (a tensor descriptor when USE_TMA)
    weight_src,  # [num_cols, num_inner], inner dim contiguous (a tensor descriptor when USE_TMA)
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
    PERSISTENT: tl.constexpr,  # programs loop over tiles (grid = min(tiles, SMs))
    USE_TMA: tl.constexpr,
    DOT_AS_SUM: tl.constexpr,  # CPU interpreter: an exact per-row product sum instead of a BLAS dot
):
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(num_cols, BLOCK_N)
    if PERSISTENT:
        for tile_id in range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            _linear_tile(
                out_ptr, x_src, weight_src, bias_ptr, pid_m, pid_n, num_rows, num_cols, num_inner,
                stride_x_row, stride_weight_col, stride_out_row,
                HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_AS_SUM,
            )  # fmt: skip
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _linear_tile(
            out_ptr, x_src, weight_src, bias_ptr, pid_m, pid_n, num_rows, num_cols, num_inner,
            stride_x_row, stride_weight_col, stride_out_row,
            HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_AS_SUM,
        )  # fmt: skip


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and row strides (and a unit inner stride)."""
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1
        for t in tensors
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: GemmTile | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, batch-invariantly.

    Every row of the result is bit-identical whatever the other rows (their number,
    values and order): no split-K, and the tile is `tile_for(dtype, M, N)`, one of the
    tiles proven to give the baseline's bits. `tile` forces a tile (benchmarks and
    tests); its BLOCK_K must be the dtype's baseline one. Raises ValueError on mismatched shapes,
    dtypes or devices.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("x and weight must be torch tensors")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [out_features, in_features], got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must end with in_features={weight.shape[1]}")
    if x.dtype not in BASELINE_TILES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight ({weight.dtype} on {weight.device}) must match x ({x.dtype} on {x.device})")
    num_cols, num_inner = weight.shape
    if bias is not None and (bias.shape != (num_cols,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(
            f"bias must be [{num_cols}] {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )
    if tile is not None and tile.block_k != BASELINE_TILES[x.dtype].block_k:
        raise ValueError(
            f"tile {tile.name} reduces K in another order than {x.dtype}'s BLOCK_K "
            f"{BASELINE_TILES[x.dtype].block_k}"
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
    if tile is None:
        tile = tile_for(x.dtype, num_rows, num_cols)
    num_tiles = triton.cdiv(num_rows, tile.block_m) * triton.cdiv(num_cols, tile.block_n)
    if tile.persistent:
        num_programs = _num_sms(x.device.index or 0) if x.device.type == "cuda" else 3
        grid = (min(num_tiles, num_programs),)
    else:
        grid = (num_tiles,)
    x_src, weight_src = x_2d, weight
    use_tma = tile.tma and _tma_ready(x_2d, weight)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_src = TensorDescriptor.from_tensor(x_2d, [tile.block_m, tile.block_k])
        weight_src = TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k])
    _linear_kernel[grid](
        out,
        x_src,
        weight_src,
        bias if bias is not None else weight,
        num_rows,
        num_cols,
        num_inner,
        x_2d.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m,
        PERSISTENT=tile.persistent,
        USE_TMA=use_tma,
        DOT_AS_SUM=x.device.type == "cpu",
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out.reshape(*x.shape[:-1], num_cols)
