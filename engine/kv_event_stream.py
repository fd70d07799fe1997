"""The engine's KV event stream (docs/architecture.md, KV events): started by
``EngineCore`` when ``kv_events_endpoint`` is set, once, after its block manager and
connector exist."""

from __future__ import annotations

import functools
import logging
import os
import socket

from engine.block_manager import BlockManager
from engine.config import EngineArgs
from kv_events.messages import GPU
from kv_events.publisher import KVEventPublisher

logger = logging.getLogger(__name__)


def start_kv_events(args: EngineArgs, block_manager: BlockManager, worker_connector) -> KVEventPublisher:
    """Bind the endpoints and connect what holds KV to the publisher: the GPU prefix
    cache (block hashes) and the connector's tiers (chunk keys; with pipeline stages the
    first stage's speak for the engine). The caller closes it at shutdown."""
    publisher = KVEventPublisher(
        args.kv_events_endpoint,
        args.kv_events_replay_endpoint,
        engine_id=args.engine_id or f"{socket.gethostname()}-{os.getpid()}",
        block_size=args.block_size,
        chunk_size=args.kv_offload.chunk_size if args.kv_offload is not None else 0,
    )
    block_manager.on_change = functools.partial(_record_medium, publisher.record, GPU)
    if worker_connector is not None:
        worker_connector.attach_kv_events(publisher.record)
    logger.info("KV events on %s (replays on %s)", publisher.endpoint, publisher.replay_endpoint)
    return publisher


def _record_medium(record, medium: str, kind: str, keys: list[str]) -> None:
    record(kind, medium, keys)
