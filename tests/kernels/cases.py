"""Builders of KV caches, slot mappings and attention batches shared by the kernel tests."""

from __future__ import annotations

import torch

# Per-dtype tolerances for attention (pack/unpack/reshape_and_cache are bit-exact).
ATTENTION_TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2.5e-2, "rtol": 2.5e-2},
}


def random_kv(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def shuffled_slots(
    num_blocks: int, block_size: int, num_tokens: int, num_skipped: int, seed: int, device: str
) -> torch.Tensor:
    """int64 [num_tokens]: distinct slots of blocks taken in random order, `num_skipped` of them -1."""
    generator = torch.Generator().manual_seed(seed)
    num_used_blocks = -(-num_tokens // block_size)
    block_ids = torch.randperm(num_blocks, generator=generator)[:num_used_blocks]
    slots = (block_ids[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:num_tokens]
    skipped = torch.randperm(num_tokens, generator=generator)[:num_skipped]
    slots[skipped] = -1
    return slots.to(device)


def attention_batch(
    num_new_tokens: list[int],
    seq_lens: list[int],
    num_blocks: int,
    block_size: int,
    seed: int,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (block_tables int32 [num_seqs, max_blocks], seq_lens int32, query_start_loc int32).

    Every sequence gets distinct blocks in random order; unused table entries are -1
    garbage that the kernel must never read.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    all_block_ids = torch.randperm(num_blocks, generator=generator)
    if sum(blocks_per_seq) > num_blocks:
        raise ValueError("not enough blocks for this batch")
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for seq_idx, num_seq_blocks in enumerate(blocks_per_seq):
        tables[seq_idx, :num_seq_blocks] = all_block_ids[used : used + num_seq_blocks].int()
        used += num_seq_blocks
    starts = torch.tensor([0, *num_new_tokens]).cumsum(0).int()
    return tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), starts.to(device)
