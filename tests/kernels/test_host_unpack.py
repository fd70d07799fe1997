"""kernels.host_unpack: chunks in host memory unpacked by one launch per layer range.

On CPU the kernel runs through Triton's interpreter, reading ordinary CPU tensors (on
CUDA it reads pinned host memory: tests/kernels/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.host_unpack import chunk_table, unpack_kv_from_host
from tests.kernels.cases import random_kv, shuffled_slots

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 24, 4, 2, 8


def _chunks(lengths, seed):
    shapes = [(NUM_LAYERS, 2, n, NUM_KV_HEADS, HEAD_DIM) for n in lengths]
    chunks = [random_kv(shape, torch.float32, "cpu", seed + i) for i, shape in enumerate(shapes)]
    slots = shuffled_slots(NUM_BLOCKS, BLOCK_SIZE, sum(lengths), num_skipped=3, seed=seed, device="cpu")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return chunks, [slots[s : s + n].clone() for s, n in zip(starts, lengths, strict=True)]


def _expected(kv_cache, chunks, slot_mappings, layers):
    expected = kv_cache.clone()
    first, last = layers
    for chunk, slots in zip(chunks, slot_mappings, strict=True):
        reference.unpack_kv_ref(chunk[first:last], expected[first:last], slots)
    return expected


@pytest.mark.parametrize("num_programs", [1, 3, 64])
@pytest.mark.parametrize("layers", [(0, NUM_LAYERS), (1, 2), (0, 1), (2, 3)])
def test_chunks_of_several_lengths_match_the_reference(interpreted, layers, num_programs):
    chunks, slot_mappings = _chunks([8, 8, 5, 3], seed=4)
    kv_cache = random_kv(
        (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), torch.float32, "cpu", 9
    )
    expected = _expected(kv_cache, chunks, slot_mappings, layers)
    unpack_kv_from_host(chunk_table(chunks, slot_mappings), kv_cache, 8, layers, num_programs=num_programs)
    assert torch.equal(kv_cache, expected)


def test_layer_ranges_one_by_one_equal_one_launch_for_all(interpreted):
    chunks, slot_mappings = _chunks([8, 6], seed=11)
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    by_layer, at_once = torch.zeros(shape), torch.zeros(shape)
    table = chunk_table(chunks, slot_mappings)
    for layer in range(NUM_LAYERS):
        unpack_kv_from_host(table, by_layer, 8, (layer, layer + 1))
    unpack_kv_from_host(table, at_once, 8)
    assert torch.equal(by_layer, at_once)
    assert by_layer.abs().sum() > 0


@pytest.mark.parametrize("layers", [(0, NUM_LAYERS), (1, 3), (2, 3)])
def test_pieces_of_layers_land_where_whole_chunks_would(interpreted, layers):
    """Staged pieces (only layers [first, last) of each chunk, as the connector copies
    them to the device) unpack to the same cache as the whole chunks."""
    chunks, slot_mappings = _chunks([8, 5, 3], seed=21)
    first, last = layers
    pieces = [chunk[first:last].contiguous() for chunk in chunks]
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    from_pieces, from_chunks = torch.zeros(shape), torch.zeros(shape)
    unpack_kv_from_host(
        chunk_table(pieces, slot_mappings), from_pieces, 8, layers, chunks_hold_only_these_layers=True
    )
    unpack_kv_from_host(chunk_table(chunks, slot_mappings), from_chunks, 8, layers)
    assert torch.equal(from_pieces, from_chunks)
    assert from_pieces[first:last].abs().sum() > 0


def test_out_of_range_and_skipped_slots_leave_the_cache_untouched(interpreted):
    chunks, slot_mappings = _chunks([4], seed=2)
    slot_mappings[0][:] = torch.tensor([-1, NUM_BLOCKS * BLOCK_SIZE, 10**9, -7])
    kv_cache = torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    unpack_kv_from_host(chunk_table(chunks, slot_mappings), kv_cache, 4)
    assert kv_cache.abs().sum() == 0


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c, s: (c, s[:1]), "2 chunks but 1 slot maps"),
        (lambda c, s: (c, [s[0][:3], s[1]]), "has 8 tokens but its slot map 3"),
        (lambda c, s: (c, [s[0].int(), s[1]]), "contiguous int64 vector"),
        (lambda c, s: ([c[0].transpose(0, 1), c[1]], s), "contiguous 5-d tensor"),
    ],
)
def test_bad_tables_are_refused(change, message):
    chunks, slot_mappings = _chunks([8, 8], seed=3)
    with pytest.raises(ValueError, match=message):
        chunk_table(*change(chunks, slot_mappings))


def test_bad_launches_are_refused(interpreted):
    chunks, slot_mappings = _chunks([8], seed=5)
    table = chunk_table(chunks, slot_mappings)
    kv_cache = torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"layers \[2, 5\) outside"):
        unpack_kv_from_host(table, kv_cache, 8, (2, 5))
    with pytest.raises(ValueError, match="int64 \\[3, num_chunks\\]"):
        unpack_kv_from_host(table[:2], kv_cache, 8)
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        unpack_kv_from_host(table, kv_cache, 0)
    assert kv_cache.abs().sum() == 0
