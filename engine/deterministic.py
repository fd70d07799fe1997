"""The deterministic mode (`EngineArgs.deterministic`): batch-invariant forward pass.

With it on, every operation of the forward pass computes each token's output in an
order that depends on that token alone -- not on the batch size, its place in the
batch, the chunked-prefill boundaries, where its prefix's KV came from (GPU prefix
cache, a tier, just computed) or the step kind (prefill, decode, speculative
verification). So a request's tokens are the same, bit for bit, in bf16 too, with
offload on or off, with or without speculation, whatever else runs beside it.

Who calls what: the engine core calls `make_batch_invariant(model)` once after loading
(and after `use_glue_kernels`), `warm_up_linear_tiles` once at start-up on CUDA (the GEMM's
tile follows the number of rows: every band is compiled before the first request), and
builds the model runner with `deterministic=True`; the
runner then routes attention through `attention_fn(device)` for every step kind and
samples row by row (`engine.sampler`'s `row_wise`).

What each op becomes:

| op | CUDA | CPU |
|---|---|---|
| linear layers, LM head | `kernels.matmul.linear`: no split-K, BLOCK_K fixed per dtype, tiles proven bit-identical | `F.linear` per row |
| RMSNorm (with the residual add before it) | `kernels.rms_norm` (`add_rms_norm`): one program per row | `glue.rms_norm` per row |
| RoPE, SiLU-and-mul | eager torch (elementwise: one formula per element) | per row |
| attention | `kernels.paged_attention(batch_invariant=True)` for every step: KV split every 512 positions | `kernels.fixed_order.paged_attention_rows` |
| sampling | per row | per row |

Elementwise CUDA kernels apply one device function to every element, so they are
invariant as they are; the one-launch glue kernels of `use_glue_kernels` are replaced
too (the norm by the row-wise one, RoPE and SiLU-and-mul by their eager forms), so the
mode runs one set of kernels whatever the engine's other settings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import glue
from engine.models.llama import MLP, Attention, LlamaFamilyForCausalLM, RMSNorm
from kernels import fixed_order


class BatchInvariantLinear(nn.Module):
    """A drop-in for `nn.Linear` (same `weight` and `bias` parameters, so names and
    weight streaming stay as they were) whose rows never depend on each other."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant_linear(x, self.weight, self.bias)


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T (+ bias) -> [T, N], each row independent of the others."""
    if x.device.type == "cuda":
        from kernels.matmul import linear

        return linear(x, weight, bias)
    return fixed_order.per_row(F.linear, x, weight, bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.device.type == "cuda":
        from kernels.rms_norm import rms_norm

        return rms_norm(x, weight, eps)
    return fixed_order.per_row(glue.rms_norm, x, weight, eps)


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add (elementwise) and the row-wise norm; one launch on CUDA."""
    if x.device.type == "cuda":
        from kernels.rms_norm import add_rms_norm

        return add_rms_norm(x, residual, weight, eps)
    total = residual + x
    return _rms_norm(total, weight, eps), total


def _rows_together(fn: Callable[..., torch.Tensor | tuple], *tensors: torch.Tensor):
    """fn on each token's rows of every tensor (all [T, ...]), outputs concatenated per position."""
    num_tokens = tensors[0].shape[0]
    if num_tokens <= 1:
        return fn(*tensors)
    results = [fn(*(t[i : i + 1] for t in tensors)) for i in range(num_tokens)]
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*results, strict=True))
    return torch.cat(results)


class _RowWiseRotary:
    """Wraps a RotaryEmbedding so cos/sin are computed position by position (CPU: the
    SIMD and scalar-tail cos/sin of one batched call may differ in the last bit)."""

    def __init__(self, rotary) -> None:
        self.rotary = rotary

    def __getattr__(self, name: str):
        return getattr(self.rotary, name)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _rows_together(lambda p: self.rotary.cos_sin(p, dtype), positions)


def make_batch_invariant(model: LlamaFamilyForCausalLM) -> None:
    """Switch `model` to the batch-invariant ops (see the module docstring). Called once by
    the engine core after the weights are loaded and fused; changes the model in place."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, BatchInvariantLinear(child))
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.impl = _rms_norm
            module.add_impl = _add_rms_norm
        elif isinstance(module, Attention):
            module.rotary_impl = (
                (lambda q, k, cos, sin: _rows_together(glue.rotary_qk, q, k, cos, sin))
                if on_cpu
                else glue.rotary_qk
            )
        elif isinstance(module, MLP):
            module.act_impl = (
                (lambda gate, up: _rows_together(glue.silu_and_mul, gate, up))
                if on_cpu
                else glue.silu_and_mul
            )
    model.logits_linear = batch_invariant_linear
    if on_cpu and model.rotary is not None:
        model.rotary = _RowWiseRotary(model.rotary)


def warm_up_linear_tiles(model: LlamaFamilyForCausalLM, max_rows: int, max_logit_rows: int) -> int:
    """Compile every GEMM tile the deterministic mode can pick for `model`'s layers, by running
    kernels.matmul.linear on zeros once per (weight shape, bias, tile): the tile follows the
    number of rows (kernels.matmul.tile_for), and the engine's warm-up steps need not reach
    every band. Called once by the engine core at start-up (CUDA, after make_batch_invariant);
    layers up to `max_rows` rows (the token budget), the LM head up to `max_logit_rows`.
    Weights streamed from CPU memory are skipped (a resident layer of the same shape
    compiles the same kernels). Returns the number of GEMMs run."""
    from kernels.matmul import linear, row_counts_per_tile

    logits_weight = model.model.embed_tokens.weight if model.tie_word_embeddings else model.lm_head.weight
    layers = [(logits_weight, None, max_logit_rows)] + [
        (module.weight, module.bias, max_rows)
        for module in model.modules()
        if isinstance(module, BatchInvariantLinear) and module.weight is not logits_weight
    ]
    seen: set[tuple] = set()
    num_calls = 0
    with torch.inference_mode():
        for weight, bias, rows_bound in layers:
            key = (tuple(weight.shape), weight.dtype, weight.device, bias is not None, rows_bound)
            if weight.device != logits_weight.device or key in seen:
                continue
            seen.add(key)
            num_cols, num_inner = weight.shape
            for num_rows in row_counts_per_tile(weight.dtype, num_cols, max(1, rows_bound)):
                linear(
                    torch.zeros(num_rows, num_inner, dtype=weight.dtype, device=weight.device), weight, bias
                )
                num_calls += 1
    return num_calls


def attention_fn(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The CPU attention of the deterministic mode (None on CUDA, where engine.attention
    runs the batch-invariant paged kernel for every sequence)."""
    return None if device.type == "cuda" else fixed_order.paged_attention_rows
