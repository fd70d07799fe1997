"""pack_kv / unpack_kv (+ per-layer forms) against the torch references, under the CPU interpreter.

Bit-exact for every dtype; shuffled blocks, masked (-1) slots, sizes that are not powers of two.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import reference
from tests.kernels.cases import random_kv, shuffled_slots

pytestmark = pytest.mark.usefixtures("interpreted")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 3, 24), (8, 2, 16), (8, 1, 40)])
def test_pack_matches_reference_and_leaves_skipped_rows(dtype, block_size, num_kv_heads, head_dim):
    kv_cache = random_kv((2, 2, 7, block_size, num_kv_heads, head_dim), dtype, "cpu", seed=0)
    slots = shuffled_slots(7, block_size, 37, num_skipped=5, seed=1, device="cpu")
    out = torch.full((2, 2, 37, num_kv_heads, head_dim), -3.0, dtype=dtype)
    expected = out.clone()
    assert kernels.pack_kv(kv_cache, slots, out) is out
    reference.pack_kv_ref(kv_cache, slots, expected)
    assert torch.equal(out, expected)
    assert bool((out[:, :, slots < 0] == -3.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_matches_reference_and_touches_only_mapped_slots(dtype):
    kv_cache = random_kv((3, 2, 6, 8, 3, 24), dtype, "cpu", seed=2)
    slots = shuffled_slots(6, 8, 29, num_skipped=4, seed=3, device="cpu")
    chunk = random_kv((3, 2, 29, 3, 24), dtype, "cpu", seed=4)
    expected = kv_cache.clone()
    reference.unpack_kv_ref(chunk, expected, slots)
    kernels.unpack_kv(chunk, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


def test_round_trip_through_a_layer_view_of_a_bigger_cache():
    # The engine passes per-layer views of one tensor; the layer stride is not num_blocks-sized.
    kv_cache = random_kv((4, 2, 5, 8, 3, 24), torch.bfloat16, "cpu", seed=5)
    slots = shuffled_slots(5, 8, 21, num_skipped=0, seed=6, device="cpu")
    packed = kernels.pack_kv(kv_cache, slots)
    for layer in range(4):
        assert torch.equal(kernels.pack_kv_layer(kv_cache[layer], slots), packed[layer])
    restored = torch.zeros_like(kv_cache)
    for layer in range(4):
        kernels.unpack_kv_layer(packed[layer], restored[layer], slots)
    mapped = torch.zeros(5 * 8, dtype=torch.bool)
    mapped[slots] = True
    flat_restored = restored.flatten(2, 3)
    assert torch.equal(flat_restored[:, :, mapped], kv_cache.flatten(2, 3)[:, :, mapped])
    assert not flat_restored[:, :, ~mapped].any()


def test_pack_of_only_skipped_and_of_zero_tokens():
    kv_cache = random_kv((1, 2, 2, 8, 1, 16), torch.float32, "cpu", seed=7)
    out = torch.full((1, 2, 3, 1, 16), 9.0)
    kernels.pack_kv(kv_cache, torch.full((3,), -1), out)
    assert bool((out == 9.0).all())
    assert kernels.pack_kv(kv_cache, torch.empty(0, dtype=torch.int64)).shape == (1, 2, 0, 1, 16)


def test_unchecked_out_of_range_slots_are_skipped_not_written():
    kv_cache = random_kv((1, 2, 2, 8, 1, 16), torch.float32, "cpu", seed=8)
    before = kv_cache.clone()
    kernels.unpack_kv(torch.ones(1, 2, 2, 1, 16), kv_cache, torch.tensor([16, 1 << 40]), check_values=False)
    assert torch.equal(kv_cache, before)


@settings(max_examples=12, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    num_skipped=st.integers(0, 40),
    block_size=st.sampled_from([8, 16]),
    seed=st.integers(0, 1000),
)
def test_unpack_then_pack_returns_the_chunk(num_tokens, num_skipped, block_size, seed):
    num_skipped = min(num_skipped, num_tokens)
    kv_cache = random_kv((2, 2, 6, block_size, 3, 8), torch.float16, "cpu", seed=seed)
    slots = shuffled_slots(6, block_size, num_tokens, num_skipped, seed=seed, device="cpu")
    chunk = random_kv((2, 2, num_tokens, 3, 8), torch.float16, "cpu", seed=seed + 1)
    kernels.unpack_kv(chunk, kv_cache, slots)
    packed = kernels.pack_kv(kv_cache, slots, torch.zeros_like(chunk))
    kept = slots >= 0
    assert torch.equal(packed[:, :, kept], chunk[:, :, kept])
    assert not packed[:, :, ~kept].any()


def _cache_and_slots():
    return random_kv((2, 2, 4, 8, 3, 24), torch.float16, "cpu", seed=9), torch.tensor([0, 5, -1, 31])


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda kv, s, out: (kv, s.int(), out), "slot_mapping must be int64"),
        (lambda kv, s, out: (kv, s.view(2, 2), out), "slot_mapping must have shape"),
        (lambda kv, s, out: (kv, torch.tensor([0, 5, -2, 3]), out), "slot_mapping values"),
        (lambda kv, s, out: (kv, torch.tensor([0, 5, 1, 32]), out), "slot_mapping values"),
        (lambda kv, s, out: (kv[:, :1], s, out), "dim 1 must be 2"),
        (lambda kv, s, out: (kv.int(), s, out), "must be float16, bfloat16 or float32"),
        (lambda kv, s, out: (kv.transpose(2, 3), s, out), "must be dense"),
        (lambda kv, s, out: (kv, s, out.float()), "dtype"),
        (lambda kv, s, out: (kv, s, out[:, :, :3]), "must have shape"),
        (lambda kv, s, out: (kv, s, out.transpose(3, 4).contiguous().transpose(3, 4)), "contiguous"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(change, message):
    kv_cache, slots = _cache_and_slots()
    packed = torch.zeros(2, 2, 4, 3, 24, dtype=torch.float16)
    kv_arg, slots_arg, packed_arg = change(kv_cache, slots, packed)
    before_cache, before_packed = kv_cache.clone(), packed.clone()
    with pytest.raises(ValueError, match=message):
        kernels.pack_kv(kv_arg, slots_arg, packed_arg)
    with pytest.raises(ValueError, match=message):
        kernels.unpack_kv(packed_arg, kv_arg, slots_arg)
    assert torch.equal(kv_cache, before_cache)
    assert torch.equal(packed, before_packed)


def test_per_layer_forms_reject_a_whole_cache():
    kv_cache, slots = _cache_and_slots()
    with pytest.raises(ValueError, match="kv_layer must have shape"):
        kernels.pack_kv_layer(kv_cache, slots)
    with pytest.raises(ValueError, match="chunk_layer must have shape"):
        kernels.unpack_kv_layer(torch.zeros(2, 4, 3, 24, dtype=torch.float16), kv_cache[0], slots[:3])
