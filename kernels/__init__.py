"""Triton kernels that move and attend over the engine's paged KV cache.

Public wrappers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); each
validates its arguments and raises ValueError with a clear message. Pure-torch
references with the same signatures live in `kernels.reference`.
"""

from kernels.pack import pack_kv, pack_kv_layer, unpack_kv, unpack_kv_layer
from kernels.paged_attention import paged_attention
from kernels.rejection_sampler import rejection_sample, rejection_sample_ref
from kernels.reshape_and_cache import reshape_and_cache

__all__ = [
    "pack_kv",
    "pack_kv_layer",
    "paged_attention",
    "rejection_sample",
    "rejection_sample_ref",
    "reshape_and_cache",
    "unpack_kv",
    "unpack_kv_layer",
]
