"""The compiled kernels on a real CUDA GPU, on realistic shapes (marker `gpu`; skipped without CUDA).

Run with TRITON_INTERPRET unset (or 0): `python3 -m pytest tests/kernels -m gpu -q`.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.cases import ATTENTION_TOLERANCES, attention_batch, random_kv, shuffled_slots

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (3, 96), (2, 80)])
def test_pack_unpack_match_reference(dtype, num_kv_heads, head_dim):
    num_layers, num_blocks, block_size = 32, 160, 16
    kv_cache = random_kv((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, "cuda", 0)
    slots = shuffled_slots(num_blocks, block_size, 1000, num_skipped=37, seed=1, device="cuda")
    shape = (num_layers, 2, 1000, num_kv_heads, head_dim)
    out = torch.full(shape, -5.0, dtype=dtype, device="cuda")
    expected = out.clone()
    kernels.pack_kv(kv_cache, slots, out)
    reference.pack_kv_ref(kv_cache, slots, expected)
    assert torch.equal(out, expected)

    chunk = random_kv(shape, dtype, "cuda", 2)
    expected_cache = kv_cache.clone()
    reference.unpack_kv_ref(chunk, expected_cache, slots)
    kernels.unpack_kv(chunk, kv_cache, slots, check_values=False)
    assert torch.equal(kv_cache, expected_cache)

    # kv_cache now holds `chunk` at the unmasked slots: per-layer packs must see that.
    for layer in (0, num_layers - 1):
        expected_layer = out[layer].clone()
        reference.pack_kv_layer_ref(kv_cache[layer], slots, expected_layer)
        assert torch.equal(kernels.pack_kv_layer(kv_cache[layer], slots, out[layer].clone()), expected_layer)


@pytest.mark.parametrize("check_values", [True, False])
def test_pinned_host_chunks(check_values):
    kv_cache = random_kv((32, 2, 96, 16, 8, 128), torch.bfloat16, "cuda", 3)
    slots = shuffled_slots(96, 16, 512, num_skipped=9, seed=4, device="cuda")
    out = torch.full((32, 2, 512, 8, 128), 4.0, dtype=torch.bfloat16).pin_memory()
    kernels.pack_kv(kv_cache, slots, out, check_values=check_values)
    torch.cuda.current_stream().synchronize()
    expected = reference.pack_kv_ref(
        kv_cache, slots, torch.full(out.shape, 4.0, dtype=out.dtype, device="cuda")
    )
    assert torch.equal(out, expected.cpu())

    chunk = random_kv(tuple(out.shape), torch.bfloat16, "cpu", 5).pin_memory()
    expected_cache = kv_cache.clone()
    reference.unpack_kv_ref(chunk.cuda(), expected_cache, slots)
    kernels.unpack_kv(chunk, kv_cache, slots, check_values=check_values)
    assert torch.equal(kv_cache, expected_cache)

    layer_out = torch.zeros(2, 512, 8, 128, dtype=torch.bfloat16).pin_memory()
    kernels.pack_kv_layer(kv_cache[7], slots, layer_out)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(layer_out[:, slots.cpu() >= 0], chunk[7][:, slots.cpu() >= 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpack_from_pinned_host_memory_matches_reference(dtype):
    """kernels.host_unpack reads pinned host chunks over PCIe (no staging), layer by layer,
    chunks of several lengths in one launch."""
    from kernels.host_unpack import chunk_table, unpack_kv_from_host

    num_layers, num_blocks, block_size, num_kv_heads, head_dim = 32, 256, 16, 8, 128
    kv_cache = random_kv((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, "cuda", 0)
    lengths = [256, 256, 256, 77]
    chunks = [
        random_kv((num_layers, 2, n, num_kv_heads, head_dim), dtype, "cpu", 10 + i).pin_memory()
        for i, n in enumerate(lengths)
    ]
    slots = shuffled_slots(num_blocks, block_size, sum(lengths), num_skipped=29, seed=3, device="cuda")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    slot_mappings = [slots[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    expected = kv_cache.clone()
    for chunk, chunk_slots in zip(chunks, slot_mappings, strict=True):
        reference.unpack_kv_ref(chunk.cuda(), expected, chunk_slots)
    table = chunk_table(chunks, slot_mappings).cuda()
    for layer in range(num_layers):
        unpack_kv_from_host(table, kv_cache, 256, (layer, layer + 1))
    torch.cuda.synchronize()
    assert torch.equal(kv_cache, expected)


def test_pageable_host_out_is_rejected():
    kv_cache = torch.zeros(1, 2, 4, 16, 1, 16, device="cuda")
    with pytest.raises(ValueError, match="pinned host memory"):
        kernels.pack_kv(kv_cache, torch.tensor([0, 1], device="cuda"), torch.zeros(1, 2, 2, 1, 16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_matches_reference(dtype):
    kv_layer = random_kv((2, 300, 16, 8, 128), dtype, "cuda", 6)
    fused = random_kv((2000, 3, 8, 128), dtype, "cuda", 7)
    slots = shuffled_slots(300, 16, 2000, num_skipped=50, seed=8, device="cuda")
    expected = kv_layer.clone()
    kernels.reshape_and_cache(fused[:, 1], fused[:, 2], kv_layer, slots)
    reference.reshape_and_cache_ref(fused[:, 1], fused[:, 2], expected, slots)
    assert torch.equal(kv_layer, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(32, 8, 128), (12, 4, 80), (14, 2, 96), (8, 8, 64)]
)
def test_paged_attention_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    # Prefill over a cached prefix, whole-prompt prefill, decodes and a tiny prompt in one batch.
    num_new = [300, 1, 517, 1, 1, 64, 3]
    seq_lens = [1100, 2048, 517, 37, 1, 700, 3]
    tables, seq_lens_t, starts = attention_batch(num_new, seq_lens, 400, 16, seed=9, device="cuda")
    kv_layer = random_kv((2, 400, 16, num_kv_heads, head_dim), dtype, "cuda", 10)
    query = random_kv((sum(num_new), num_heads, head_dim), dtype, "cuda", 11)
    scale = 1 / math.sqrt(head_dim)
    out = kernels.paged_attention(query, kv_layer, tables, seq_lens_t, starts, scale)
    expected = reference.paged_attention_ref(query, kv_layer, tables, seq_lens_t, starts, scale)
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[dtype])


def test_paged_attention_decode_batch_with_max_query_len():
    tables, seq_lens, starts = attention_batch(
        [1] * 64, [2048] * 64, 64 * 128 + 8, 16, seed=12, device="cuda"
    )
    kv_layer = random_kv((2, 64 * 128 + 8, 16, 8, 128), torch.bfloat16, "cuda", 13)
    query = random_kv((64, 32, 128), torch.bfloat16, "cuda", 14)
    out = kernels.paged_attention(
        query, kv_layer, tables, seq_lens, starts, 128**-0.5, max_query_len=1, check_values=False
    )
    expected = reference.paged_attention_ref(query, kv_layer, tables, seq_lens, starts, 128**-0.5)
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[torch.bfloat16])


def test_split_kv_decode_of_long_sequences():
    """A few sequences of thousands of keys: the launch splits their KV and merges the parts."""
    from kernels.attention_launch import choose_num_kv_splits

    seq_lens_list = [16384, 5000, 129]
    assert choose_num_kv_splits(3, 8, 16384, torch.device("cuda")) > 1
    num_blocks = sum(-(-n // 16) for n in seq_lens_list) + 8
    tables, seq_lens, starts = attention_batch(
        [1, 1, 1], seq_lens_list, num_blocks, 16, seed=16, device="cuda"
    )
    kv_layer = random_kv((2, num_blocks, 16, 8, 128), torch.bfloat16, "cuda", 17)
    query = random_kv((3, 32, 128), torch.bfloat16, "cuda", 18)
    out = kernels.paged_attention(
        query,
        kv_layer,
        tables,
        seq_lens,
        starts,
        128**-0.5,
        max_query_len=1,
        max_seq_len=16384,
        check_values=False,
    )
    expected = reference.paged_attention_ref(query, kv_layer, tables, seq_lens, starts, 128**-0.5)
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[torch.bfloat16])
    unsplit = kernels.paged_attention(query, kv_layer, tables, seq_lens, starts, 128**-0.5, num_kv_splits=1)
    torch.testing.assert_close(out, unsplit, **ATTENTION_TOLERANCES[torch.bfloat16])


def test_split_kv_for_a_short_chunk_over_a_long_prefix():
    """80 new tokens over 8,192 keys (a prompt's suffix after a cache hit): the default
    policy splits the KV of its few tiles; the result matches the reference and the
    unsplit launch."""
    from kernels.attention_launch import choose_num_kv_splits

    assert choose_num_kv_splits(5, 8, 8192, torch.device("cuda"), num_tokens=80) > 1
    num_blocks = 8192 // 16 + 8
    tables, seq_lens, starts = attention_batch([80], [8192], num_blocks, 16, seed=19, device="cuda")
    kv_layer = random_kv((2, num_blocks, 16, 8, 128), torch.bfloat16, "cuda", 20)
    query = random_kv((80, 32, 128), torch.bfloat16, "cuda", 21)
    out = kernels.paged_attention(
        query, kv_layer, tables, seq_lens, starts, 128**-0.5, max_query_len=80, max_seq_len=8192
    )
    expected = reference.paged_attention_ref(query, kv_layer, tables, seq_lens, starts, 128**-0.5)
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[torch.bfloat16])
    unsplit = kernels.paged_attention(query, kv_layer, tables, seq_lens, starts, 128**-0.5, num_kv_splits=1)
    torch.testing.assert_close(out, unsplit, **ATTENTION_TOLERANCES[torch.bfloat16])


def test_element_offsets_beyond_int32():
    """A KV tensor of > 2^31 elements (bf16, ~4.3 GB) used through its last blocks."""
    num_blocks, block_size, num_kv_heads, head_dim = 66_000, 16, 8, 128
    kv_cache = torch.empty(
        (1, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.bfloat16, device="cuda"
    )
    assert kv_cache.numel() > 2**31 and kv_cache[0, 1, -1].storage_offset() > 2**31
    last_blocks = torch.arange(num_blocks - 40, num_blocks, device="cuda")
    kv_cache[:, :, last_blocks] = random_kv(
        (1, 2, 40, block_size, num_kv_heads, head_dim), torch.bfloat16, "cuda", 15
    )
    kv_layer = kv_cache[0]
    slots = (last_blocks.flip(0)[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()[
        :600
    ]
    slots[5] = -1

    # Zero-filled: the skipped row stays as it was, and torch.empty may hold NaN patterns.
    packed = kernels.pack_kv(
        kv_cache, slots, torch.zeros(1, 2, 600, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    )
    expected = reference.pack_kv_ref(kv_cache, slots, torch.zeros_like(packed))
    assert torch.equal(packed, expected)

    chunk = random_kv(tuple(packed.shape), torch.bfloat16, "cuda", 16)
    kernels.unpack_kv(chunk, kv_cache, slots)
    assert torch.equal(reference.pack_kv_ref(kv_cache, slots)[:, :, slots >= 0], chunk[:, :, slots >= 0])

    key, value = random_kv((2, 600, num_kv_heads, head_dim), torch.bfloat16, "cuda", 17)
    kernels.reshape_and_cache(key, value, kv_layer, slots)
    written = reference.pack_kv_layer_ref(kv_layer, slots)
    assert torch.equal(written[0, slots >= 0], key[slots >= 0])
    assert torch.equal(written[1, slots >= 0], value[slots >= 0])

    tables = last_blocks.flip(0)[None, :].int()
    seq_lens = torch.tensor([600], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    query = random_kv((100, 32, head_dim), torch.bfloat16, "cuda", 18)
    out = kernels.paged_attention(query, kv_layer, tables, seq_lens, starts, head_dim**-0.5)
    expected_out = reference.paged_attention_ref(query, kv_layer, tables, seq_lens, starts, head_dim**-0.5)
    torch.testing.assert_close(out, expected_out, **ATTENTION_TOLERANCES[torch.bfloat16])


def test_cpu_tensors_are_rejected_by_compiled_kernels():
    with pytest.raises(ValueError, match="need CUDA tensors"):
        kernels.pack_kv(torch.zeros(1, 2, 4, 16, 1, 16), torch.tensor([0]))
