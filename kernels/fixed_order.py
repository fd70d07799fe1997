"""Pure-torch CPU forms of the deterministic mode's kernels: every token's result is
computed by calls whose shapes depend on that token alone.

Why not plain batched torch on CPU: its kernels pick their blocking, their thread
split and their vector/scalar-tail split from the whole tensor's shape (a GEMM with
M=1 is a GEMV, a reduction over a short batch may be split across threads, an
element that lands in a loop's scalar tail goes through libm instead of the SIMD
exp/cos), so one token's bits can change with the batch around it. Here each token
goes through calls of one fixed shape:

- `per_row(fn, x, ...)` runs `fn` on each row [1, ...] and concatenates (the linear
  layers, norms, activation and RoPE of the CPU deterministic mode);
- `paged_attention_rows` computes each query against exactly the keys it sees
  (positions 0..its own), with sums taken as a pairwise tree of elementwise adds
  (`pairwise_sum`), so a query in a prefill chunk and the same query in a decode
  run identical operations.

The engine's CPU deterministic mode calls these (engine.deterministic). They cost a
Python call per token per op: fine for the tiny CPU models of tests and demos, not a
fast CPU path. The Triton interpreter was the other candidate; it is slower still
(numpy per program and per tile), so CI time stays small this way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import reference


def per_row(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
    """fn applied to each row x[i:i+1] (same shape every call), results concatenated on dim 0."""
    if x.shape[0] <= 1:
        return fn(x, *args)
    return torch.cat([fn(x[i : i + 1], *args) for i in range(x.shape[0])])


def pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a pairwise tree of elementwise adds (the dim zero-padded to a power
    of 2, then halved): each output depends on its own inputs only, in one fixed order.
    Extra trailing zeros leave the result bit-unchanged (they only add exact zeros)."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size == 0:
        return x.sum(dim)
    padded = 1 << (size - 1).bit_length()
    if padded != size:
        pad_shape = list(x.shape)
        pad_shape[dim] = padded - size
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while padded > 1:
        padded //= 2
        x = x.narrow(dim, 0, padded) + x.narrow(dim, padded, padded)
    return x.squeeze(dim)


def paged_attention_rows(
    query: torch.Tensor,  # [num_new_tokens_total, num_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs], KV length including the new tokens
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1], cumulative new-token counts
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention over paged KV (kernels.reference.paged_attention_ref's contract),
    each query computed alone in float32 over keys 0..its position, in query's dtype.

    A query's result is bit-identical whatever the batch, the chunk it is computed in or
    the step kind. Called by the CPU deterministic mode once per layer per step.
    """
    num_kv_heads = kv_layer.shape[3]
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for start, end, seq_len, seq_kv in reference.sequences_kv(
        query, kv_layer, block_tables, seq_lens, query_start_loc
    ):
        kv = seq_kv.transpose(1, 2)  # [2, num_kv_heads, seq_len, head_dim]
        context_len = seq_len - (end - start)
        for token in range(start, end):
            num_keys = context_len + token - start + 1
            keys, values = kv[0, :, None, :num_keys], kv[1, :, None, :num_keys]  # [KVH, 1, P, D]
            q = query[token].float().view(num_kv_heads, group, 1, head_dim)
            scores = pairwise_sum(q * keys, dim=-1) * scale  # [KVH, G, P]
            probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            weighted = pairwise_sum(probs[..., None] * values, dim=-2)  # [KVH, G, D]
            merged = weighted / pairwise_sum(probs, dim=-1)[..., None]
            out[token] = merged.reshape(num_heads, head_dim).to(query.dtype)
    return out
