"""Prometheus metrics of one proxy, in a registry of its own (`GET /metrics`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from collections.abc import Iterator

    from engine.server.proxy.pool import EnginePool


class ProxyMetrics:
    def __init__(self, pools: list[EnginePool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "kvstash_proxy_requests",
            "Client requests by route and the HTTP status answered.",
            ["route", "status"],
            registry=registry,
        )
        self.engine_failures = Counter(
            "kvstash_proxy_engine_failures",
            "Engines that did not answer a request (refused, reset, timed out, or 503): taken out for a while.",
            ["role", "url"],
            registry=registry,
        )
        self.prefill_skipped = Counter(
            "kvstash_proxy_prefill_skipped",
            "Requests no producer prefilled (none answered): the consumer computed the whole prompt.",
            registry=registry,
        )
        self.handed_over_tokens = Counter(
            "kvstash_proxy_handed_over_tokens",
            "Prompt tokens producers made durable and handed to consumers (kv_transfer_params).",
            registry=registry,
        )
        registry.register(_PoolCollector(pools))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    """Each engine's requests in flight and whether it is in, read at scrape time."""

    def __init__(self, pools: list[EnginePool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "kvstash_proxy_engine_in_flight", "Requests in flight per engine.", labels=["role", "url"]
        )
        up = GaugeMetricFamily(
            "kvstash_proxy_engine_up", "1 while an engine is in, 0 while it is out.", labels=["role", "url"]
        )
        for pool in self.pools:
            for engine in pool.engines:
                in_flight.add_metric([pool.role, engine.url], engine.num_in_flight)
                up.add_metric([pool.role, engine.url], 1.0 if pool.is_up(engine) else 0.0)
        yield in_flight
        yield up
