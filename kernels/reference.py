"""Pure-torch references of every kernel, with the same signatures.

Tests compare the Triton kernels against these; the engine's CPU attention path
calls `paged_attention_ref` and `reshape_and_cache_ref` directly, so they are
vectorized (no per-token Python loops). They validate their inputs like the
Triton wrappers and raise ValueError on bad input.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kernels import validation


def _valid_slots(slot_mapping: torch.Tensor, block_size: int):
    """-> (token_ids [num_valid], block_ids [num_valid], offsets [num_valid]) of slots != -1."""
    token_ids = torch.nonzero(slot_mapping >= 0).flatten()
    slots = slot_mapping[token_ids]
    return token_ids, slots // block_size, slots % block_size


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
) -> None:
    """Write each token's K and V into its paged slot of one layer."""
    validation.check_kv_layer(kv_layer)
    validation.check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    if key.shape != value.shape or tuple(key.shape[1:]) != tuple(kv_layer.shape[3:]):
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
            f"[num_tokens, {kv_layer.shape[3]}, {kv_layer.shape[4]}]"
        )
    validation.check_same("key", key, "kv_layer", kv_layer)
    validation.check_same("value", value, "kv_layer", kv_layer)
    validation.check_slot_mapping(slot_mapping, key.shape[0], kv_layer.device)
    block_size = kv_layer.shape[2]
    validation.check_slot_values(slot_mapping, kv_layer.shape[1] * block_size)
    token_ids, block_ids, offsets = _valid_slots(slot_mapping, block_size)
    kv_layer[0, block_ids, offsets] = key[token_ids]
    kv_layer[1, block_ids, offsets] = value[token_ids]


def pack_kv_ref(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    out: torch.Tensor | None = None,  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
) -> torch.Tensor:
    """Gather the tokens at `slot_mapping` from every layer; rows of skipped tokens stay untouched."""
    validation.check_kv_cache(kv_cache)
    validation.check_slot_mapping(slot_mapping, None, kv_cache.device)
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    shape = (num_layers, 2, slot_mapping.numel(), num_kv_heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    validation.check_packed("out", out, shape, kv_cache.dtype)
    validation.check_slot_values(slot_mapping, num_blocks * block_size)
    token_ids, block_ids, offsets = _valid_slots(slot_mapping, block_size)
    out[:, :, token_ids.to(out.device)] = kv_cache[:, :, block_ids, offsets].to(out.device)
    return out


def unpack_kv_ref(
    chunk: torch.Tensor,  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], written
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
) -> None:
    """Scatter a packed chunk back into the paged slots of every layer."""
    validation.check_kv_cache(kv_cache)
    validation.check_slot_mapping(slot_mapping, None, kv_cache.device)
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    shape = (num_layers, 2, slot_mapping.numel(), num_kv_heads, head_dim)
    validation.check_packed("chunk", chunk, shape, kv_cache.dtype)
    validation.check_slot_values(slot_mapping, num_blocks * block_size)
    token_ids, block_ids, offsets = _valid_slots(slot_mapping, block_size)
    kv_cache[:, :, block_ids, offsets] = chunk[:, :, token_ids.to(chunk.device)].to(kv_cache.device)


def pack_kv_layer_ref(
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    out: torch.Tensor | None = None,  # [2, num_tokens, num_kv_heads, head_dim]
) -> torch.Tensor:
    """One layer of `pack_kv_ref`."""
    validation.check_kv_layer(kv_layer)
    out_layers = None if out is None else _unsqueeze_packed("out", out)
    return pack_kv_ref(kv_layer.unsqueeze(0), slot_mapping, out_layers)[0]


def unpack_kv_layer_ref(
    chunk_layer: torch.Tensor,  # [2, num_tokens, num_kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
) -> None:
    """One layer of `unpack_kv_ref`."""
    validation.check_kv_layer(kv_layer)
    unpack_kv_ref(_unsqueeze_packed("chunk_layer", chunk_layer), kv_layer.unsqueeze(0), slot_mapping)


def _unsqueeze_packed(name: str, packed: torch.Tensor) -> torch.Tensor:
    validation.check_ndim(name, packed, 4, "[2, num_tokens, num_kv_heads, head_dim]")
    return packed.unsqueeze(0)


def sequences_kv(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """Validate paged-attention inputs, then yield per sequence with new tokens
    ``(start, end, seq_len, kv)``: its new tokens are query rows [start, end), ``kv`` its
    first ``seq_len`` keys and values in float32, [2, seq_len, num_kv_heads, head_dim].
    Shared by the torch references (this one and kernels.fixed_order's)."""
    validation.check_attention_inputs(query, kv_layer, block_tables, seq_lens, query_start_loc)
    num_blocks, block_size = kv_layer.shape[1], kv_layer.shape[2]
    validation.check_attention_values(
        query.shape[0], num_blocks, block_size, block_tables, seq_lens, query_start_loc
    )
    starts = query_start_loc.tolist()
    for seq_idx, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq_idx], starts[seq_idx + 1]
        if end == start:
            continue
        block_ids = block_tables[seq_idx, : (seq_len + block_size - 1) // block_size].long()
        # [2, num_used_blocks * block_size, num_kv_heads, head_dim] -> keep the first seq_len tokens
        yield start, end, seq_len, kv_layer[:, block_ids].flatten(1, 2)[:, :seq_len].float()


def paged_attention_ref(
    query: torch.Tensor,  # [num_new_tokens_total, num_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs], KV length including the new tokens
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1], cumulative new-token counts
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its paged KV.

    New token i of sequence b sits at position seq_lens[b] - num_new_b + i and
    attends to keys at positions <= its own. One SDPA call per sequence, computed
    in float32; returns [num_new_tokens_total, num_heads, head_dim] in query's dtype.
    """
    num_kv_heads = kv_layer.shape[3]
    num_heads, head_dim = query.shape[1], query.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for start, end, seq_len, kv in sequences_kv(query, kv_layer, block_tables, seq_lens, query_start_loc):
        num_new = end - start
        key = kv[0].transpose(0, 1)[:, None].expand(num_kv_heads, group_size, seq_len, head_dim)
        value = kv[1].transpose(0, 1)[:, None].expand(num_kv_heads, group_size, seq_len, head_dim)
        # query head h reads KV head h // group_size: [num_kv_heads, group_size, num_new, head_dim]
        q = query[start:end].float().view(num_new, num_kv_heads, group_size, head_dim).permute(1, 2, 0, 3)
        query_pos = torch.arange(seq_len - num_new, seq_len, device=query.device)
        allowed = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]
        attn = F.scaled_dot_product_attention(q, key, value, attn_mask=allowed, scale=scale)
        out[start:end] = attn.permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim).to(query.dtype)
    return out
