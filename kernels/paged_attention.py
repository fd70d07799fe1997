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

Split-KV (flash-decoding): a decode step of a few long sequences has only
num_seqs x num_kv_heads tiles, far fewer than the GPU's SMs, each walking the whole
KV alone; so has a short chunk over a long prefix (80 new tokens over 8k cached
ones: 5 tiles per KV head). The KV of each tile can be cut into `num_kv_splits`
ranges, one program each; every program writes its partial output per query row
with its log-sum-exp, and a second kernel merges the splits. The ranges are
computed in the kernel from each tile's key range, so one launch shape serves any
lengths (CUDA graphs capture it once).

Batch-invariant form (`batch_invariant=True`, the engine's deterministic mode): the
tile shape is a constant of (group, dtype) instead of following the step's longest
query, and KV splits are fixed in token positions: a query's keys are cut every
`kv_split_len` (512) positions, each range is reduced by its own online softmax in
BLOCK_N-key tiles from the range's start, and the ranges are merged in position order
by one function (_merge_split). Every query row then reduces its keys in the same order
whether it sits in a prefill chunk (with any chunk boundaries), a decode or a
speculative verification, and whatever the other sequences of the batch. Tiles past a
row's own position are fully masked and leave its state bit-unchanged (scale 1,
weights 0); ranges past it are not merged. Who runs the ranges is free: for
decode-sized batches each range gets a program of its own (the GPU fills up as with
flash-decoding) and _merge_positional_splits_kernel merges their partials; prefill
tiles walk their ranges in turn in one program, merging as they go -- same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import validation
from kernels.attention_launch import (
    BATCH_INVARIANT_KV_SPLIT_LEN,
    MAX_KV_SPLITS,
    batch_invariant_launch_config,
    batch_invariant_num_kv_splits,
    choose_num_kv_splits,
    launch_config,
)
from kernels.launch import check_kernel_device, next_power_of_2

_LOG2_E = 1.4426950408889634


@triton.jit
def _attend_keys(
    query,  # [BLOCK_M, BLOCK_D]
    query_pos,  # [BLOCK_M]
    max_score,  # [BLOCK_M] float32, log2 domain
    denominator,  # [BLOCK_M] float32
    acc,  # [BLOCK_M, BLOCK_D] float32
    kv_begin,
    kv_end,
    tables_row,
    kv_head_ptr,
    dims,
    dim_mask,
    scale_log2,
    stride_kv_kind,
    stride_kv_block,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    ROW_SUM_BY_DOT: tl.constexpr,
):
    """Online softmax over keys [kv_begin, kv_end) in BLOCK_N steps from kv_begin: the state after them.

    ROW_SUM_BY_DOT (the batch-invariant form): a row's sum of weights is taken by the tensor
    cores (a dot with ones, over the same 16-bit weights as the numerator) instead of a
    register reduction, whose tree follows the tile's layout (its row count and warps); a
    row's bits then depend on BLOCK_N and the MMA's own order, as a GEMM row's do."""
    keys = tl.arange(0, BLOCK_N)
    for key_start in range(kv_begin, kv_end, BLOCK_N):
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
        if not ROW_SUM_BY_DOT:
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
        if ROW_SUM_BY_DOT:
            ones = tl.full([BLOCK_N, 16], 1.0, dtype=probs.dtype)
            row_sum = tl.max(tl.dot(probs, ones, input_precision="ieee"), axis=1)  # 16 equal columns
            denominator = denominator * rescale + row_sum
        acc = acc * rescale[:, None] + tl.dot(probs, value, input_precision="ieee")
        max_score = new_max
    return max_score, denominator, acc


@triton.jit
def _split_partial(max_score, denominator, acc):
    """-> (normalised partial output, log2-sum-exp) of one KV range; a row that saw no key
    there has denominator 0: partial 0, lse -inf (weight 0 at a merge)."""
    seen = denominator > 0.0
    partial = acc / tl.where(seen, denominator, 1.0)[:, None]
    lse = tl.where(seen, max_score + tl.log2(tl.where(seen, denominator, 1.0)), float("-inf"))
    return partial, lse


@triton.jit
def _merge_split(merged_max, merged_acc, merged_denominator, partial, lse, take):
    """Fold one KV range's (partial [R, D], lse [R]) into a running merge, rows where `take`;
    the others keep their state. The start state is (-inf, 0, 0). The batch-invariant form
    merges a row's positional ranges in order 0, 1, 2, ... with this one function, whether
    one program walks them all or a merge kernel reads them back: explicit fma, so both
    compile to the same roundings."""
    # Rows not taken get a dummy max (0): no -inf - -inf = NaN on the way to tl.where.
    new_max = tl.where(take, tl.maximum(merged_max, lse), 0.0)
    old_scale = tl.exp2(merged_max - new_max)
    weight = tl.exp2(lse - new_max)
    new_acc = tl.fma(partial, weight[:, None], merged_acc * old_scale[:, None])
    new_denominator = tl.fma(merged_denominator, old_scale, weight)
    return (
        tl.where(take, new_max, merged_max),
        tl.where(take[:, None], new_acc, merged_acc),
        tl.where(take, new_denominator, merged_denominator),
    )


