"""How many paged KV blocks an engine allocates (called once per engine start)."""

from __future__ import annotations

import torch

from engine.config import EngineArgs, ModelConfig
from engine.model_runner import kv_bytes_per_block


def num_kv_blocks(
    args: EngineArgs, model_config: ModelConfig, device: torch.device, dtype: torch.dtype, max_model_len: int
) -> int:
    """``num_gpu_blocks`` when given; else what fits: on CUDA, ``gpu_memory_utilization`` of
    the device less what is in use and one step's activations; on CPU,
    ``cpu_kv_cache_bytes``; never more than ``max_num_seqs`` sequences of ``max_model_len``
    need. ValueError when not one block fits."""
    if args.num_gpu_blocks is not None:
        return args.num_gpu_blocks
    per_block = kv_bytes_per_block(model_config, args.block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # room for activations of one step of max_num_batched_tokens tokens
        activation_bytes = args.max_num_batched_tokens * model_config.hidden_size * 64
        budget = int(total * args.gpu_memory_utilization) - (total - free) - activation_bytes
    else:
        budget = args.cpu_kv_cache_bytes
    useful = args.max_num_seqs * -(-max_model_len // args.block_size)
    num_blocks = min(budget // per_block, useful)
    if num_blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({budget} bytes, {per_block} bytes per block)")
    return int(num_blocks)
