"""engine.attention: a step mixing paged sequences and whole-prompt prefills gives
the reference attention of the whole batch; the runner lays the batch out paged-first.

Runs the Triton kernel under the CPU interpreter (TRITON_INTERPRET=1, as CI does) and
on CUDA (gpu marker), with the fused SDPA path on the dense spans either way.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine import attention
from kernels.paged_attention import _paged_attention_kernel
from kernels.reference import paged_attention_ref, reshape_and_cache_ref
from tests.kernels.cases import ATTENTION_TOLERANCES, attention_batch, random_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 16


def _device_cases():
    interpreted = isinstance(_paged_attention_kernel, InterpretedFunction)
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not interpreted, reason="needs TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]


def _mixed_step(device: str, dtype: torch.dtype, num_new: list[int], seq_lens: list[int], num_paged: int):
    """Sequences [0, num_paged) are paged, the rest whole prompts (num_new == seq_len)."""
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 4
    tables, seq_lens_t, starts = attention_batch(
        num_new, seq_lens, num_blocks, BLOCK_SIZE, seed=21, device=device
    )
    kv_layer = random_kv((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype, device, seed=22)
    num_tokens = sum(num_new)
    query = random_kv((num_tokens, NUM_HEADS, HEAD_DIM), dtype, device, seed=23)
    key = random_kv((num_tokens, NUM_KV_HEADS, HEAD_DIM), dtype, device, seed=24)
    value = random_kv((num_tokens, NUM_KV_HEADS, HEAD_DIM), dtype, device, seed=25)
    # The step's K/V go into the cache first, at each new token's position, as the runner does.
    slots = []
    for b, (n, length) in enumerate(zip(num_new, seq_lens, strict=True)):
        positions = torch.arange(length - n, length, device=device)
        slots.append(tables[b, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    reshape_and_cache_ref(key, value, kv_layer, torch.cat(slots))
    bounds = starts.tolist()
    metadata = attention.AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        seq_lens=seq_lens_t,
        query_start_loc=starts,
        max_query_len=max(num_new[:num_paged], default=1),
        max_seq_len=max(seq_lens),
        num_paged_seqs=num_paged,
        dense_spans=tuple((bounds[b], bounds[b + 1]) for b in range(num_paged, len(num_new))),
    )
    expected = paged_attention_ref(query, kv_layer, tables, seq_lens_t, starts, HEAD_DIM**-0.5)
    return (query, key, value, kv_layer, metadata), expected


@pytest.mark.parametrize("device", _device_cases())
@pytest.mark.parametrize(
    "num_new,seq_lens,num_paged",
    [
        ([5, 1, 40, 33], [60, 17, 40, 33], 2),  # prefix prefill and decode, then two whole prompts
        ([50, 20], [50, 20], 0),  # whole prompts only
        ([1, 1], [300, 9], 2),  # paged only (split-KV on CUDA)
    ],
)
def test_mixed_step_matches_reference(device, num_new, seq_lens, num_paged):
    dtype = torch.bfloat16
    args, expected = _mixed_step(device, dtype, num_new, seq_lens, num_paged)
    out = attention.attend(*args, HEAD_DIM**-0.5)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[dtype])


def test_dense_path_is_for_long_16_bit_whole_prompts_only():
    long_prompt = attention.DENSE_PREFILL_MIN_TOKENS
    assert attention.is_dense_prefill(0, long_prompt, 0, torch.bfloat16)
    assert not attention.is_dense_prefill(16, long_prompt, 0, torch.bfloat16)  # over a cached prefix
    assert not attention.is_dense_prefill(0, long_prompt - 1, 0, torch.float16)
    assert not attention.is_dense_prefill(0, long_prompt, 2, torch.bfloat16)  # with drafts
    assert not attention.is_dense_prefill(0, long_prompt, 0, torch.float32)  # float32 parity stays paged