# Batch sizes, split counts and block-table widths vary per step: Triton would otherwise compile one variant
# per value class (== 1, multiple of 16) at the first step that meets it.
@triton.jit(do_not_specialize=["num_seqs", "num_kv_splits", "stride_tables_seq"])
def _paged_attention_kernel(
    out_ptr,  # [num_new_tokens_total, num_heads, head_dim]
    split_out_ptr,  # float32 [num_new_tokens_total, num_heads, num_kv_splits, head_dim] (SPLIT only)
    split_lse_ptr,  # float32 [num_new_tokens_total, num_heads, num_kv_splits], log2 domain (SPLIT only)
    query_ptr,  # [num_new_tokens_total, num_heads, head_dim], head_dim contiguous
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim], dense from num_blocks on
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [num_seqs]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    num_seqs,
    num_kv_splits,
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
    SPLIT: tl.constexpr,  # write per-split partial results (num_kv_splits > 1)
    KV_SPLIT_LEN: tl.constexpr,  # batch-invariant form: KV ranges cut every KV_SPLIT_LEN positions; 0: off
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    kv_split = tl.program_id(2)

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
    kv_begin = 0
    if SPLIT:
        if KV_SPLIT_LEN > 0:
            # Positional: split s holds keys [s * KV_SPLIT_LEN, (s + 1) * KV_SPLIT_LEN), whatever the
            # sequence's length; splits past the tile's keys are empty.
            kv_begin = kv_split * KV_SPLIT_LEN
            kv_end = tl.minimum(kv_end, kv_begin + KV_SPLIT_LEN)
        else:
            # Equal ranges of whole BLOCK_N steps; trailing splits of a short sequence are empty.
            split_len = tl.cdiv(tl.cdiv(kv_end, num_kv_splits), BLOCK_N) * BLOCK_N
            kv_begin = kv_split * split_len
            kv_end = tl.minimum(kv_end, kv_begin + split_len)
    tables_row = block_tables_ptr + seq.to(tl.int64) * stride_tables_seq
    kv_head_ptr = kv_ptr + kv_head.to(tl.int64) * HEAD_DIM
    if KV_SPLIT_LEN > 0 and not SPLIT:
        # Batch-invariant, one program for all of a row's positional splits: each split's own
        # online softmax, merged in split order, exactly as _merge_positional_splits_kernel does
        # with the partials of one program per split.
        merged_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        merged_denominator = tl.zeros([BLOCK_M], dtype=tl.float32)
        merged_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for split_begin in range(0, kv_end, KV_SPLIT_LEN):
            split_max, split_denominator, split_acc = _attend_keys(
                query, query_pos, max_score, denominator, acc,
                split_begin, tl.minimum(split_begin + KV_SPLIT_LEN, kv_end),
                tables_row, kv_head_ptr, dims, dim_mask, scale_log2, stride_kv_kind, stride_kv_block,
                NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_IN_FP32, KV_SPLIT_LEN > 0,
            )  # fmt: skip
            partial, lse = _split_partial(split_max, split_denominator, split_acc)
            merged_max, merged_acc, merged_denominator = _merge_split(
                merged_max,
                merged_acc,
                merged_denominator,
                partial,
                lse,
                split_begin <= query_pos,  # the row sees a key of this split
            )
        acc = merged_acc
        denominator = merged_denominator
    else:
        max_score, denominator, acc = _attend_keys(
            query, query_pos, max_score, denominator, acc, kv_begin, kv_end,
            tables_row, kv_head_ptr, dims, dim_mask, scale_log2, stride_kv_kind, stride_kv_block,
            NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_IN_FP32, KV_SPLIT_LEN > 0,
        )  # fmt: skip

    if SPLIT:
        # A row whose keys all lie in other splits has denominator 0: weight 0 at the merge.
        partial, lse = _split_partial(max_score, denominator, acc)
        split_row = (token_index * (NUM_KV_HEADS * GROUP) + head) * num_kv_splits + kv_split
        tl.store(
            split_out_ptr + split_row[:, None] * HEAD_DIM + dims[None, :],
            partial,
            mask=row_mask[:, None] & dim_mask[None, :],
        )
        tl.store(split_lse_ptr + split_row, lse, mask=row_mask)
    else:
        # Valid rows always see their own key, so denominator > 0 there; padded rows are not stored.
        acc = acc / tl.where(row_mask, denominator, 1.0)[:, None]
        tl.store(
            out_ptr
            + token_index[:, None] * stride_out_token
            + head[:, None] * stride_out_head
            + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )


