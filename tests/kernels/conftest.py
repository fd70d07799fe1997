"""Run the Triton kernels through Triton's CPU interpreter on machines without CUDA.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, at import time,
before any test module imports `kernels` (the CI test script exports it too). With CUDA
present the kernels compile for real and the `gpu` tests run; the interpreter tests skip.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def interpreted() -> None:
    """Skip unless the kernels run on CPU tensors through the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.pack import _move_kv_rows_kernel

    if not isinstance(_move_kv_rows_kernel, InterpretedFunction):
        pytest.skip("kernels are compiled for CUDA here (TRITON_INTERPRET is not 1)")
