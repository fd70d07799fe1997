"""Compile the deterministic mode's kernels (batch-invariant GEMM, row-wise RMSNorm) for
an H100 (sm_90) with Triton's bundled ptxas, without a GPU.

Run as `python -m tests.kernels.sm90_compile_batch_invariant` with TRITON_INTERPRET
unset; prints one JSON row per configuration (shared memory, registers, spills, and
for the GEMM whether the PTX uses Hopper's wgmma tensor-core instructions). The tile
configurations are the wrappers' own (kernels.matmul.TILE_CONFIGS). The batch-invariant
attention uses paged_attention's prefill tile, compiled by tests/kernels/sm90_compile.py.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.launch import next_power_of_2
from kernels.matmul import _GROUP_M, TILE_CONFIGS, _linear_kernel
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


def linear_cases():
    for dtype in (torch.bfloat16, torch.float32):
        block_m, block_n, block_k, num_warps, num_stages = TILE_CONFIGS[dtype]
        ptr = f"*{TRITON_TYPES[dtype]}"
        for has_bias in (False, True):
            compiled = compile_for_h100(
                _linear_kernel,
                {
                    "out_ptr": ptr,
                    "x_ptr": ptr,
                    "weight_ptr": ptr,
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
                    "BLOCK_M": block_m,
                    "BLOCK_N": block_n,
                    "BLOCK_K": block_k,
                    "GROUP_M": _GROUP_M,
                    "DOT_AS_SUM": False,
                },
                num_warps=num_warps,
                num_stages=num_stages,
                divisible=("num_cols", "num_inner"),
            )
            row = describe(f"linear {TRITON_TYPES[dtype]}{' bias' if has_bias else ''}", compiled)
            row["wgmma"] = compiled.asm["ptx"].count("wgmma.mma_async")
            yield row


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
    for result in (*linear_cases(), *rms_norm_cases()):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
