"""Launch sizing of `kernels.paged_attention`: tile shapes and how many programs split
each tile's KV, in the default and the batch-invariant form.

Called by the `paged_attention` wrapper at every launch (once per layer per engine step on
CUDA) and by tests and compile checks that need the same shapes. Pure host arithmetic
over the step's sizes, the dtype and the GPU's SM count (read once per device); changes
nothing and launches nothing.
"""

from __future__ import annotations

import functools

import torch

from kernels.launch import next_power_of_2

# Split-KV sizing: aim for about this many programs per SM, and give each at least
# this many keys (shorter ranges cost more in the merge than they save).
_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 256
MAX_KV_SPLITS = 64
# The float32 partial results hold num_tokens x num_kv_splits rows per head: bound them
# (32 MiB at 32 heads of 128 dims), so a multi-token chunk splits less.
_MAX_SPLIT_ROWS = 2048


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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


def batch_invariant_launch_config(
    group: int, dtype: torch.dtype, max_query_len: int | None = None
) -> tuple[int, int, int]:
    """-> (BLOCK_Q, BLOCK_M, BLOCK_N) of the batch-invariant form: the prefill tile of
    `launch_config` for every step, or, given `max_query_len` (see
    kernels.paged_attention.BATCH_INVARIANT_TILE_FOLLOWS_QUERIES), `launch_config`'s tile
    for it (same BLOCK_N)."""
    return launch_config(group, 1 << 30 if max_query_len is None else max_query_len, dtype)


#: The batch-invariant form cuts each query's keys into ranges at multiples of this many
#: positions -- whatever the batch, the chunking or the step kind -- reduces each range with
#: its own online softmax and merges them in position order (_merge_split). A multiple of
#: every BLOCK_N (64 and 16).
BATCH_INVARIANT_KV_SPLIT_LEN = 512
#: Running those ranges in programs of their own keeps a float32 partial per (token, head,
#: range); above this many bytes one program walks them all instead (the same bits).
_MAX_SPLIT_PARTIAL_BYTES = 256 << 20


def batch_invariant_num_kv_splits(
    num_seqs: int,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    kv_split_len: int,
    device: torch.device,
) -> int:
    """Programs per query tile in the batch-invariant form, for a batch whose sequences each
    fit one tile (decode, verification): one per positional range of the longest sequence
    when the tiles alone would leave SMs idle (and the partials fit), else 1 (one program
    walks its ranges in turn). Either way each row's bits are the same: this is speed only.
    On CPU (the interpreter tests) the ranges always get programs of their own."""
    num_ranges = -(-max_seq_len // kv_split_len)
    if num_ranges <= 1:
        return 1
    if num_tokens * num_heads * num_ranges * (head_dim + 1) * 4 > _MAX_SPLIT_PARTIAL_BYTES:
        return 1
    if device.type != "cuda":
        return num_ranges
    target = _PROGRAMS_PER_SM * _num_sms(device.index if device.index is not None else 0)
    return num_ranges if num_seqs * num_kv_heads < target else 1


def choose_num_kv_splits(
    num_tiles: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device,
    *,
    num_tokens: int = 0,
) -> int:
    """Splits per query tile for a launch of at least `num_tiles` tiles per KV head
    (decode, speculative verification: one per sequence; a chunk of new tokens over a
    long prefix: one per BLOCK_Q of its tokens). 1 on CPU.

    Enough programs to fill the GPU, but no split shorter than _MIN_KEYS_PER_SPLIT
    keys of the longest sequence, and no more than _MAX_SPLIT_ROWS partial rows over
    the launch's `num_tokens` new tokens. `max_seq_len` is an upper bound (a CUDA
    graph passes the model's maximum length, so its splits depend on its shape only).
    """
    if device.type != "cuda":
        return 1
    return kv_splits_for(
        num_tiles,
        num_kv_heads,
        max_seq_len,
        _num_sms(device.index if device.index is not None else 0),
        num_tokens=num_tokens,
    )


def kv_splits_for(
    num_tiles: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *, num_tokens: int = 0
) -> int:
    """`choose_num_kv_splits` for a GPU of `num_sms` SMs (pure arithmetic)."""
    target = _PROGRAMS_PER_SM * num_sms
    by_length = -(-max_seq_len // _MIN_KEYS_PER_SPLIT)
    by_occupancy = -(-target // max(1, num_tiles * num_kv_heads))
    by_rows = max(1, _MAX_SPLIT_ROWS // num_tokens) if num_tokens > 0 else MAX_KV_SPLITS
    return max(1, min(by_length, by_occupancy, by_rows, MAX_KV_SPLITS))
