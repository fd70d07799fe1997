"""One layer's attention in one engine step on CUDA.

Called by the model runner once per layer per step, after the step's K/V were
written into the paged cache. Two paths share the step:

- whole-prompt prefills (no cached prefix, at least DENSE_PREFILL_MIN_TOKENS new
  tokens) attend over their own fresh K/V through PyTorch's fused causal SDPA
  (the flash kernels Hugging Face uses too): a long prompt's recompute is never
  slower than the reference implementation. Its length is padded up to a bucket
  (:func:`dense_bucket_len`): the backend plans per shape (cuDNN builds a plan per
  new length, tens of milliseconds), so a few dozen buckets, all planned at
  start-up by the warm-up, serve every length. Trailing padding is exact under a
  causal mask: no real row attends to a padded key;
- everything else (decode, speculative verification, chunked prefill over a
  prefix, a prompt after a cache hit) goes through the paged Triton kernel, with
  split-KV for a few long sequences.

In the deterministic mode the runner makes no dense span and every sequence goes
through the paged kernel's batch-invariant form (fixed tile, KV split only at fixed
token positions).

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
# Buckets per doubling of the length: padding stays under 1/16 of the length (the
# attention op only; the GEMMs run on the real tokens), 16 plans per octave.
DENSE_BUCKETS_PER_OCTAVE = 16


def dense_bucket_len(num_tokens: int) -> int:
    """The padded length of a whole-prompt span of `num_tokens` (>= 1) tokens: the next
    multiple of 1/`DENSE_BUCKETS_PER_OCTAVE` of the power of two below it, at least 64."""
    if num_tokens < 1:
        raise ValueError(f"a dense span needs at least one token, got {num_tokens}")
    step = max(64, (1 << (num_tokens.bit_length() - 1)) // DENSE_BUCKETS_PER_OCTAVE)
    return -(-num_tokens // step) * step


def dense_bucket_lens(max_tokens: int) -> list[int]:
    """Every bucket a dense span of DENSE_PREFILL_MIN_TOKENS..`max_tokens` tokens can take
    (what the start-up warm-up plans); empty when no span can be that long."""
    lens: list[int] = []
    num_tokens = DENSE_PREFILL_MIN_TOKENS
    while num_tokens <= max_tokens:
        bucket = dense_bucket_len(num_tokens)
        lens.append(bucket)
        num_tokens = bucket + 1
    return lens


def dense_causal_attention(
    query: torch.Tensor,  # [n, H, D]
    key: torch.Tensor,  # [n, KVH, D]
    value: torch.Tensor,  # [n, KVH, D]
    scale: float,
) -> torch.Tensor:
    """Causal self-attention of one whole prompt through the fused SDPA kernel, run at
    the bucketed length -> [n, H, D] (rows of the real tokens only)."""
    num_tokens = query.shape[0]
    padded_len = dense_bucket_len(num_tokens)
    # [1, heads, tokens, head_dim]; SDPA broadcasts the KV heads over query groups.
    q, k, v = (_padded_heads_first(t, padded_len) for t in (query, key, value))
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return dense[0, :, :num_tokens].transpose(0, 1)


def _padded_heads_first(x: torch.Tensor, padded_len: int) -> torch.Tensor:
    """[n, heads, D] (any strides) -> a new contiguous [1, heads, padded_len, D], zeros
    after row n. Always a copy: the backend's plans are keyed by strides too, so every
    call at one bucket must look alike (a view of the fused QKV projection has other
    strides than a padded buffer, and would miss the plan the warm-up made)."""
    num_tokens, num_heads, head_dim = x.shape
    out = x.new_empty((1, num_heads, padded_len, head_dim))
    out[0, :, :num_tokens].copy_(x.transpose(0, 1))
    if padded_len > num_tokens:
        out[0, :, num_tokens:].zero_()
    return out


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
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """-> [T, H, D] in query's dtype. Never syncs the host. `batch_invariant` (the
    deterministic mode, whose metadata has no dense spans) runs the paged kernel's
    batch-invariant form."""
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
            batch_invariant=batch_invariant,
        )
    for begin, end in spans:
        out[begin:end].copy_(
            dense_causal_attention(query[begin:end], key[begin:end], value[begin:end], scale)
        )
    return out
