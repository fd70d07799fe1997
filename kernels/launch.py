"""Where the Triton kernels may run, and small launch-size helpers.

Triton compiles for CUDA devices; with TRITON_INTERPRET=1 set before triton is
imported, the same kernels run on CPU tensors through Triton's interpreter (tests do that).
"""

from __future__ import annotations

import os

import torch


def check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError unless `tensor` lives where Triton can run on it."""
    if tensor.device.type == "cuda":
        return
    if tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise ValueError(
        f"{name} is on {tensor.device}: the Triton kernels need CUDA tensors "
        "(or CPU tensors with TRITON_INTERPRET=1); use kernels.reference on CPU"
    )


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
