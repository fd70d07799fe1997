"""The elementwise "glue" between GEMMs (RMSNorm, RoPE, SiLU-and-mul) as plain
functions, and an optional `torch.compile` of them for CUDA, where each otherwise
costs several memory-bound kernels (the float32 norm alone is six passes).

A compiled op falls back to its eager form for good if compilation fails, so a
toolchain problem costs speed, never a run."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.models.rope import apply_rotary

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> weight * normalized x, computed in float32 as Hugging Face does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotary_qk(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D]; cos/sin [T, rotary_dim]."""
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)


class CompiledOrEager:
    """Calls `torch.compile(fn)`; on a compilation error logs once and uses `fn`."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.compiled: Callable | None = torch.compile(fn, dynamic=True)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as error:  # any compiler failure means: run eagerly
                logger.warning("torch.compile of %s failed, running it eagerly: %s", self.fn.__name__, error)
                self.compiled = None
        return self.fn(*args)
