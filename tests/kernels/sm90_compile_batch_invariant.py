"""Compile the deterministic mode's kernels (batch-invariant GEMM, row-wise RMSNorm) for
an H100 (sm_90) with Triton's bundled ptxas, without a GPU.

Run as `python -m tests.kernels.sm90_compile_batch_invariant` with TRITON_INTERPRET
unset; prints one JSON row per configuration (shared memory, registers, spills, and
for the GEMM whether the PTX uses Hopper's wgmma tensor-core instructions). The tile
configurations are the wrapper's baseline tiles and the candidate tiles that
benchmarks/gemm_configs.py sweeps (kernels.matmul); then the batch-invariant attention
with KV ranges at fixed positions (one program, or one per range) and its merge.
"""

from __future__ import annotations

import json
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.launch import next_power_of_2
from kernels.matmul import (
    BASELINE_TILES,
    CANDIDATE_TILES_16BIT,
    CANDIDATE_TILES_FP32,
    GemmTile,
    _linear_kernel,
)
from kernels.rms_norm import _rms_norm_kernel
from tests.kernels.sm90_compile import TRITON_TYPES, describe


def compile_for_h100(kernel, signature, constexprs, num_warps: int, num_stages: int, divisible=()):
    """tests.kernels.sm90_compile.compile_for_h100, with the ints in `divisible` also marked
    16-divisible, as Triton marks them at a launch where they are (the 8B's K and N)."""
    attrs = {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in signature.items()
        if kind.startswith("*") or name.startswith("stride") or name in divisible
    }
    source = ASTSource(
        kernel,
        {**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs={(kernel.arg_names.index(name),): value for name, value in constexprs.items()},
        attrs=attrs,
    )
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def compile_linear(dtype: torch.dtype, tile: GemmTile, has_bias: bool):
    """`_linear_kernel` with `tile` for an H100, as a launch with the 8B's (16-divisible) K and N."""
    ptr = f"*{TRITON_TYPES[dtype]}"
    x_type = weight_type = ptr
    if tile.tma:
        x_type = f"tensordesc<{TRITON_TYPES[dtype]}[{tile.block_m}, {tile.block_k}]>"
        weight_type = f"tensordesc<{TRITON_TYPES[dtype]}[{tile.block_n}, {tile.block_k}]>"
    compiled = compile_for_h100(
        _linear_kernel,
        {
            "out_ptr": ptr,
            "x_src": x_type,
            "weight_src": weight_type,
            "bias_ptr": ptr,
            "num_rows": "i32",
            "num_cols": "i32",
            "num_inner": "i32",
            "stride_x_row": "i32",
            "stride_weight_col": "i32",
            "stride_out_row": "i32",
        },
        {
            "HAS_BIAS": has_bias,
            "BLOCK_M": tile.block_m,
            "BLOCK_N": tile.block_n,
            "BLOCK_K": tile.block_k,
            "GROUP_M": tile.group_m,
            "PERSISTENT": tile.persistent,
            "USE_TMA": tile.tma,
            "DOT_AS_SUM": False,
        },
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        divisible=("num_cols", "num_inner"),
    )
    return compiled


def _describe_linear(name: str, compiled) -> dict:
    row = describe(name, compiled)
    ptx = compiled.asm["ptx"]
    row["wgmma"] = ptx.count("wgmma.mma_async")
    #: the tensor-core instruction shapes the PTX uses (e.g. wgmma m64n128k16, mma.sync m16n8k16)
    row["mma_shapes"] = sorted(
        set(re.findall(r"(?:wgmma\.mma_async|mma)\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    )
    return row


def linear_cases():
    """The baseline tiles (with and without bias), then every candidate tile without bias."""
    for dtype in (torch.bfloat16, torch.float32):
        for has_bias in (False, True):
            compiled = compile_linear(dtype, BASELINE_TILES[dtype], has_bias)
            yield _describe_linear(f"linear {TRITON_TYPES[dtype]}{' bias' if has_bias else ''}", compiled)
    for dtype, tiles in ((torch.bfloat16, CANDIDATE_TILES_16BIT), (torch.float32, CANDIDATE_TILES_FP32)):
        for tile in tiles:
            row = _describe_linear(
                f"candidate {TRITON_TYPES[dtype]} {tile.name}", compile_linear(dtype, tile, False)
            )
            row.update(candidate=True, block_m=tile.block_m)
            yield row


def attention_cases():
    """The batch-invariant attention (8B heads, bf16 and fp32): one program walking its
    positional KV ranges, one program per range, and the merge of the ranges."""
    from kernels.attention_launch import BATCH_INVARIANT_KV_SPLIT_LEN, batch_invariant_launch_config
    from kernels.paged_attention import _merge_positional_splits_kernel, _paged_attention_kernel

    num_heads, num_kv_heads, head_dim = 32, 8, 128
    group = num_heads // num_kv_heads
    # the fixed tile in both dtypes, and bf16's decode tile (BATCH_INVARIANT_TILE_FOLLOWS_QUERIES)
    for dtype, max_query_len in ((torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, 1)):
        block_q, block_m, block_n = batch_invariant_launch_config(group, dtype, max_query_len)
        ptr = f"*{TRITON_TYPES[dtype]}"
        for split in (False, True):
            compiled = compile_for_h100(
                _paged_attention_kernel,
                {
                    "out_ptr": ptr,
                    "split_out_ptr": "*fp32",
                    "split_lse_ptr": "*fp32",
                    "query_ptr": ptr,
                    "kv_ptr": ptr,
                    "block_tables_ptr": "*i32",
                    "seq_lens_ptr": "*i32",
                    "query_start_loc_ptr": "*i32",
                    "num_seqs": "i32",
                    "num_kv_splits": "i32",
                    "scale_log2": "fp32",
                    "stride_query_token": "i32",
                    "stride_query_head": "i32",
                    "stride_out_token": "i32",
                    "stride_out_head": "i32",
                    "stride_kv_kind": "i64",
                    "stride_kv_block": "i32",
                    "stride_tables_seq": "i32",
                },
                {
                    "NUM_KV_HEADS": num_kv_heads,
                    "HEAD_DIM": head_dim,
                    "PAGE_SIZE": 16,
                    "GROUP": group,
                    "BLOCK_Q": block_q,
                    "BLOCK_M": block_m,
                    "BLOCK_N": block_n,
                    "BLOCK_D": head_dim,
                    "DOT_IN_FP32": False,
                    "SPLIT": split,
                    "KV_SPLIT_LEN": BATCH_INVARIANT_KV_SPLIT_LEN,
                },
                num_warps=4,
                num_stages=2,
            )
            kind = ("program per range" if split else "one program") + (
                " decode tile" if max_query_len else ""
            )
            row = describe(f"batch-invariant attention {TRITON_TYPES[dtype]} {kind}", compiled)
            #: the row sums run on the tensor cores (ROW_SUM_BY_DOT): bf16 tiles use MMA instructions
            row["mma"] = compiled.asm["ptx"].count("mma")
            yield row
    compiled = compile_for_h100(
        _merge_positional_splits_kernel,
        {
            "out_ptr": "*bf16",
            "split_out_ptr": "*fp32",
            "split_lse_ptr": "*fp32",
            "num_kv_splits": "i32",
            "stride_out_token": "i32",
            "stride_out_head": "i32",
        },
        {"NUM_HEADS": num_heads, "HEAD_DIM": head_dim, "BLOCK_H": num_heads, "BLOCK_D": head_dim},
        num_warps=4,
        num_stages=1,
    )
    yield describe("batch-invariant merge of positional ranges bf16", compiled)


def rms_norm_cases():
    for dtype, dim in ((torch.bfloat16, 4096), (torch.bfloat16, 128), (torch.float32, 4096)):
        block_d = next_power_of_2(dim)
        ptr = f"*{TRITON_TYPES[dtype]}"
        compiled = compile_for_h100(
            _rms_norm_kernel,
            {
                "out_ptr": ptr,
                "x_ptr": ptr,
                "weight_ptr": ptr,
                "num_rows": "i32",
                "dim": "i32",
                "eps": "fp32",
                "stride_x_row": "i32",
                "stride_out_row": "i32",
            },
            {"BLOCK_D": block_d},
            num_warps=max(1, min(16, block_d // 256)),
            num_stages=1,
        )
        yield describe(f"rms_norm {TRITON_TYPES[dtype]} d={dim}", compiled)


def main() -> None:
    for result in (*linear_cases(), *rms_norm_cases(), *attention_cases()):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
