"""What loading a token from each tier costs on each replica, measured by that replica.

`choice` ranks replicas in prompt tokens' worth of compute: recomputing a token costs 1,
loading it from a tier costs that tier's ratio. A replica knows both sides of that ratio
from its own work and shows them in its ``/metrics``: the planner's prefill rate of a
whole prompt (``kvstash_planner_prefill_tokens_per_second{prompt_tokens}``), the rate each
tier delivered to it (``kvstash_planner_tier_read_bytes_per_second{tier,connections}``) and
the KV bytes of one token (``kvstash_kv_bytes_per_token``). The router reads them every
``interval_s`` (:class:`CostPoller`) and turns them into ratios (:func:`costs_from_metrics`):

    cost(tier, n) = min(1, prefill_tokens_per_s(n) * kv_bytes_per_token / tier_bytes_per_s)

A ratio above 1 is cut to 1: the replica's planner recomputes rather than load from a tier
slower than computing. A tier the replica has not measured (nor shown a prior for), or a
replica whose ``/metrics`` did not answer, keeps :data:`DEFAULT_TIER_COST`; so does the
GPU prefix cache (0: it is in the paged cache already). The shared tier's cost is its
fastest remote medium's (Redis or the cache server: every replica reads the same one).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import httpx
from prometheus_client.parser import text_string_to_metric_families

from connector.config import REMOTE_TIER_NAMES
from engine.server.upstream.pool import Engine

log = logging.getLogger("kvstash.router")

#: a token's cost when loaded from each tier where no measurement says otherwise
#: (recomputing it costs 1): a CPU-tier load is an order of magnitude cheaper than
#: recomputing, a disk or shared-tier load a few times cheaper
DEFAULT_TIER_COST: Mapping[str, float] = MappingProxyType(
    {"gpu": 0.0, "cpu": 0.1, "disk": 0.3, "shared": 0.5}
)
#: seconds between two reads of a replica's ``/metrics``
DEFAULT_INTERVAL_S = 5.0
#: seconds a read of ``/metrics`` may take before it counts as unanswered
SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ReplicaCosts:
    """One replica's measured figures: prefill tokens/s by prompt length (ascending), and
    the bytes/s each router tier (``cpu``, ``disk``, ``shared``) delivered."""

    kv_bytes_per_token: int
    prefill_rates: tuple[tuple[int, float], ...]
    tier_to_bytes_per_s: Mapping[str, float] = field(default_factory=dict)

    def prefill_tokens_per_s(self, num_prompt_tokens: int) -> float:
        """The planner's rate for the shortest listed prompt at least this long (the
        longest one's for longer prompts)."""
        lengths = [length for length, _ in self.prefill_rates]
        index = min(bisect.bisect_left(lengths, num_prompt_tokens), len(lengths) - 1)
        return self.prefill_rates[index][1]

    def tier_cost(self, num_prompt_tokens: int) -> dict[str, float]:
        """Each router tier's cost per loaded token for a prompt of this length."""
        costs = dict(DEFAULT_TIER_COST)
        rate = self.prefill_tokens_per_s(num_prompt_tokens)
        for tier, bytes_per_s in self.tier_to_bytes_per_s.items():
            costs[tier] = min(1.0, rate * self.kv_bytes_per_token / bytes_per_s)
        return costs


def costs_from_metrics(text: str) -> ReplicaCosts | None:
    """A replica's costs from its ``/metrics`` text; None when it shows no planner (offload
    off) or no KV size (an engine older than this router)."""
    kv_bytes_per_token = 0
    prefill_rates: list[tuple[int, float]] = []
    tier_to_bytes_per_s: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstash_kv_bytes_per_token":
                kv_bytes_per_token = int(sample.value)
            elif sample.name == "kvstash_planner_prefill_tokens_per_second" and sample.value > 0:
                prefill_rates.append((int(sample.labels["prompt_tokens"]), sample.value))
            elif sample.name == "kvstash_planner_tier_read_bytes_per_second" and sample.value > 0:
                medium = sample.labels["tier"]
                tier = "shared" if medium in REMOTE_TIER_NAMES else medium
                if tier in DEFAULT_TIER_COST and tier != "gpu":
                    # a fetch runs at the connections it is given: count the best
                    tier_to_bytes_per_s[tier] = max(tier_to_bytes_per_s.get(tier, 0.0), sample.value)
    if kv_bytes_per_token <= 0 or not prefill_rates:
        return None
    return ReplicaCosts(kv_bytes_per_token, tuple(sorted(prefill_rates)), tier_to_bytes_per_s)


class CostPoller:
    """Reads every replica's ``/metrics`` each ``interval_s`` on the router's event loop.
    ``costs(engine)`` is the last answer's figures (None before the first, after an
    unanswered read, or when the replica shows none: `choice` then uses the defaults)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        client: httpx.AsyncClient,
        headers: Mapping[str, str],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"the cost poll interval must be positive, got {interval_s}")
        self.engines = list(engines)
        self.client = client
        self.headers = dict(headers)
        self.interval_s = interval_s
        self._engine_id_to_costs: dict[int, ReplicaCosts | None] = {}

    def costs(self, engine: Engine) -> ReplicaCosts | None:
        return self._engine_id_to_costs.get(id(engine))

    async def poll_once(self) -> None:
        """One read of every replica, concurrently."""
        await asyncio.gather(*(self._read(engine) for engine in self.engines))

    async def run(self) -> None:
        """Poll until cancelled (the router's lifespan)."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def _read(self, engine: Engine) -> None:
        try:
            answer = await self.client.get(
                f"{engine.url}/metrics", headers=self.headers, timeout=SCRAPE_TIMEOUT_S
            )
            answer.raise_for_status()
            costs = costs_from_metrics(answer.text)
        except (httpx.HTTPError, ValueError) as exc:
            if self._engine_id_to_costs.get(id(engine)) is not None:
                log.info(
                    "replica %s: no costs from /metrics (%s); default costs until it answers", engine.url, exc
                )
            costs = None
        self._engine_id_to_costs[id(engine)] = costs