@triton.jit(do_not_specialize=["num_kv_splits"])
def _merge_kv_splits_kernel(
    out_ptr,  # [num_new_tokens_total, num_heads, head_dim]
    split_out_ptr,  # float32 [num_new_tokens_total, num_heads, num_kv_splits, head_dim]
    split_lse_ptr,  # float32 [num_new_tokens_total, num_heads, num_kv_splits]
    num_kv_splits,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # a power of 2 >= num_kv_splits
    BLOCK_D: tl.constexpr,
):
    """One program per (new token, query head): softmax-weighted sum of its splits."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_kv_splits
    first_row = (token * NUM_HEADS + head) * num_kv_splits
    lse = tl.load(split_lse_ptr + first_row + splits, mask=split_mask, other=float("-inf"))
    # Split 0 always holds the sequence's first key, which every new token sees: the max is finite.
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    partial = tl.load(
        split_out_ptr + (first_row + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    merged = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@triton.jit(do_not_specialize=["num_kv_splits"])
def _merge_positional_splits_kernel(
    out_ptr,  # [num_new_tokens_total, num_heads, head_dim]
    split_out_ptr,  # float32 [num_new_tokens_total, num_heads, num_kv_splits, head_dim]
    split_lse_ptr,  # float32 [num_new_tokens_total, num_heads, num_kv_splits]
    num_kv_splits,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # a power of 2 >= NUM_HEADS
    BLOCK_D: tl.constexpr,
):
    """One program per new token, rows = its heads: the batch-invariant merge. A row's
    positional splits 0 .. position // KV_SPLIT_LEN (those with a finite lse; the later ones
    saw none of its keys) are folded in order with _merge_split, as the one-program walk does."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < NUM_HEADS
    dim_mask = dims < HEAD_DIM
    first_row = (token * NUM_HEADS + heads) * num_kv_splits  # [BLOCK_H]
    merged_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    merged_denominator = tl.zeros([BLOCK_H], dtype=tl.float32)
    merged_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for split in range(0, num_kv_splits):
        lse = tl.load(split_lse_ptr + first_row + split, mask=head_mask, other=float("-inf"))
        partial = tl.load(
            split_out_ptr + (first_row + split)[:, None] * HEAD_DIM + dims[None, :],
            mask=head_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        merged_max, merged_acc, merged_denominator = _merge_split(
            merged_max, merged_acc, merged_denominator, partial, lse, lse > float("-inf")
        )
    merged = merged_acc / tl.where(head_mask, merged_denominator, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
        merged.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None] & dim_mask[None, :],
    )


#: The batch-invariant form's tile. False: one tile per (group, dtype) for every step, the
#: prefill tile (a decode token fills one row group of a 64-row tile). True: the tile follows
#: the step's longest query as in the default mode, so decode steps use 16-row tiles, a
#: quarter of the tensor-core work. A row's bits then stay the same only if the tensor cores
#: round a row's dot alike in every tile shape -- true of the GEMM on the H100, where all
#: tiles (wgmma of any N, mma.sync) gave the same bits (benchmarks/gemm_configs.py) -- and
#: the row sums are made by the tensor cores too (ROW_SUM_BY_DOT). CUDA only (the CPU
#: interpreter's dots are BLAS calls). Switch it on only after
#: tests/kernels/test_gpu_batch_invariant.py passed on that GPU (it runs both settings).
BATCH_INVARIANT_TILE_FOLLOWS_QUERIES = False


