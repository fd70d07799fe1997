"""Run the Triton kernels through Triton's CPU interpreter on machines without CUDA.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, at import time,
before any test module imports `kernels` (the CI test script exports it too). With CUDA
present the kernels compile for real and the `gpu` tests run; the interpreter tests skip.

The interpreter runs `tl.dot` as numpy's matmul, i.e. the BLAS that numpy was built with,
whose summation order depends on the processor, on OPENBLAS_CORETYPE and on where a row sits
in the matrix: a row's bits can then change with its neighbours, which no GPU does (an MMA
sums every output element of a tile in one fixed order). The `interpreted` fixture therefore
replaces the interpreter's dot with one that sums over K in index order for every element,
so the tests assert what the kernels guarantee on a GPU, not the bits of a CPU's BLAS.
"""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def fixed_order_matmul(a: np.ndarray, b: np.ndarray, out_dtype: np.dtype) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] in `out_dtype`, each element summed over K in index
    order (products added one at a time), so that its bits depend on its own row and column
    only: whatever M, N or its place in the tile."""
    a = a.astype(out_dtype, copy=False)
    b = b.astype(out_dtype, copy=False)
    acc = np.zeros(np.broadcast_shapes(a.shape[:-1] + (1,), b.shape[:-2] + (1, b.shape[-1])), out_dtype)
    for k in range(a.shape[-1]):
        acc += a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return acc


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip unless the kernels run on CPU tensors through the interpreter; there, `tl.dot`
    sums in a fixed order per element (see the module's docstring)."""
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder, TensorHandle

    from kernels.pack import _move_kv_rows_kernel

    if not isinstance(_move_kv_rows_kernel, InterpretedFunction):
        pytest.skip("kernels are compiled for CUDA here (TRITON_INTERPRET is not 1)")
    numpy_dot = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return numpy_dot(self, a, b, d, input_precision, max_num_imprecise_acc)  # no 8-bit dots here
        product = fixed_order_matmul(a.data, b.data, d.data.dtype)
        return TensorHandle(product + d.data, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)
