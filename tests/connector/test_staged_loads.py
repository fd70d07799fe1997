"""connector.staged_loads: a step's chunks grouped into two alternating staging buffers,
one table row per chunk piece (the copies and launches themselves need CUDA: the GPU
test below compares the paged cache with the reference unpack)."""

from __future__ import annotations

import pytest
import torch

from connector import staged_loads
from connector.staged_loads import GroupedStaging
from kernels import reference

LAYERS, HEADS, DIM = 4, 2, 8


def _chunk(num_tokens: int, seed: int, device: str = "cpu", pin: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    chunk = torch.randn(LAYERS, 2, num_tokens, HEADS, DIM, generator=generator)
    return chunk.pin_memory() if pin else chunk


def test_groups_fill_at_most_one_buffer_alternate_and_follow_the_ranges(monkeypatch):
    piece_bytes = 2 * 2 * 16 * HEADS * DIM * 4  # layers [0, 2) of a 16-token float32 chunk
    monkeypatch.setattr(staged_loads, "GROUP_BUFFER_BYTES", 3 * piece_bytes)
    staging = GroupedStaging(torch.device("cpu"), torch.float32, max_chunk_tokens=16)
    chunks = [_chunk(16, seed) for seed in range(7)]
    groups = staging._plan(chunks, [(0, 2), (2, 4)])
    assert [(g.first, g.start_chunk, g.num_chunks) for g in groups] == [
        (0, 0, 3),
        (0, 3, 3),
        (0, 6, 1),
        (2, 0, 3),
        (2, 3, 3),
        (2, 6, 1),
    ]
    assert [g.buffer_index for g in groups] == [0, 1, 0, 1, 0, 1]
    assert all(g.num_elements * 4 <= 3 * piece_bytes for g in groups)


def test_table_rows_address_each_staged_piece_and_its_slot_map():
    staging = GroupedStaging(torch.device("cpu"), torch.float32, max_chunk_tokens=16)
    chunks = [_chunk(16, 0), _chunk(5, 1)]  # a partial last chunk: its piece is padded to 16 bytes
    slot_mappings = [torch.arange(16), torch.arange(16, 21)]
    groups = staging._plan(chunks, [(1, 3)])
    for group in groups:
        staging._ensure_buffer(group.buffer_index, group.num_elements)
    table = staging._tables(groups, slot_mappings, chunks).view(3, 2)
    base = staging._buffers[groups[0].buffer_index].data_ptr()
    piece = 2 * 2 * 16 * HEADS * DIM
    assert table[0].tolist() == [base, base + piece * 4]
    assert table[1].tolist() == [slots.data_ptr() for slots in slot_mappings]
    assert table[2].tolist() == [16, 5]
    assert all(address % 16 == 0 for address in table[0].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("layer_ranges", [[(0, LAYERS)], [(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)]])
def test_gpu_grouped_loads_write_what_the_reference_writes(monkeypatch, layer_ranges):
    monkeypatch.setattr(staged_loads, "GROUP_BUFFER_BYTES", 2 * 2 * 16 * HEADS * DIM * 4 * 2)
    num_blocks, block_size = 16, 4
    lengths = [16, 16, 16, 9]
    chunks = [_chunk(n, seed, pin=True) for seed, n in enumerate(lengths)]
    permutation = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    slots = [permutation[s : s + n].clone() for s, n in zip(starts, lengths, strict=True)]
    slots[1][2] = -1  # a skipped token
    kv_cache = torch.zeros(LAYERS, 2, num_blocks, block_size, HEADS, DIM, device="cuda")
    expected = kv_cache.cpu()
    for chunk, slot_map in zip(chunks, slots, strict=True):
        reference.unpack_kv_ref(chunk, expected, slot_map)
    staging = GroupedStaging(torch.device("cuda"), torch.float32, max_chunk_tokens=16)
    kernel_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(2):  # twice: the second pass reuses both buffers after their events
        kv_cache.zero_()
        kernel_stream.wait_stream(torch.cuda.current_stream())
        events = staging.load(
            kernel_stream,
            copy_stream,
            lambda table: table.to("cuda"),
            chunks,
            [s.cuda() for s in slots],
            kv_cache,
            layer_ranges,
        )
        assert len(events) == len(layer_ranges)
        events[-1].synchronize()
        assert torch.equal(kv_cache.cpu(), expected)
