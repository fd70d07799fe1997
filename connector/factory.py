"""Build an engine's connector objects from an :class:`~connector.config.OffloadConfig`:
the cache engine over its tiers, and the scheduler-side and worker-side connector over it
(a pipeline stage after the first: the worker side alone). Called once per engine (per
pipeline stage) at start-up by ``engine``."""

from __future__ import annotations

import weakref

import torch

from connector.base import KVConnectorScheduler, KVConnectorWorker
from connector.breaker import CircuitBreaker
from connector.cache_engine import CacheEngine
from connector.config import REMOTE_TIER_NAMES, OffloadConfig, reads_in_flight_for
from connector.direct_export import DirectExporter
from connector.direct_peer import DirectPeerTier
from connector.fetcher import ChunkFetcher
from connector.handoff import HandoffScheduler
from connector.lookup import TierLookups
from connector.nixl_import import wants_direct
from connector.planner import LoadPlanner, StepTimes
from connector.request_transfer import TransferRegistry
from connector.tier_probe import PROBE_KEY_SUFFIX, PROBED_TIER_NAMES, TierProber
from connector.tiers import TierManager
from connector.token_db import TokenDatabase, namespace_fingerprint
from connector.worker_side import OffloadWorker


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
    layer_range: tuple[int, int, int] | None = None,
    grow_cpu_tier: bool = False,
) -> CacheEngine:
    """A :class:`CacheEngine` over the tiers ``config`` names, for KV of this shape.
    Its tiers are closed (queued writes finished) when it is garbage-collected or at exit.
    ``layer_range``: a pipeline stage's ``(first_layer, end_layer, num_model_layers)``
    (part of the namespace; ``num_layers`` is then the stage's). ``grow_cpu_tier``: the
    CPU tier's slab grows in the background once the worker's
    ``start_background_allocation`` is called (the engine does when it is ready)."""
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
        layer_range=layer_range,
    )
    token_db = TokenDatabase(
        namespace, config.chunk_size, config.save_partial_chunks, key_prefix=config.key_prefix
    )
    chunk_shape = (num_layers, 2, config.chunk_size, num_kv_heads, head_dim)
    pin_memory = torch.device(device).type == "cuda"
    tiers = TierManager.from_config(
        config, chunk_shape, dtype, pin_memory=pin_memory, grow_cpu_tier=grow_cpu_tier
    )
    engine = CacheEngine(
        token_db, tiers, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    engine.cpu_async_moves = config.cpu_async_moves
    engine.direct_host_loads = config.direct_host_loads
    weakref.finalize(engine, tiers.close)
    if config.kv_role == "consumer" and wants_direct(
        config.kv_transfer, cpu_bytes=config.cpu_bytes, split=layer_range is not None or tp_size > 1
    ):
        # read first of the lower tiers: what a producer offers beats the shared tier
        tiers.add_lower(
            DirectPeerTier(tiers.cpu, fetch_deadline_s=config.handoff_fetch_deadline_s),
            before=REMOTE_TIER_NAMES,
        )
    return engine


def _breakers_for(tiers: TierManager, config: OffloadConfig) -> dict[str, CircuitBreaker]:
    """One circuit breaker per lower tier (the tiers' own reads and writes use them too)."""
    name_to_breaker = {
        tier.name: CircuitBreaker(tier.name, backoff_s=config.breaker_backoff_s) for tier in tiers.lower
    }
    tiers.breakers = name_to_breaker
    return name_to_breaker


def tier_reads_in_flight(tiers: TierManager, config: OffloadConfig) -> dict[str, int]:
    """Lower tier name -> the reads of it a fetch keeps in flight: ``reads_in_flight`` (disk) or
    ``remote_reads_in_flight``, at most what the tier runs at once (its
    ``max_reads_in_flight``). The fetcher's threads, the planner's rates and the prober's
    measurements all use this count."""
    return {
        tier.name: reads_in_flight_for(
            tier.name,
            local=config.reads_in_flight,
            remote=config.remote_reads_in_flight,
            limit=getattr(tier, "max_reads_in_flight", None),
        )
        for tier in tiers.lower
    }


def _fetches(config: OffloadConfig, tiers: TierManager) -> bool:
    """Whether lower-tier chunks are fetched into the CPU tier in the background (else a
    step reads them: no CPU tier, or synchronous loads)."""
    return bool(config.async_loads and tiers.cpu is not None and tiers.lower)


def _worker_over(
    cache_engine: CacheEngine,
    config: OffloadConfig,
    name_to_breaker: dict[str, CircuitBreaker] | None,
    dtype: torch.dtype,
    *,
    alone: bool,
) -> OffloadWorker:
    """The worker side over ``cache_engine``'s tiers, with a fetcher when fetches run;
    ``alone``: no scheduler side grants its CPU tier's slots (its cache engine does)."""
    tiers = cache_engine.tiers
    fetcher = None
    if name_to_breaker is not None:
        fetcher = ChunkFetcher(
            tiers.cpu.view,  # the slab's memory only: the scheduler side grants the slots
            {tier.name: tier for tier in tiers.lower},
            name_to_breaker,
            tier_to_reads_in_flight=tier_reads_in_flight(tiers, config),
            dtype=dtype,
            layout=tiers.cpu.layout,
        )
        weakref.finalize(cache_engine, fetcher.close)
    return OffloadWorker(
        cache_engine,
        layerwise=config.layerwise,
        fetcher=fetcher,
        pipelined_loads=config.pipelined_loads,
        grants_own_slots=alone,
    )


def create_worker_connector(
    config: OffloadConfig,
    *,
    model_id: str,
    dtype: torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    layer_range: tuple[int, int, int] | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    grow_cpu_tier: bool = False,
    alone: bool = True,
) -> KVConnectorWorker:
    """The worker side alone, over tiers of its own: a pipeline stage after the first or
    a tensor-parallel rank after the first, whose scheduler side is the engine process's.
    It runs from the metadata alone: no lookups, planner or prober of its own (one per
    engine is enough); its CPU tier's index is its own, so its cache engine grants the
    saves' slots there (the metadata's slot ids are the first stage's). ``alone=False``:
    the worker side of :func:`create_kv_connector`, whose scheduler side grants them."""
    cache_engine = create_cache_engine(
        config,
        model_id=model_id,
        dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=device,
        tp_rank=tp_rank,
        tp_size=tp_size,
        layer_range=layer_range,
        grow_cpu_tier=grow_cpu_tier,
    )
    tiers = cache_engine.tiers
    name_to_breaker = _breakers_for(tiers, config) if _fetches(config, tiers) else None
    return _worker_over(cache_engine, config, name_to_breaker, dtype, alone=alone)


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
    step_times: StepTimes,
    layer_range: tuple[int, int, int] | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    grow_cpu_tier: bool = False,
) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """The scheduler-side and worker-side connector of one engine (the first pipeline
    stage), over one cache engine: the scheduler side reads and pins the CPU tier's
    index only (``SlotIndex``), the lookups read the lower tiers; everything else goes
    between them as plain data (the metadata and the worker's reports).
    ``step_times`` is the engine's step-time model (its planner reads it: :class:`StepTimes`). A
    pipeline stage passes its ``layer_range``, a tensor-parallel rank its ``tp_rank`` and
    ``tp_size`` and its own ``num_kv_heads``, and ``grow_cpu_tier`` (see
    :func:`create_cache_engine`)."""
    # the worker side over the engine's tiers (its fetcher included), as a later stage builds it
    worker = create_worker_connector(
        config,
        model_id=model_id,
        dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=device,
        layer_range=layer_range,
        tp_rank=tp_rank,
        tp_size=tp_size,
        grow_cpu_tier=grow_cpu_tier,
        alone=False,
    )
    cache_engine = worker.cache_engine
    tiers = cache_engine.tiers
    lookups = planner = prober = None
    if tiers.cpu is not None and (config.async_loads or not tiers.lower):
        # Every load then reads the CPU tier: the planner measures its rate from them (the
        # scheduler's prefill cap sizes loads by it, a CPU tier alone too) and plans fetches.
        planner = LoadPlanner(
            bytes_per_token=cache_engine.bytes_per_token,
            deadline_fraction=config.fetch_deadline_fraction,
            always_load=config.load_policy == "always",
            step_times=step_times,
            probe_interval_s=config.tier_probe_interval_s,
            reads_in_flight=config.reads_in_flight,
            remote_reads_in_flight=config.remote_reads_in_flight,
            tier_to_reads_in_flight=tier_reads_in_flight(tiers, config),
            max_fetch_bytes=tiers.cpu.num_slots * tiers.cpu.slot_bytes,
        )
    name_to_breaker = None
    if _fetches(config, tiers):
        name_to_breaker = tiers.breakers  # the fetcher's: a tier failing there is skipped here too
        lookups = TierLookups(
            tiers, name_to_breaker, wait_s=config.lookup_wait_s, timeout_s=config.lookup_timeout_s
        )
        weakref.finalize(cache_engine, lookups.close)
        remotes = {tier.name: tier for tier in tiers.lower if tier.name in PROBED_TIER_NAMES}
        if (
            planner is not None
            and remotes
            and config.tier_probe_interval_s > 0
            and config.load_policy != "always"
        ):
            token_db = cache_engine.token_db
            prober = TierProber(
                planner,
                remotes,
                key=f"{token_db.key_prefix}{token_db.namespace}:{PROBE_KEY_SUFFIX}",
                chunk_shape=(num_layers, 2, config.chunk_size, num_kv_heads, head_dim),
                dtype=dtype,
                layout=tiers.cpu.layout,
                # it measures the remotes (one at most) as many at once as their fetches read
                connections=max(tier_reads_in_flight(tiers, config)[name] for name in remotes),
                interval_s=config.tier_probe_interval_s,
                name_to_breaker=name_to_breaker,
            )
            planner.background_probed_tiers = frozenset(remotes)  # plans measure the others again
            prober.start()
            weakref.finalize(cache_engine, prober.close)
            tiers.on_close(prober.close)  # it writes and reads the tiers: it stops first
    exporter = None
    if config.kv_role == "producer" and wants_direct(
        config.kv_transfer, cpu_bytes=config.cpu_bytes, split=layer_range is not None or tp_size > 1
    ):
        exporter = DirectExporter(tiers.cpu, hold_s=config.direct_hold_s)
        tiers.on_close(exporter.close)  # its pins are the CPU tier's: it ends first
    scheduler = HandoffScheduler(
        cache_engine.scheduler_index(),
        TransferRegistry(),
        block_size=block_size,
        lookups=lookups,
        planner=planner,
        fetches=name_to_breaker is not None,
        pipelined_loads=config.pipelined_loads,
        prober=prober,
        handoff=config,
        exporter=exporter,
        # a consumer's nixl tier, and the remote tier a producer's durable hand-over waits for
        peer=next((tier for tier in tiers.lower if isinstance(tier, DirectPeerTier)), None),
        shared_tier=next((tier for tier in reversed(tiers.lower) if tier.name in REMOTE_TIER_NAMES), None),
        num_pending_writes=tiers.num_pending_writes,
    )
    if prober is not None:
        prober.busy = scheduler.is_fetching_from  # a tier fetches read is measured by them
    return scheduler, worker
