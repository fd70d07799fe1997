"""Compile the rejection sampler for an H100 (sm_90) with Triton's bundled ptxas, without
a GPU. Run as `python -m tests.spec_decode.sm90_compile` with TRITON_INTERPRET unset;
prints one JSON object per configuration (see tests/kernels/sm90_compile.py)."""

from __future__ import annotations

import json

from kernels.launch import next_power_of_2
from kernels.rejection_sampler import _rejection_sample_kernel
from tests.kernels.sm90_compile import compile_for_h100, describe

SIGNATURE = {
    "out_ptr": "*i64",
    "draft_token_ids_ptr": "*i64",
    "cu_num_draft_tokens_ptr": "*i64",
    "draft_probs_ptr": "*fp32",
    "target_probs_ptr": "*fp32",
    "target_argmax_ptr": "*i64",
    "bonus_token_ids_ptr": "*i64",
    "is_greedy_ptr": "*i1",
    "uniform_ptr": "*fp32",
    "recovery_noise_ptr": "*fp32",
    "vocab_size": "i32",
    "max_spec_len": "i32",
    "stride_out": "i32",
    "stride_draft_probs": "i32",
    "stride_target_probs": "i32",
    "stride_noise": "i32",
}


def main() -> None:
    for has_draft_probs in (False, True):
        for max_spec_len in (4, 8):
            compiled = compile_for_h100(
                _rejection_sample_kernel,
                SIGNATURE,
                {
                    "PLACEHOLDER": -1,
                    "HAS_DRAFT_PROBS": has_draft_probs,
                    "BLOCK_SPEC": next_power_of_2(max_spec_len + 1),
                    "BLOCK_VOCAB": 1024,
                },
                num_warps=4,
                num_stages=3,
            )
            name = f"rejection_sample draft_probs={has_draft_probs} k={max_spec_len}"
            # div.full is the approximate division: it would break bit-equality with torch.
            approx_divisions = compiled.asm["ptx"].count("div.full.f32")
            print(json.dumps({**describe(name, compiled), "approx_divisions": approx_divisions}), flush=True)


if __name__ == "__main__":
    main()
