"""Prometheus metrics of one proxy, in a registry of its own (`GET /metrics`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest

from engine.server.upstream.metrics import PoolCollector

if TYPE_CHECKING:
    from engine.server.upstream.pool import EnginePool


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
        registry.register(PoolCollector("kvstash_proxy", pools))

    def render(self) -> bytes:
        return generate_latest(self.registry)
