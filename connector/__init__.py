"""The connector: chunk hashing, masked store/retrieve, tiers, and the role-split
engine hooks (DESIGN §5). ``engine`` builds its two connector objects with
:func:`create_kv_connector`."""

from __future__ import annotations

import weakref

import torch

from connector.base import KVConnectorScheduler, KVConnectorWorker
from connector.cache_engine import CacheEngine
from connector.config import OffloadConfig
from connector.scheduler_side import OffloadScheduler
from connector.tiers import TierManager
from connector.token_db import TokenDatabase, namespace_fingerprint
from connector.tracker import TransferTracker
from connector.worker_side import OffloadWorker

__all__ = ["CacheEngine", "OffloadConfig", "create_cache_engine", "create_kv_connector"]


def create_cache_engine(
    config: OffloadConfig,
    *,
    model_id: str,
    dtype: torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> CacheEngine:
    """A :class:`CacheEngine` over the tiers ``config`` names, for KV of this shape.
    Its tiers are closed (queued writes finished) when it is garbage-collected or at exit."""
    if not isinstance(config, OffloadConfig):
        raise ValueError(f"config must be an OffloadConfig, got {type(config).__name__}")
    namespace = namespace_fingerprint(
        model_id=model_id,
        dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        chunk_size=config.chunk_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    token_db = TokenDatabase(
        namespace, config.chunk_size, config.save_partial_chunks, key_prefix=config.key_prefix
    )
    chunk_shape = (num_layers, 2, config.chunk_size, num_kv_heads, head_dim)
    pin_memory = torch.device(device).type == "cuda"
    tiers = TierManager.from_config(config, chunk_shape, dtype, pin_memory=pin_memory)
    engine = CacheEngine(
        token_db, tiers, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    weakref.finalize(engine, tiers.close)
    return engine


def create_kv_connector(
    config: OffloadConfig,
    *,
    model_id: str,
    dtype: torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """The scheduler-side and worker-side connector of one engine, sharing one cache engine."""
    cache_engine = create_cache_engine(
        config,
        model_id=model_id,
        dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=device,
    )
    tracker = TransferTracker()
    scheduler = OffloadScheduler(cache_engine, tracker, block_size=block_size)
    worker = OffloadWorker(cache_engine, tracker, layerwise=config.layerwise)
    return scheduler, worker
