"""Move KV between the engine's paged blocks and contiguous chunks.

`pack_kv` gathers the tokens at `slot_mapping` from every layer into one
`[num_layers, 2, num_tokens, num_kv_heads, head_dim]` tensor (the chunk layout of
storage_backends.KVChunk); `unpack_kv` scatters a chunk back. The per-layer forms
serve layerwise pipelining. The connector calls these once per chunk (or per layer
of a chunk) it saves or loads.

Speed: one program per (token tile, layer x K/V plane). A token's row in a plane is
num_kv_heads * head_dim contiguous elements in both layouts, so each program does
wide contiguous loads/stores of whole rows; the only index math is one int64
multiply per token.

Pinned host chunks: Triton cannot address host memory, so when `out`/`chunk` is on
the CPU (pinned) while the cache is on a GPU, the wrapper stages through a GPU
buffer and copies with non_blocking=True on the current stream. The caller must
synchronize that stream before reading a pinned `out` on the host, and before
overwriting a pinned `chunk` it passed to unpack.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import validation
from kernels.launch import check_kernel_device, next_power_of_2

# Bytes each program moves per plane: 2 tokens of the Llama-3.1-8B shape (2 x 2 KB),
# 2 x 16-byte vectors per thread with 4 warps. Many small programs beat few large ones:
# on an H200 this setting reached 0.96-0.99 of a plain device copy from 256 to 16k
# tokens, against 0.91-0.94 for 16 KB programs (benchmarks/kernels.py sweep).
_BYTES_PER_PROGRAM = 4096
_MAX_BLOCK_ROW = 1024


# Lengths vary per call: no per-value specialization (one compiled variant per config).
@triton.jit(do_not_specialize=["num_tokens"])
def _move_kv_rows_kernel(
    paged_ptr,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], dense from num_blocks on
    packed_ptr,  # [num_layers, 2, num_tokens, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,  # int64 [num_tokens], -1 = skip
    num_tokens,
    num_slots,  # num_blocks * block_size
    stride_paged_layer,
    stride_paged_kind,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: elements of one token in one plane
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_ROW: tl.constexpr,  # row elements per inner step (power of 2)
    PACK: tl.constexpr,  # True: paged -> packed, False: packed -> paged
):
    token_tile = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + kind
    layer = plane // 2
    kind = plane % 2
    tokens = token_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_mask, other=-1).to(tl.int64)
    token_mask = token_mask & (slots >= 0) & (slots < num_slots)
    paged_rows = paged_ptr + layer * stride_paged_layer + kind * stride_paged_kind + slots[:, None] * ROW
    packed_rows = packed_ptr + (plane * num_tokens + tokens[:, None]) * ROW
    for col in tl.static_range(0, ROW, BLOCK_ROW):
        cols = col + tl.arange(0, BLOCK_ROW)
        if ROW % BLOCK_ROW == 0:
            # A mask that is constant along the row keeps the accesses 16-byte vectorized.
            mask = token_mask[:, None]
        else:
            mask = token_mask[:, None] & (cols[None, :] < ROW)
        if PACK:
            tl.store(packed_rows + cols[None, :], tl.load(paged_rows + cols[None, :], mask=mask), mask=mask)
        else:
            tl.store(paged_rows + cols[None, :], tl.load(packed_rows + cols[None, :], mask=mask), mask=mask)


@functools.lru_cache(maxsize=64)
def launch_config(row: int, element_size: int) -> tuple[int, int]:
    """-> (BLOCK_T, BLOCK_ROW) for rows of `row` elements of `element_size` bytes."""
    block_row = min(next_power_of_2(row), _MAX_BLOCK_ROW)
    block_tokens = max(1, _BYTES_PER_PROGRAM // (block_row * element_size))
    return block_tokens, block_row


def _move(
    paged: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    packed: torch.Tensor,  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
    *,
    pack: bool,
    check_values: bool,
    block_tokens: int | None = None,
    num_warps: int = 4,
) -> None:
    """Validate, stage a host chunk through the GPU if needed, and launch one kernel."""
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = paged.shape
    num_slots = num_blocks * block_size
    num_tokens = slot_mapping.numel()
    if packed.device != paged.device and not (
        packed.device.type == "cpu" and paged.device.type == "cuda" and packed.is_pinned()
    ):
        raise ValueError(
            f"the packed tensor is on {packed.device} and the KV cache on {paged.device}: "
            "it must be on the same device or in pinned host memory"
        )
    may_skip = True
    if check_values:
        may_skip = validation.check_slot_values(slot_mapping, num_slots) < 0
    if num_tokens == 0 or num_layers == 0:
        return
    target = packed
    if packed.device != paged.device:
        # Staging: pack must keep the rows of skipped tokens, so it preloads them when any may exist.
        if pack and not may_skip:
            target = torch.empty(packed.shape, dtype=packed.dtype, device=paged.device)
        else:
            target = packed.to(paged.device, non_blocking=True)
    row = num_kv_heads * head_dim
    default_block_tokens, block_row = launch_config(row, paged.element_size())
    block_tokens = block_tokens or default_block_tokens
    grid = (triton.cdiv(num_tokens, block_tokens), num_layers * 2)
    _move_kv_rows_kernel[grid](
        paged,
        target,
        slot_mapping,
        num_tokens,
        num_slots,
        paged.stride(0),
        paged.stride(1),
        ROW=row,
        BLOCK_T=block_tokens,
        BLOCK_ROW=block_row,
        PACK=pack,
        num_warps=num_warps,
    )
    if pack and target is not packed:
        packed.copy_(target, non_blocking=True)


def _checked_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[int, ...]:
    """-> packed shape [num_layers, 2, num_tokens, num_kv_heads, head_dim]."""
    validation.check_kv_cache(kv_cache)
    check_kernel_device("kv_cache", kv_cache, _move_kv_rows_kernel)
    validation.check_slot_mapping(slot_mapping, None, kv_cache.device)
    num_layers, _, _, _, num_kv_heads, head_dim = kv_cache.shape
    return (num_layers, 2, slot_mapping.numel(), num_kv_heads, head_dim)


def pack_kv(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    out: torch.Tensor | None = None,  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """Gather the tokens at `slot_mapping` from every layer into `out` (allocated on the cache's device if None).

    Rows of skipped tokens (slot -1) are left untouched. `check_values` validates the
    slot range (one stream sync on CUDA); with False, out-of-range slots are skipped
    like -1 instead of reported, and a pinned `out` is preloaded into the staging buffer.
    """
    shape = _checked_cache(kv_cache, slot_mapping)
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    validation.check_packed("out", out, shape, kv_cache.dtype)
    _move(kv_cache, out, slot_mapping, pack=True, check_values=check_values)
    return out


def unpack_kv(
    chunk: torch.Tensor,  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], written
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    *,
    check_values: bool = True,
) -> None:
    """Scatter `chunk` into the paged slots of every layer; slot -1 is skipped.

    Two tokens mapped to one slot leave either one's row there (unspecified which).
    """
    shape = _checked_cache(kv_cache, slot_mapping)
    validation.check_packed("chunk", chunk, shape, kv_cache.dtype)
    _move(kv_cache, chunk, slot_mapping, pack=False, check_values=check_values)


def _checked_layer(kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[int, ...]:
    """-> packed layer shape [2, num_tokens, num_kv_heads, head_dim]."""
    validation.check_kv_layer(kv_layer)
    check_kernel_device("kv_layer", kv_layer, _move_kv_rows_kernel)
    validation.check_slot_mapping(slot_mapping, None, kv_layer.device)
    return (2, slot_mapping.numel(), kv_layer.shape[3], kv_layer.shape[4])


def pack_kv_layer(
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    out: torch.Tensor | None = None,  # [2, num_tokens, num_kv_heads, head_dim]
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """One layer of `pack_kv` (same contract)."""
    shape = _checked_layer(kv_layer, slot_mapping)
    if out is None:
        out = torch.empty(shape, dtype=kv_layer.dtype, device=kv_layer.device)
    validation.check_packed("out", out, shape, kv_layer.dtype)
    _move(kv_layer.unsqueeze(0), out.unsqueeze(0), slot_mapping, pack=True, check_values=check_values)
    return out


def unpack_kv_layer(
    chunk_layer: torch.Tensor,  # [2, num_tokens, num_kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    *,
    check_values: bool = True,
) -> None:
    """One layer of `unpack_kv` (same contract)."""
    shape = _checked_layer(kv_layer, slot_mapping)
    validation.check_packed("chunk_layer", chunk_layer, shape, kv_layer.dtype)
    _move(
        kv_layer.unsqueeze(0), chunk_layer.unsqueeze(0), slot_mapping, pack=False, check_values=check_values
    )
