"""Prometheus metrics of one router, in a registry of its own (`GET /metrics`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.server.router.costs import DEFAULT_TIER_COST
from engine.server.upstream.metrics import PoolCollector

if TYPE_CHECKING:
    from collections.abc import Iterator

    from engine.server.router.costs import CostPoller
    from engine.server.router.index import ReplicaIndex
    from engine.server.upstream.pool import EnginePool


class RouterMetrics:
    def __init__(
        self, pool: EnginePool, indexes: list[ReplicaIndex], poller: Callable[[], CostPoller | None]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "kvstash_router_requests",
            "Client requests by route and the HTTP status answered.",
            ["route", "status"],
            registry=registry,
        )
        self.routed = Counter(
            "kvstash_router_routed_requests",
            "Requests sent to each replica (retries included), by the reason it was chosen.",
            ["url", "reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvstash_router_prompt_tokens",
            "Prompt tokens of the requests sent to each replica (as the router tokenized them).",
            ["url"],
            registry=registry,
        )
        self.matched_tokens = Counter(
            "kvstash_router_matched_tokens",
            "Prompt tokens of the requests sent to each replica that its index said it held, by tier "
            "(gpu, cpu, disk, shared).",
            ["url", "tier"],
            registry=registry,
        )
        self.engine_failures = Counter(
            "kvstash_router_engine_failures",
            "Replicas that did not answer a request (refused, reset, timed out, or 502/503/504): "
            "taken out for a while, their index dropped.",
            ["role", "url"],
            registry=registry,
        )
        registry.register(PoolCollector("kvstash_router", [pool]))
        registry.register(_IndexCollector(indexes))
        registry.register(_CostCollector(pool, poller))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _IndexCollector(Collector):
    """Each replica's index, read at scrape time: in sync or not, keys per medium."""

    def __init__(self, indexes: list[ReplicaIndex]) -> None:
        self.indexes = indexes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        synced = GaugeMetricFamily(
            "kvstash_router_index_synced",
            "1 while the router's index of a replica follows its KV events, else 0 (it counts as holding nothing).",
            labels=["url"],
        )
        keys = GaugeMetricFamily(
            "kvstash_router_index_keys",
            "Block hashes (gpu) or chunk keys (cpu, disk, redis, grpc) a replica's index holds.",
            labels=["url", "medium"],
        )
        for index in self.indexes:
            state = index.state
            synced.add_metric([index.url], 0.0 if state is None else 1.0)
            if state is not None:
                for medium, held in list(state.medium_to_keys.items()):
                    keys.add_metric([index.url, medium], len(held))
        yield synced
        yield keys


class _CostCollector(Collector):
    """Each replica's tier costs as `choice` uses them for a prompt of ``PROMPT_TOKENS``."""

    PROMPT_TOKENS = 8192

    def __init__(self, pool: EnginePool, poller: Callable[[], CostPoller | None]) -> None:
        self.pool = pool
        self.poller = poller

    def collect(self) -> Iterator[GaugeMetricFamily]:
        cost = GaugeMetricFamily(
            "kvstash_router_tier_cost",
            f"A token's cost when a replica loads it from a tier, where recomputing it costs 1, for a "
            f"{self.PROMPT_TOKENS}-token prompt; source: measured (the replica's /metrics rates) or default.",
            labels=["url", "tier", "source"],
        )
        poller = self.poller()
        for engine in self.pool.engines:
            costs = None if poller is None else poller.costs(engine)
            values = DEFAULT_TIER_COST if costs is None else costs.tier_cost(self.PROMPT_TOKENS)
            for tier, value in values.items():
                measured = costs is not None and tier in costs.tier_to_bytes_per_s
                cost.add_metric([engine.url, tier, "measured" if measured else "default"], value)
        yield cost
