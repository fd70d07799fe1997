"""Compile the kernels for an H100 (sm_90) with Triton's bundled ptxas, without a GPU.

Run as `python -m tests.kernels.sm90_compile` with TRITON_INTERPRET unset (the
interpreter's patches of triton.language break real compilation in the same
process); prints one JSON object per kernel configuration: shared memory bytes,
registers, stack (spill) bytes and the number of 16-byte vector loads/stores in the
PTX. tests/kernels/test_compile_sm90.py runs it in a subprocess and checks the numbers.
The launch parameters come from the wrappers' own launch_config functions.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import host_unpack, pack
from kernels.attention_launch import launch_config as attention_launch_config
from kernels.launch import next_power_of_2
from kernels.paged_attention import _merge_kv_splits_kernel, _paged_attention_kernel
from kernels.reshape_and_cache import _reshape_and_cache_kernel

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# (dtype, num_heads, num_kv_heads, head_dim, max_query_len, split KV)
ATTENTION_CASES = [
    (torch.bfloat16, 32, 8, 128, 4096, False),  # Llama-3.1-8B prefill
    (torch.bfloat16, 32, 8, 128, 1, False),  # decode
    (torch.bfloat16, 32, 8, 128, 1, True),  # decode of a few long sequences
    (torch.float16, 12, 2, 80, 300, False),
    (torch.bfloat16, 14, 2, 96, 17, False),
    (torch.float32, 32, 8, 128, 4096, False),  # float32 parity runs
    (torch.float32, 14, 2, 96, 1, True),
]


def compile_for_h100(
    kernel, signature: dict[str, str], constexprs: dict[str, object], num_warps: int, num_stages: int
):
    # At launch Triton marks 16-aligned pointers and 16-divisible ints; the tensors' strides are.
    attrs = {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in signature.items()
        if kind.startswith("*") or name.startswith("stride")
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


def describe(name: str, compiled) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        dump = subprocess.run(
            [str(NVIDIA_BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", dump)}
    ptx = compiled.asm["ptx"]
    return {
        "name": name,
        "shared": compiled.metadata.shared,
        **usage,
        "ld_v4": ptx.count("ld.global.v4"),
        "st_v4": ptx.count("st.global.v4"),
    }


def pack_cases():
    row = 8 * 128
    for dtype in (torch.bfloat16, torch.float32):
        element_size = torch.empty(0, dtype=dtype).element_size()
        block_tokens, block_row = pack.launch_config(row, element_size)
        ptr = f"*{TRITON_TYPES[dtype]}"
        for is_pack in (True, False):
            compiled = compile_for_h100(
                pack._move_kv_rows_kernel,
                {
                    "paged_ptr": ptr,
                    "packed_ptr": ptr,
                    "slot_mapping_ptr": "*i64",
                    "num_tokens": "i32",
                    "num_slots": "i32",
                    "stride_paged_layer": "i64",
                    "stride_paged_kind": "i32",
                },
                {"ROW": row, "BLOCK_T": block_tokens, "BLOCK_ROW": block_row, "PACK": is_pack},
                num_warps=4,
                num_stages=3,
            )
            result = describe(f"{'pack' if is_pack else 'unpack'} {TRITON_TYPES[dtype]}", compiled)
            result["vectors_per_thread"] = block_tokens * block_row * element_size // (128 * 16)
            yield result


def reshape_and_cache_case():
    compiled = compile_for_h100(
        _reshape_and_cache_kernel,
        {
            "key_ptr": "*bf16",
            "value_ptr": "*bf16",
            "kv_ptr": "*bf16",
            "slot_mapping_ptr": "*i64",
            "num_slots": "i32",
            "stride_key_token": "i32",
            "stride_key_head": "i32",
            "stride_value_token": "i32",
            "stride_value_head": "i32",
            "stride_kv_kind": "i64",
        },
        {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128},
        num_warps=4,
        num_stages=3,
    )
    return describe("reshape_and_cache bf16", compiled)


def attention_cases():
    for dtype, num_heads, num_kv_heads, head_dim, max_query_len, split in ATTENTION_CASES:
        group = num_heads // num_kv_heads
        block_q, block_m, block_n = attention_launch_config(group, max_query_len, dtype)
        ptr = f"*{TRITON_TYPES[dtype]}"
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
                "BLOCK_D": max(16, next_power_of_2(head_dim)),
                "DOT_IN_FP32": False,
                "SPLIT": split,
                "KV_SPLIT_LEN": 0,
            },
            num_warps=4,
            num_stages=2,
        )
        name = (
            f"attention {TRITON_TYPES[dtype]} heads={num_heads}/{num_kv_heads} d={head_dim} q={max_query_len}"
            + (" split" if split else "")
        )
        yield describe(name, compiled)


def merge_splits_case():
    compiled = compile_for_h100(
        _merge_kv_splits_kernel,
        {
            "out_ptr": "*bf16",
            "split_out_ptr": "*fp32",
            "split_lse_ptr": "*fp32",
            "num_kv_splits": "i32",
            "stride_out_token": "i32",
            "stride_out_head": "i32",
        },
        {"NUM_HEADS": 32, "HEAD_DIM": 128, "BLOCK_S": 64, "BLOCK_D": 128},
        num_warps=4,
        num_stages=1,
    )
    return describe("merge kv splits bf16", compiled)


def host_unpack_case():
    compiled = compile_for_h100(
        host_unpack._unpack_from_host_kernel,
        {
            "paged_ptr": "*bf16",
            "table_ptr": "*i64",
            "num_chunks": "i32",
            "num_slots": "i32",
            "first_layer": "i32",
            "source_first_layer": "i32",
            "num_planes": "i32",
            "num_items": "i32",
            "stride_paged_layer": "i64",
            "stride_paged_kind": "i32",
        },
        {
            "ROW": 8 * 128,
            "TILES_PER_CHUNK": 16,
            "BLOCK_T": host_unpack._BLOCK_T,
            "BLOCK_ROW": 1024,
            "ELEMENT_BYTES": 2,
        },
        num_warps=4,
        num_stages=3,
    )
    return describe("host_unpack bf16", compiled)


def main() -> None:
    cases = (
        *pack_cases(),
        reshape_and_cache_case(),
        *attention_cases(),
        merge_splits_case(),
        host_unpack_case(),
    )
    for result in cases:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
