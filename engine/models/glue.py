"""The elementwise "glue" between GEMMs (RMSNorm, the residual add with RMSNorm, RoPE,
SiLU-and-mul) as plain torch functions: the model's default forms (CPU, float32, Hugging
Face's numerics) and the references of the one-launch Triton forms that the model uses on
CUDA in 16-bit dtypes (kernels.rms_norm, kernels.elementwise, kernels.rotary_cache;
LlamaFamilyForCausalLM.use_glue_kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> weight * normalized x, computed in float32 as Hugging Face does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(residual + x), residual + x): a decoder layer's residual add, then the
    norm of the new residual stream (Hugging Face's order of operations)."""
    total = residual + x
    return rms_norm(total, weight, eps), total


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotary_qk(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D]; cos/sin [T, rotary_dim]."""
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
