"""Run the Triton kernels through the interpreter on machines without CUDA.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, at import time,
before any test module imports ``kernels``. With CUDA present the kernels compile for real
(the ``gpu`` tests); run those with TRITON_INTERPRET unset or 0."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
