"""Gauges of the engines behind a proxy or router, read at scrape time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from collections.abc import Iterator

    from engine.server.upstream.pool import EnginePool


class PoolCollector(Collector):
    """``{prefix}_engine_in_flight{role,url}`` (requests in flight per engine) and
    ``{prefix}_engine_up{role,url}`` (1 while it is in, 0 while it is out)."""

    def __init__(self, prefix: str, pools: list[EnginePool]) -> None:
        self.prefix = prefix
        self.pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            f"{self.prefix}_engine_in_flight", "Requests in flight per engine.", labels=["role", "url"]
        )
        up = GaugeMetricFamily(
            f"{self.prefix}_engine_up", "1 while an engine is in, 0 while it is out.", labels=["role", "url"]
        )
        for pool in self.pools:
            for engine in pool.engines:
                in_flight.add_metric([pool.role, engine.url], engine.num_in_flight)
                up.add_metric([pool.role, engine.url], 1.0 if pool.is_up(engine) else 0.0)
        yield in_flight
        yield up
