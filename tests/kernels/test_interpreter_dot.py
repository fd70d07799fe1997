"""The interpreter's `tl.dot` as the kernel tests run it (tests/kernels/conftest.py): every
element summed over K in one order, so a row's bits never depend on the other rows."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.conftest import fixed_order_matmul


@pytest.mark.parametrize("out_dtype", [np.float32, np.float64])
def test_a_row_has_the_same_bits_alone_and_anywhere_in_a_tile(out_dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((130, 72)).astype(np.float32)
    b = rng.standard_normal((72, 40)).astype(np.float32)
    whole = fixed_order_matmul(a, b, out_dtype)
    assert whole.dtype == out_dtype and whole.shape == (130, 40)
    np.testing.assert_allclose(whole, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-4)
    for row in (0, 37, 64, 129):
        assert np.array_equal(fixed_order_matmul(a[row : row + 1], b, out_dtype)[0], whole[row])
        shuffled = np.concatenate([a[row + 1 :], a[: row + 1]])
        assert np.array_equal(fixed_order_matmul(shuffled, b, out_dtype)[-1], whole[row])
        assert np.array_equal(fixed_order_matmul(a, b[:, 3:9], out_dtype)[row], whole[row, 3:9])


def test_sums_in_index_order():
    # 1e8 + 1 - 1e8 in float32: 0 when summed left to right (1e8 + 1 rounds to 1e8), 1 otherwise.
    a = np.array([[1e8, 1.0, -1e8]], dtype=np.float32)
    b = np.ones((3, 1), dtype=np.float32)
    assert fixed_order_matmul(a, b, np.float32)[0, 0] == 0.0
    assert fixed_order_matmul(a[:, ::-1].copy(), b, np.float32)[0, 0] == 0.0
    assert fixed_order_matmul(a[:, [0, 2, 1]].copy(), b, np.float32)[0, 0] == 1.0


def test_batched_operands_broadcast_like_matmul():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 5, 8)).astype(np.float32)
    b = rng.standard_normal((8, 4)).astype(np.float32)
    np.testing.assert_allclose(fixed_order_matmul(a, b, np.float32), a @ b, rtol=1e-5, atol=1e-5)