def paged_attention(
    query: torch.Tensor,  # [num_new_tokens_total, num_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs], KV length including the new tokens
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1], cumulative new-token counts
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    check_values: bool = True,
    check_inputs: bool = True,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
    kv_split_len: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention over paged KV; returns [num_new_tokens_total, num_heads, head_dim] in query's dtype.

    New token i of sequence b sits at position seq_lens[b] - num_new_b + i and attends
    to every key at a position <= its own. `max_query_len` (the largest num_new_b)
    picks the tile shape; when None it is read from query_start_loc. `max_seq_len` (an
    upper bound of seq_lens) sizes the split-KV work when `num_kv_splits` is None; when
    both are None it is read from seq_lens. `num_kv_splits` forces the number of KV
    ranges per tile. `check_values`
    validates the metadata values. The reads sync the stream on CUDA, so the engine's
    hot path passes the maxima and check_values=False once it built the metadata itself.
    `check_inputs=False` skips the shape, dtype and device checks of the inputs (the
    engine checks them at a step's first layer; the other layers pass the same kinds).
    `out`, when given, receives the result (a tensor shaped and typed like query whose
    head_dim is contiguous, e.g. a slice of a larger output) and is returned.
    `batch_invariant` fixes the tile shape and splits KV at fixed positions only: each
    query's keys are cut every `kv_split_len` positions (None: BATCH_INVARIANT_KV_SPLIT_LEN;
    a multiple of the tile's BLOCK_N), each range reduced alone and the ranges merged in
    order, so each query row's result is bit-identical whatever the batch, the chunking
    or the step kind. Whether the ranges run in programs of their own (decode-sized
    batches, to fill the GPU) or one after the other in one program changes no bit;
    `num_kv_splits` must be None (choose) or 1 (one program).
    """
    if check_inputs:
        validation.check_attention_inputs(query, kv_layer, block_tables, seq_lens, query_start_loc)
        check_kernel_device("query", query, _paged_attention_kernel)
        if query.shape[2] > 1 and query.stride(2) != 1:
            raise ValueError(f"query must be contiguous along head_dim, got strides {query.stride()}")
    if num_kv_splits is not None and not 1 <= num_kv_splits <= 1024:
        raise ValueError(f"num_kv_splits must be in [1, 1024], got {num_kv_splits}")
    if batch_invariant and num_kv_splits not in (None, 1):
        raise ValueError(
            "batch_invariant attention splits KV at fixed positions (kv_split_len) only: "
            f"num_kv_splits must be None or 1, got {num_kv_splits}"
        )
    if kv_split_len is not None and not batch_invariant:
        raise ValueError("kv_split_len applies to batch_invariant attention only")
    num_tokens, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
    if check_values:
        validation.check_attention_values(
            num_tokens, num_blocks, block_size, block_tables, seq_lens, query_start_loc
        )
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match query: got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"query is {tuple(query.shape)} {query.dtype} on {query.device}"
        )
    elif head_dim > 1 and out.stride(2) != 1:
        raise ValueError(f"out must be contiguous along head_dim, got strides {out.stride()}")
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    group = num_heads // num_kv_heads
    if batch_invariant:
        follows = BATCH_INVARIANT_TILE_FOLLOWS_QUERIES and query.device.type == "cuda"
        block_q, block_m, block_n = batch_invariant_launch_config(
            group, query.dtype, max_query_len if follows else None
        )
        kv_split_len = BATCH_INVARIANT_KV_SPLIT_LEN if kv_split_len is None else kv_split_len
        if kv_split_len < block_n or kv_split_len % block_n:
            raise ValueError(f"kv_split_len must be a positive multiple of {block_n}, got {kv_split_len}")
        if max_query_len <= block_q and num_kv_splits is None:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            num_kv_splits = batch_invariant_num_kv_splits(
                num_seqs,
                num_tokens,
                num_heads,
                num_kv_heads,
                head_dim,
                max_seq_len,
                kv_split_len,
                query.device,
            )
        num_kv_splits = num_kv_splits or 1
    else:
        block_q, block_m, block_n = launch_config(group, max_query_len, query.dtype)
    if num_kv_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        # at least one tile per sequence, and one per BLOCK_Q new tokens
        num_tiles = max(num_seqs, -(-num_tokens // block_q))
        num_kv_splits = choose_num_kv_splits(
            num_tiles, num_kv_heads, max_seq_len, query.device, num_tokens=num_tokens
        )
    split = num_kv_splits > 1
    if split:
        split_out = torch.empty(
            (num_tokens, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=query.device
        )
        split_lse = torch.empty(
            (num_tokens, num_heads, num_kv_splits), dtype=torch.float32, device=query.device
        )
    else:
        split_out = split_lse = out  # unused by the kernel
    block_d = max(16, next_power_of_2(head_dim))
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_kv_splits)
    _paged_attention_kernel[grid](
        out,
        split_out,
        split_lse,
        query,
        kv_layer,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        num_kv_splits,
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
        BLOCK_D=block_d,
        DOT_IN_FP32=query.device.type == "cpu" and query.dtype == torch.bfloat16,
        SPLIT=split,
        KV_SPLIT_LEN=kv_split_len if batch_invariant else 0,
        num_warps=4,
        num_stages=2,
    )
    if split and batch_invariant:
        _merge_positional_splits_kernel[(num_tokens,)](
            out,
            split_out,
            split_lse,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=next_power_of_2(num_heads),
            BLOCK_D=block_d,
            num_warps=4,
        )
    elif split:
        _merge_kv_splits_kernel[(num_tokens, num_heads)](
            out,
            split_out,
            split_lse,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_S=max(MAX_KV_SPLITS, next_power_of_2(num_kv_splits)),  # one compiled variant
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
