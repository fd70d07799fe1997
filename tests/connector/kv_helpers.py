"""Small synthetic paged KV caches and cache engines for the connector tests."""

from __future__ import annotations

import torch

from connector import OffloadConfig, create_cache_engine, create_kv_connector

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 4
BLOCK_SIZE, NUM_BLOCKS = 4, 64
NUM_SLOTS = BLOCK_SIZE * NUM_BLOCKS
#: ``OffloadConfig.lookup_wait_s`` for tests that count steps or grants: a lower tier's lookup
#: answers in the step that asks. The default 2 ms can run out on a loaded machine; the
#: request then waits a step (as designed) and the counts shift (a CI run failed so)
ANSWERED_LOOKUP_WAIT_S = 30.0


def new_kv_cache(seed: int = 0, fill: float | None = None) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] float32, random or constant."""
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if fill is not None:
        return torch.full(shape, fill)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def random_slots(num_tokens: int, seed: int = 0) -> torch.Tensor:
    """int64 [num_tokens] distinct slots in shuffled block order."""
    return torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(seed))[:num_tokens]


def token_rows(kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """[num_layers, 2, num_tokens, num_kv_heads, head_dim]: the KV rows at the slots."""
    return kv_cache.flatten(2, 3)[:, :, slot_mapping]


def make_cache_engine(**config_fields):
    fields = {"chunk_size": 8, "cpu_bytes": 1 << 20, **config_fields}
    return create_cache_engine(
        OffloadConfig(**fields),
        model_id="test-model",
        dtype=torch.float32,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        device=torch.device("cpu"),
    )


def make_connector_pair(config: OffloadConfig, model_id: str):
    """Both connector roles over the synthetic KV shape, as the engine builds them (CPU)."""
    from engine.step_time import StepTimeModel

    return create_kv_connector(
        config,
        model_id=model_id,
        dtype=torch.float32,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
        step_times=StepTimeModel(),
    )
