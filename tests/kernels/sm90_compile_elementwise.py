"""Compile the glue kernels (RoPE on query and key, SiLU-and-mul, RoPE with the KV-cache
write, the residual add with RMSNorm) for an H100 (sm_90) with Triton's bundled ptxas,
without a GPU.

Run as `python -m tests.kernels.sm90_compile_elementwise` with TRITON_INTERPRET unset;
prints one JSON row per configuration (shared memory, registers, spills, 16-byte vector
accesses). Launch parameters are the wrappers' own.
"""

from __future__ import annotations

import json
import sys

import torch

from kernels.elementwise import _SILU_BLOCK, _rotary_qk_kernel, _silu_and_mul_kernel
from kernels.launch import next_power_of_2
from kernels.rms_norm import _add_rms_norm_kernel
from kernels.rotary_cache import _rotary_and_cache_kernel
from tests.kernels.sm90_compile import TRITON_TYPES, compile_for_h100, describe

# (dtype, num_heads, num_kv_heads, head_dim, rotary_dim)
ROTARY_CASES = [
    (torch.bfloat16, 32, 8, 128, 128),  # Llama-3.1-8B
    (torch.bfloat16, 14, 2, 64, 32),  # partial rotary
    (torch.float16, 12, 2, 80, 80),
]


def rotary_cases():
    for dtype, num_heads, num_kv_heads, head_dim, rotary_dim in ROTARY_CASES:
        ptr = f"*{TRITON_TYPES[dtype]}"
        compiled = compile_for_h100(
            _rotary_qk_kernel,
            {
                "query_out_ptr": ptr,
                "key_out_ptr": ptr,
                "query_ptr": ptr,
                "key_ptr": ptr,
                "cos_ptr": ptr,
                "sin_ptr": ptr,
                "stride_query_token": "i32",
                "stride_query_head": "i32",
                "stride_key_token": "i32",
                "stride_key_head": "i32",
                "stride_cos_token": "i32",
                "stride_sin_token": "i32",
            },
            {
                "NUM_Q_HEADS": num_heads,
                "NUM_KV_HEADS": num_kv_heads,
                "HEAD_DIM": head_dim,
                "ROTARY_DIM": rotary_dim,
                "BLOCK_HQ": next_power_of_2(num_heads),
                "BLOCK_HK": next_power_of_2(num_kv_heads),
                "BLOCK_D": next_power_of_2(head_dim),
            },
            num_warps=4,
            num_stages=1,
        )
        yield describe(
            f"rotary {TRITON_TYPES[dtype]} heads={num_heads}/{num_kv_heads} d={head_dim}/{rotary_dim}",
            compiled,
        )


def silu_cases():
    for dtype in (torch.bfloat16, torch.float32):
        ptr = f"*{TRITON_TYPES[dtype]}"
        compiled = compile_for_h100(
            _silu_and_mul_kernel,
            {
                "out_ptr": ptr,
                "gate_ptr": ptr,
                "up_ptr": ptr,
                "dim": "i32",
                "stride_gate_row": "i32",
                "stride_up_row": "i32",
            },
            {"BLOCK": _SILU_BLOCK},
            num_warps=4,
            num_stages=1,
        )
        yield describe(f"silu_and_mul {TRITON_TYPES[dtype]}", compiled)


def rotary_cache_cases():
    for dtype, num_heads, num_kv_heads, head_dim, rotary_dim in ROTARY_CASES[::2]:
        ptr = f"*{TRITON_TYPES[dtype]}"
        compiled = compile_for_h100(
            _rotary_and_cache_kernel,
            {
                "query_out_ptr": ptr,
                "key_out_ptr": ptr,
                "query_ptr": ptr,
                "key_ptr": ptr,
                "value_ptr": ptr,
                "cos_ptr": ptr,
                "sin_ptr": ptr,
                "kv_ptr": ptr,
                "slot_mapping_ptr": "*i64",
                "num_slots": "i32",
                "stride_query_token": "i32",
                "stride_query_head": "i32",
                "stride_key_token": "i32",
                "stride_key_head": "i32",
                "stride_value_token": "i32",
                "stride_value_head": "i32",
                "stride_cos_token": "i32",
                "stride_sin_token": "i32",
                "stride_kv_kind": "i32",
            },
            {
                "NUM_Q_HEADS": num_heads,
                "NUM_KV_HEADS": num_kv_heads,
                "HEAD_DIM": head_dim,
                "ROTARY_DIM": rotary_dim,
                "BLOCK_HQ": next_power_of_2(num_heads),
                "BLOCK_HK": next_power_of_2(num_kv_heads),
                "BLOCK_D": next_power_of_2(head_dim),
            },
            num_warps=4,
            num_stages=1,
        )
        yield describe(
            f"rotary_and_cache {TRITON_TYPES[dtype]} heads={num_heads}/{num_kv_heads} d={head_dim}/{rotary_dim}",
            compiled,
        )


def add_rms_norm_cases():
    for dtype, dim in ((torch.bfloat16, 4096), (torch.float32, 4096)):
        block_d = next_power_of_2(dim)
        ptr = f"*{TRITON_TYPES[dtype]}"
        compiled = compile_for_h100(
            _add_rms_norm_kernel,
            {
                "out_ptr": ptr,
                "residual_out_ptr": ptr,
                "x_ptr": ptr,
                "residual_ptr": ptr,
                "weight_ptr": ptr,
                "num_rows": "i32",
                "dim": "i32",
                "eps": "fp32",
                "stride_x_row": "i32",
                "stride_residual_row": "i32",
                "stride_out_row": "i32",
            },
            {"BLOCK_D": block_d},
            num_warps=max(1, min(16, block_d // 256)),
            num_stages=1,
        )
        yield describe(f"add_rms_norm {TRITON_TYPES[dtype]} d={dim}", compiled)


def main() -> None:
    for result in (*rotary_cases(), *silu_cases(), *rotary_cache_cases(), *add_rms_norm_cases()):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
