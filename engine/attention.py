"""One layer's attention in one engine step on CUDA.

Called by the model runner once per layer per step, after the step's K/V were
written into the paged cache. Two paths share the step:

- whole-prompt prefills (no cached prefix, at least DENSE_PREFILL_MIN_TOKENS new
  tokens) attend over their own fresh K/V through PyTorch's fused causal SDPA
  (the flash kernels Hugging Face uses too): a long prompt's recompute is never
  slower than the reference implementation;
- everything else (decode, speculative verification, chunked prefill over a
  prefix, a prompt after a cache hit) goes through the paged Triton kernel, with
  split-KV for a few long sequences.

The runner lays the step's sequences out paged-first, so the paged kernel reads a
prefix of the batch metadata without another transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import paged_attention

# Shorter prompts gain little from the fused kernel; keep them in one paged launch.
DENSE_PREFILL_MIN_TOKENS = 1024
DENSE_PREFILL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention (tensors on the model's device, the rest host values).

    Sequences [0, num_paged_seqs) go through the paged kernel; `dense_spans` holds the
    [begin, end) token ranges of the rest, which follow them in the flat batch.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs], KV length after this step
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int  # largest number of new tokens of one paged sequence
    max_seq_len: int  # upper bound of seq_lens (sizes split-KV)
    num_paged_seqs: int
    dense_spans: tuple[tuple[int, int], ...] = ()


def is_dense_prefill(
    num_computed_tokens: int, num_new_tokens: int, num_drafts: int, dtype: torch.dtype
) -> bool:
    """Whether a scheduled sequence takes the fused whole-prompt path (host-side decision)."""
    return (
        num_computed_tokens == 0
        and num_drafts == 0
        and num_new_tokens >= DENSE_PREFILL_MIN_TOKENS
        and dtype in DENSE_PREFILL_DTYPES
    )


def attend(
    query: torch.Tensor,  # [T, H, D], head_dim contiguous
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], this step's K/V already written
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """-> [T, H, D] in query's dtype. Never syncs the host."""
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_paged = metadata.num_paged_seqs
    spans = metadata.dense_spans
    if num_paged:
        num_paged_tokens = spans[0][0] if spans else query.shape[0]
        paged_attention(
            query[:num_paged_tokens],
            kv_layer,
            metadata.block_tables[:num_paged],
            metadata.seq_lens[:num_paged],
            metadata.query_start_loc[: num_paged + 1],
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            check_values=False,
            out=out[:num_paged_tokens],
        )
    for begin, end in spans:
        # [1, heads, tokens, head_dim] views; SDPA broadcasts the KV heads over query groups.
        dense = F.scaled_dot_product_attention(
            query[begin:end].transpose(0, 1).unsqueeze(0),
            key[begin:end].transpose(0, 1).unsqueeze(0),
            value[begin:end].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[begin:end].copy_(dense[0].transpose(0, 1))
    return out
