"""Unpack chunks that lie in pinned host memory straight into the paged KV cache.

`unpack_kv_from_host` writes layers [first, last) of many chunks in one launch: the
GPU reads each chunk's rows through unified virtual addressing (pinned host memory is
mapped into the device's address space), so a load needs no device staging buffer, no
host→device copy per chunk and per piece of layers, and one launch per layer range
instead of one per chunk. The connector calls it once per layer (or per range of
layers) of a step's loads, on its load stream, so the forward pass can start on
layer 0 while the later layers are still read over PCIe.

The chunks are given by a table (one row per chunk: the address of its pinned host
tensor ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, the address of its
int64 slot map on the device, and its token count), so chunks of several requests,
of any length up to ``max_chunk_tokens``, go in one launch.

The caller keeps every chunk and slot map alive (and the chunks' host memory pinned)
until the launch has finished; slot values are checked by the caller (out-of-range
slots are skipped like -1).

Under TRITON_INTERPRET=1 the same kernel reads ordinary CPU tensors (tests on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels import validation
from kernels.launch import check_kernel_device, next_power_of_2

#: tokens each program moves per iteration: 16 rows of 2 KB (8B shape) = 32 KB in flight
#: per program, so a few dozen programs cover PCIe's latency
_BLOCK_T = 16
_MAX_BLOCK_ROW = 1024
#: programs per launch; each loops over (plane, chunk, token tile) items. Few, so a load
#: leaves the SMs to the forward pass running beside it: on the H100 16 programs read at
#: 49.6 GB/s (64: 49.7) while GEMMs beside them took 1.7x their time alone (64: 6.1x).
DEFAULT_NUM_PROGRAMS = 16
#: rows of the chunk table
TABLE_HOST_ADDRESS, TABLE_SLOTS_ADDRESS, TABLE_NUM_TOKENS = 0, 1, 2
# the same rows as compile-time constants for the kernel (it may read no other globals)
_HOST_ROW, _SLOTS_ROW, _TOKENS_ROW = (tl.constexpr(row) for row in (0, 1, 2))


@triton.jit(do_not_specialize=["num_chunks", "first_layer", "source_first_layer", "num_planes", "num_items"])
def _unpack_from_host_kernel(
    paged_ptr,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], dense from num_blocks on
    table_ptr,  # int64 [3, num_chunks]: host address, slot map address, token count
    num_chunks,
    num_slots,  # num_blocks * block_size
    first_layer,
    source_first_layer,  # the layer a chunk's first plane holds (0: whole chunks)
    num_planes,  # (last - first) * 2
    num_items,  # num_planes * num_chunks * tiles_per_chunk
    stride_paged_layer,
    stride_paged_kind,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    TILES_PER_CHUNK: tl.constexpr,  # cdiv(max_chunk_tokens, BLOCK_T)
    BLOCK_T: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    ELEMENT_BYTES: tl.constexpr,  # bytes per element of the cache (and the chunks)
):
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        tile = item % TILES_PER_CHUNK
        chunk = (item // TILES_PER_CHUNK) % num_chunks
        plane = (item // (TILES_PER_CHUNK * num_chunks)).to(tl.int64)  # planes outermost: layer order
        host_address = tl.load(table_ptr + _HOST_ROW * num_chunks + chunk)
        slots_address = tl.load(table_ptr + _SLOTS_ROW * num_chunks + chunk)
        num_tokens = tl.load(table_ptr + _TOKENS_ROW * num_chunks + chunk)
        # The chunk is addressed from paged_ptr (a pointer the compiler knows is 16-byte
        # aligned) plus an element distance that is a multiple of 16 bytes (pinned slots
        # are), so its rows are read with 16-byte vector loads over PCIe.
        distance = (host_address - paged_ptr.to(tl.int64, bitcast=True)) // ELEMENT_BYTES
        chunk_ptr = paged_ptr + tl.multiple_of(distance, 16 // ELEMENT_BYTES)
        slots_ptr = slots_address.to(tl.pointer_type(tl.int64))
        tokens = (tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        token_mask = tokens < num_tokens
        slots = tl.load(slots_ptr + tokens, mask=token_mask, other=-1)
        token_mask = token_mask & (slots >= 0) & (slots < num_slots)
        layer = plane // 2 + first_layer
        kind = plane % 2
        # the chunk's plane (layer, kind) holds num_tokens rows of ROW elements
        source_rows = (
            chunk_ptr + (((layer - source_first_layer) * 2 + kind) * num_tokens + tokens[:, None]) * ROW
        )
        paged_rows = paged_ptr + layer * stride_paged_layer + kind * stride_paged_kind + slots[:, None] * ROW
        for col in tl.static_range(0, ROW, BLOCK_ROW):
            cols = col + tl.arange(0, BLOCK_ROW)
            if ROW % BLOCK_ROW == 0:
                mask = token_mask[:, None]
            else:
                mask = token_mask[:, None] & (cols[None, :] < ROW)
            tl.store(paged_rows + cols[None, :], tl.load(source_rows + cols[None, :], mask=mask), mask=mask)


def chunk_table(chunks: Sequence[torch.Tensor], slot_mappings: Sequence[torch.Tensor]) -> torch.Tensor:
    """The host int64 table ``[3, len(chunks)]`` that `unpack_kv_from_host` reads (copy it
    to the cache's device first). Validates that each chunk is contiguous and that its
    slot map is a contiguous int64 vector of its token count."""
    if len(chunks) != len(slot_mappings):
        raise ValueError(f"{len(chunks)} chunks but {len(slot_mappings)} slot maps")
    host_addresses, slots_addresses, num_tokens = [], [], []
    for index, (chunk, slots) in enumerate(zip(chunks, slot_mappings, strict=True)):
        if chunk.dim() != 5 or not chunk.is_contiguous():
            raise ValueError(f"chunk {index} must be a contiguous 5-d tensor, got shape {tuple(chunk.shape)}")
        if slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous():
            raise ValueError(f"slot map {index} must be a contiguous int64 vector")
        if chunk.data_ptr() % 16:
            raise ValueError(f"chunk {index} must start 16-byte aligned (the kernel reads 16-byte vectors)")
        if slots.numel() != chunk.shape[2]:
            raise ValueError(f"chunk {index} has {chunk.shape[2]} tokens but its slot map {slots.numel()}")
        host_addresses.append(chunk.data_ptr())
        slots_addresses.append(slots.data_ptr())
        num_tokens.append(chunk.shape[2])
    # rows in the order of TABLE_HOST_ADDRESS, TABLE_SLOTS_ADDRESS, TABLE_NUM_TOKENS
    table = [host_addresses, slots_addresses, num_tokens]
    return torch.tensor(table, dtype=torch.int64).reshape(3, len(chunks))


def unpack_kv_from_host(
    table: torch.Tensor,  # int64 [3, num_chunks] on kv_cache's device, from `chunk_table`
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], written
    max_chunk_tokens: int,
    layers: tuple[int, int] | None = None,
    *,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
    chunks_hold_only_these_layers: bool = False,
) -> None:
    """Scatter layers [first, last) (default: all) of every chunk in ``table`` into the
    paged slots; slot -1 (and out-of-range slots) are skipped. Asynchronous on CUDA
    (the current stream); the chunks' memory must stay valid until it has run.

    The table's addresses may be device memory too (the connector's staging buffers):
    with ``chunks_hold_only_these_layers`` each chunk is ``[last - first, 2, num_tokens,
    num_kv_heads, head_dim]`` (a piece of layers), else a whole chunk of every layer."""
    validation.check_kv_cache(kv_cache)
    check_kernel_device("kv_cache", kv_cache, _unpack_from_host_kernel)
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    first, last = layers if layers is not None else (0, num_layers)
    if not 0 <= first <= last <= num_layers:
        raise ValueError(f"layers [{first}, {last}) outside the cache's {num_layers} layers")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != 3:
        raise ValueError(
            f"the chunk table must be int64 [3, num_chunks], got {table.dtype} {tuple(table.shape)}"
        )
    if table.device != kv_cache.device:
        raise ValueError(f"the chunk table is on {table.device}, the KV cache on {kv_cache.device}")
    if max_chunk_tokens < 1:
        raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    num_chunks = table.shape[1]
    num_planes = (last - first) * 2
    if num_chunks == 0 or num_planes == 0:
        return
    row = num_kv_heads * head_dim
    tiles_per_chunk = triton.cdiv(max_chunk_tokens, _BLOCK_T)
    num_items = num_planes * num_chunks * tiles_per_chunk
    _unpack_from_host_kernel[(min(num_programs, num_items),)](
        kv_cache,
        table.contiguous(),
        num_chunks,
        num_blocks * block_size,
        first,
        first if chunks_hold_only_these_layers else 0,
        num_planes,
        num_items,
        kv_cache.stride(0),
        kv_cache.stride(1),
        ROW=row,
        TILES_PER_CHUNK=tiles_per_chunk,
        BLOCK_T=_BLOCK_T,
        BLOCK_ROW=min(next_power_of_2(row), _MAX_BLOCK_ROW),
        ELEMENT_BYTES=kv_cache.element_size(),
        num_warps=4,
    )
