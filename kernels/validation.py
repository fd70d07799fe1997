"""Input checks shared by the Triton wrappers and the torch references.

Every public kernel entry point calls these before touching memory, so a bad
argument is a ValueError naming the problem instead of a silent corruption.
They only read metadata (shapes, dtypes, devices), except `check_slot_values`,
which reads the slot tensor and therefore synchronizes a CUDA stream.
"""

from __future__ import annotations

import torch

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_kv_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in KV_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(tensor.shape)}")


def check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Same dtype and same device."""
    if a.dtype != b.dtype:
        raise ValueError(f"{name_a} ({a.dtype}) and {name_b} ({b.dtype}) must have the same dtype")
    if a.device != b.device:
        raise ValueError(f"{name_a} ({a.device}) and {name_b} ({b.device}) must be on the same device")


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int | None, device: torch.device) -> None:
    """slot_mapping: int64 [num_tokens] on `device` (slot = block_id * block_size + offset, -1 = skip)."""
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but the KV cache is on {device}")
    if num_tokens is not None and slot_mapping.numel() != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries, expected num_tokens={num_tokens}")


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> int:
    """Every slot is -1 or in [0, num_slots). Reads the values (a sync on CUDA); returns the minimum."""
    if slot_mapping.numel() == 0:
        return 0
    low, high = torch.stack(torch.aminmax(slot_mapping)).tolist()  # one device-to-host read
    if low < -1 or high >= num_slots:
        raise ValueError(
            f"slot_mapping values must be -1 (skip) or in [0, {num_slots}) "
            f"(num_blocks * block_size), got min {low} max {high}"
        )
    return low


def check_kv_layer(kv_layer: torch.Tensor, name: str = "kv_layer") -> None:
    """kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim], last three dims contiguous."""
    check_ndim(name, kv_layer, 5, "[2, num_blocks, block_size, num_kv_heads, head_dim]")
    if kv_layer.shape[0] != 2:
        raise ValueError(f"{name} dim 0 must be 2 (K and V), got {kv_layer.shape[0]}")
    check_kv_dtype(name, kv_layer)
    check_token_rows_contiguous(name, kv_layer, 1)


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
    check_ndim("kv_cache", kv_cache, 6, "[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]")
    if kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache dim 1 must be 2 (K and V), got {kv_cache.shape[1]}")
    check_kv_dtype("kv_cache", kv_cache)
    check_token_rows_contiguous("kv_cache", kv_cache, 2)


def check_token_rows_contiguous(name: str, tensor: torch.Tensor, block_dim: int) -> None:
    """The dims from `block_dim` (num_blocks) on, [num_blocks, block_size, heads, dim], are dense.

    The kernels address a slot as one flat token index over (num_blocks, block_size)
    and read num_kv_heads * head_dim contiguous elements per token. Called on every
    kernel launch, so it stays cheap.
    """
    sizes, strides = tensor.shape, tensor.stride()
    expected = 1
    for dim in range(tensor.dim() - 1, block_dim - 1, -1):
        # Strides of size-1 dims do not matter.
        if sizes[dim] > 1 and strides[dim] != expected:
            raise ValueError(
                f"{name} must be dense over [num_blocks, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(sizes)} strides {strides}"
            )
        expected *= sizes[dim]


def check_packed(name: str, packed: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A contiguous chunk tensor of exactly `shape` and `dtype`."""
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if tuple(packed.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(packed.shape)}")
    if packed.dtype != dtype:
        raise ValueError(f"{name} dtype {packed.dtype} differs from the KV cache dtype {dtype}")
    if not packed.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_attention_inputs(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Shapes, dtypes and devices of `paged_attention` arguments (no value reads)."""
    check_ndim("query", query, 3, "[num_new_tokens_total, num_heads, head_dim]")
    check_kv_layer(kv_layer)
    check_same("query", query, "kv_layer", kv_layer)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_layer.shape[3]
    if kv_layer.shape[4] != head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from kv_layer head_dim {kv_layer.shape[4]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    num_seqs = block_tables.shape[0]
    for name, tensor, shape in (
        ("block_tables", block_tables, (num_seqs, block_tables.shape[1])),
        ("seq_lens", seq_lens, (num_seqs,)),
        ("query_start_loc", query_start_loc, (num_seqs + 1,)),
    ):
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must have shape {shape}, got {got}")
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")


def check_attention_values(
    num_new_tokens_total: int,
    num_blocks: int,
    block_size: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Value consistency of `paged_attention` metadata. Reads the values (a sync on CUDA)."""
    starts = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    if int(starts[0]) != 0 or int(starts[-1]) != num_new_tokens_total:
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_new_tokens_total={num_new_tokens_total}, "
            f"got {int(starts[0])}..{int(starts[-1])}"
        )
    num_new = starts[1:] - starts[:-1]
    if bool((num_new < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    if bool((lens < num_new).any()):
        bad = int(torch.nonzero(lens < num_new)[0])
        raise ValueError(
            f"seq_lens[{bad}]={int(lens[bad])} is smaller than that sequence's {int(num_new[bad])} new tokens"
        )
    num_blocks_needed = (lens + block_size - 1) // block_size
    if lens.numel() and int(num_blocks_needed.max()) > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns but a sequence needs "
            f"{int(num_blocks_needed.max())} blocks of {block_size}"
        )
    tables = block_tables.to("cpu", torch.int64)
    used = torch.arange(block_tables.shape[1])[None, :] < num_blocks_needed[:, None]
    used_ids = tables[used]
    if used_ids.numel() and (int(used_ids.min()) < 0 or int(used_ids.max()) >= num_blocks):
        raise ValueError(
            f"block_tables entries in use must be in [0, {num_blocks}), "
            f"got min {int(used_ids.min())} max {int(used_ids.max())}"
        )
