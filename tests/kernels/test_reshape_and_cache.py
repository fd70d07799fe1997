"""reshape_and_cache against its reference under the CPU interpreter (bit-exact)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.cases import random_kv, shuffled_slots

pytestmark = pytest.mark.usefixtures("interpreted")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 3, 24), (8, 2, 16)])
def test_matches_reference_with_strided_key_value(dtype, block_size, num_kv_heads, head_dim):
    # key/value as slices of one fused projection output, like a model's QKV split.
    fused = random_kv((11, 3, num_kv_heads, head_dim), dtype, "cpu", seed=0)
    key, value = fused[:, 1], fused[:, 2]
    kv_layer = random_kv((2, 5, block_size, num_kv_heads, head_dim), dtype, "cpu", seed=1)
    expected = kv_layer.clone()
    slots = shuffled_slots(5, block_size, 11, num_skipped=3, seed=2, device="cpu")
    kernels.reshape_and_cache(key, value, kv_layer, slots)
    reference.reshape_and_cache_ref(key, value, expected, slots)
    assert torch.equal(kv_layer, expected)


def test_writes_into_a_layer_view_and_leaves_other_layers():
    kv_cache = torch.zeros(3, 2, 4, 8, 2, 16)
    key, value = torch.ones(2, 2, 16), torch.full((2, 2, 16), 2.0)
    kernels.reshape_and_cache(key, value, kv_cache[1], torch.tensor([3, 30]))
    assert torch.equal(kv_cache[1, 0, 0, 3], key[0]) and torch.equal(kv_cache[1, 1, 3, 6], value[1])
    assert int((kv_cache != 0).sum()) == 4 * 2 * 16
    assert not kv_cache[0].any() and not kv_cache[2].any()


@pytest.mark.parametrize(
    "key_shape,slots,message",
    [
        ((3, 2, 8), torch.tensor([0, 1, 2]), r"key shape \(3, 2, 8\) must be"),
        ((3, 2, 16), torch.tensor([0, 1]), "slot_mapping has 2 entries"),
        ((3, 2, 16), torch.tensor([0, 1, 64]), "slot_mapping values"),
        ((3, 2, 16), torch.tensor([0, 1, 2], dtype=torch.int32), "must be int64"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(key_shape, slots, message):
    kv_layer = torch.zeros(2, 4, 16, 2, 16)
    key = torch.ones(key_shape)
    with pytest.raises(ValueError, match=message):
        kernels.reshape_and_cache(key, torch.ones(3, 2, 16), kv_layer, slots)
    assert not kv_layer.any()


def test_dtype_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="same dtype"):
        kernels.reshape_and_cache(
            torch.ones(1, 2, 16, dtype=torch.float16),
            torch.ones(1, 2, 16),
            torch.zeros(2, 4, 16, 2, 16),
            torch.tensor([0]),
        )
