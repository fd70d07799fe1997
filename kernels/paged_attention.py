"""Causal GQA attention of new tokens over a paged KV cache (prefill with prefix, and decode).

Called once per layer per engine step on CUDA, after reshape_and_cache has written
the new tokens' K/V. Reads block tables directly; never gathers the KV.

Work split: one program per (query tile of one sequence, KV head). A tile holds
BLOCK_Q new tokens x the GROUP query heads that share the KV head, so the K/V read
from memory serves every query head of the group. Programs walk the sequence's KV
in BLOCK_N-key steps with a flash-attention online softmax in float32.

Sequences have different numbers of new tokens; without a host sync we launch an
upper bound of tiles: sequence b owns tile ids [qsl[b] // BLOCK_Q + b, ...), which
holds all ceil(num_new_b / BLOCK_Q) of its tiles, and each program binary-searches
query_start_loc for its sequence. Surplus tiles exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import validation
from kernels.launch import check_kernel_device, next_power_of_2

_LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_new_tokens_total, num_heads, head_dim]
    query_ptr,  # [num_new_tokens_total, num_heads, head_dim], head_dim contiguous
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim], dense from num_blocks on
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [num_seqs]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    num_seqs,
    scale_log2,  # softmax scale * log2(e): scores are exponentiated with exp2
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_kv_kind,
    stride_kv_block,
    stride_tables_seq,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # tokens per KV block
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # new tokens per tile
    BLOCK_M: tl.constexpr,  # next power of 2 >= max(16, BLOCK_Q * GROUP): rows of the tile
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,  # next power of 2 >= max(16, HEAD_DIM)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (Triton's CPU interpreter miscomputes bf16 dots)
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Sequence owning this tile: the last b with query_start_loc[b] // BLOCK_Q + b <= tile_id.
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile_id:
            low = mid + 1
        else:
            high = mid
    seq = low - 1
    query_begin = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - query_begin
    q_tile = tile_id - (query_begin // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= num_new:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - num_new

    # Row r of the tile: new token q_tile * BLOCK_Q + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    new_token = q_tile * BLOCK_Q + rows // GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (new_token < num_new)
    query_pos = context_len + new_token
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    token_index = (query_begin + new_token).to(tl.int64)
    query = tl.load(
        query_ptr
        + token_index[:, None] * stride_query_token
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if DOT_IN_FP32:
        query = query.to(tl.float32)

    max_score = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    denominator = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the tile's last query position are masked for every row: stop there.
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, num_new)
    tables_row = block_tables_ptr + seq.to(tl.int64) * stride_tables_seq
    kv_head_ptr = kv_ptr + kv_head.to(tl.int64) * HEAD_DIM
    keys = tl.arange(0, BLOCK_N)
    for key_start in range(0, kv_end, BLOCK_N):
        key_pos = key_start + keys
        key_mask = key_pos < kv_end
        block_ids = tl.load(tables_row + key_pos // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
        key_offsets = block_ids * stride_kv_block + (key_pos % PAGE_SIZE).to(tl.int64) * (
            NUM_KV_HEADS * HEAD_DIM
        )
        key_t = tl.load(
            kv_head_ptr + key_offsets[None, :] + dims[:, None],
            mask=key_mask[None, :] & dim_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if DOT_IN_FP32:
            key_t = key_t.to(tl.float32)
        scores = tl.dot(query, key_t, input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = key_mask[None, :] & (key_pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(max_score, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(max_score - new_max)
        denominator = denominator * rescale + tl.sum(probs, axis=1)
        value = tl.load(
            kv_head_ptr + stride_kv_kind + key_offsets[:, None] + dims[None, :],
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        probs = probs.to(value.dtype)
        if DOT_IN_FP32:
            probs = probs.to(tl.float32)
            value = value.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(probs, value, input_precision="ieee")
        max_score = new_max

    # Valid rows always see their own key, so denominator > 0 there; padded rows are not stored.
    acc = acc / tl.where(row_mask, denominator, 1.0)[:, None]
    tl.store(
        out_ptr + token_index[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def launch_config(group: int, max_query_len: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """-> (BLOCK_Q, BLOCK_M, BLOCK_N): about 64 tile rows for prefill, one token per tile for decode.

    float32 dots run on FMA units with operands in registers; 16 x 16 tiles keep them
    from spilling (checked with ptxas for sm_90). K/V tiles of the 16-bit types are
    staged in shared memory by the 2-stage loop pipeliner (80 KB at head_dim 128).
    """
    is_fp32 = dtype == torch.float32
    rows_target = 16 if is_fp32 else 64
    block_q = max(1, min(next_power_of_2(max_query_len), max(1, rows_target // next_power_of_2(group))))
    block_m = max(16, next_power_of_2(block_q * group))
    block_n = 16 if is_fp32 else 64
    return block_q, block_m, block_n


def paged_attention(
    query: torch.Tensor,  # [num_new_tokens_total, num_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs], KV length including the new tokens
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1], cumulative new-token counts
    scale: float,
    *,
    max_query_len: int | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Causal GQA attention over paged KV; returns [num_new_tokens_total, num_heads, head_dim] in query's dtype.

    New token i of sequence b sits at position seq_lens[b] - num_new_b + i and attends
    to every key at a position <= its own. `max_query_len` (the largest num_new_b)
    picks the tile shape; when None it is read from query_start_loc. `check_values`
    validates the metadata values. Both reads sync the stream on CUDA, so the engine's
    hot path passes max_query_len and check_values=False once it built the metadata itself.
    """
    validation.check_attention_inputs(query, kv_layer, block_tables, seq_lens, query_start_loc)
    check_kernel_device("query", query, _paged_attention_kernel)
    if query.shape[2] > 1 and query.stride(2) != 1:
        raise ValueError(f"query must be contiguous along head_dim, got strides {query.stride()}")
    num_tokens, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
    if check_values:
        validation.check_attention_values(
            num_tokens, num_blocks, block_size, block_tables, seq_lens, query_start_loc
        )
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    group = num_heads // num_kv_heads
    block_q, block_m, block_n = launch_config(group, max_query_len, query.dtype)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        kv_layer,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        scale * _LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=block_size,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        DOT_IN_FP32=query.device.type == "cpu" and query.dtype == torch.bfloat16,
        num_warps=4,
        num_stages=2,
    )
    return out
