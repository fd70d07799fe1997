"""Where the Triton kernels may run, and small launch-size helpers.

Triton compiles for CUDA devices; with TRITON_INTERPRET=1 set before triton is
imported, the same kernels run on CPU tensors through Triton's interpreter (tests do that).
"""

from __future__ import annotations

import os

import torch
from triton.runtime.interpreter import InterpretedFunction


def check_kernel_device(name: str, tensor: torch.Tensor, kernel: object | None = None) -> None:
    """Raise ValueError unless `kernel` can run on `tensor`'s device.

    Whether a kernel is interpreted is fixed when its module is imported (TRITON_INTERPRET=1
    must be set before that), so this asks the kernel object when given, else the environment.
    """
    if kernel is None:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    else:
        interpreted = isinstance(kernel, InterpretedFunction)
    if tensor.device.type == ("cpu" if interpreted else "cuda"):
        return
    raise ValueError(
        f"{name} is on {tensor.device}: the Triton kernels need CUDA tensors, or CPU tensors when "
        f"TRITON_INTERPRET=1 was set before kernels was imported (interpreted now: {interpreted}); "
        "use kernels.reference on CPU"
    )


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
