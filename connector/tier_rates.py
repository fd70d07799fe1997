"""What each tier delivered to this engine, per number of reads in flight (docs/architecture.md,
Connector: the planner's rates).

A lower tier's throughput depends on how many reads run at once: one read of a 32 MiB
chunk from the cache server is latency-bound, eight in flight fill the bulk channel
(16.6 GB/s on an H100 host where one read gets a few GB/s). So an observation carries
its number of connections (the reads of that tier in flight for it), and the rate of a
planned fetch is read at the connections it will use:

- from the tier's newest measurement, scaled linearly from the count it was taken at (a
  tier that slowed down or recovered shows it in the next measurement, whatever its
  count: a one-chunk background read, or a fetch that its deadline cut), but from fewer
  connections no higher than the best ever measured with that many or more (a disk is
  bandwidth-bound: eight reads in flight get what one gets);
- from that count's own moving average when it is the newest.

Before any measurement a tier's rate is its prior (``TIER_PRIOR_BYTES_PER_S``); the
connector measures each remote tier when it opens it (``connector.tier_probe``), so a
prior lives only for the first moments. Thread-safe: the scheduler side reads, the
worker side's fetch reports and the opening probe write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: bytes per second assumed for a tier before its first measured read
TIER_PRIOR_BYTES_PER_S = {"cpu": 10e9, "disk": 0.5e9, "redis": 0.1e9, "grpc": 0.2e9}
#: the same for a tier of another name
DEFAULT_PRIOR_BYTES_PER_S = 0.1e9
#: weight of a new sample in a moving average
RATE_ALPHA = 0.3
#: the connection count of a rate that holds whatever the reads in flight
ANY_CONNECTIONS = 0


@dataclass
class MovingRate:
    """Exponential moving average of a rate; ``updated_at`` is when its latest sample came
    (the clock's seconds; -inf before the first)."""

    value: float
    alpha: float = RATE_ALPHA
    #: the fastest sample so far
    best: float = 0.0
    num_samples: int = 0
    updated_at: float = float("-inf")

    def observe(self, amount: float, seconds: float, now: float, replace: bool = False) -> None:
        if seconds <= 0 or amount <= 0:
            return
        sample = amount / seconds
        if replace or self.num_samples == 0:
            self.value = sample
        else:
            self.value = (1 - self.alpha) * self.value + self.alpha * sample
        self.best = max(self.best, sample)
        self.num_samples += 1
        self.updated_at = now


class TierRates:
    """Per tier name, per connection count: the rate its reads delivered."""

    def __init__(
        self,
        priors: dict[str, float] | None = None,
        *,
        alpha: float = RATE_ALPHA,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.priors = {**TIER_PRIOR_BYTES_PER_S, **(priors or {})}
        self.alpha = alpha
        self._clock = clock
        self._lock = threading.Lock()
        self._tier_to_connections_to_rate: dict[str, dict[int, MovingRate]] = {}

    def observe(
        self,
        tier_name: str,
        num_bytes: int,
        seconds: float,
        connections: int | None = None,
        *,
        replace: bool = False,
    ) -> bool:
        """Reads of ``num_bytes`` bytes, ``connections`` at a time, took ``seconds`` (None: a
        rate that holds whatever the reads in flight, e.g. the CPU tier's loads). ``replace``:
        the sample is what the tier delivers now (a background measurement, or a fetch that
        its deadline cut), not one more sample to average in. Returns whether it counted
        (empty or instant samples do not)."""
        if num_bytes <= 0 or seconds <= 0:
            return False
        connections = ANY_CONNECTIONS if connections is None else max(1, int(connections))
        with self._lock:
            buckets = self._tier_to_connections_to_rate.setdefault(tier_name, {})
            rate = buckets.get(connections)
            if rate is None:
                rate = buckets[connections] = MovingRate(0.0, self.alpha)
            rate.observe(num_bytes, seconds, self._clock(), replace)
        return True

    def rate(self, tier_name: str, connections: int = 1) -> float:
        """Bytes per second a fetch of ``connections`` reads in flight is expected to get: the
        newest measurement of the tier, scaled by ``connections`` over the count it was taken
        at (each connection brings as much as those measured did); the count's own moving
        average when that is the newest."""
        connections = max(1, int(connections))
        with self._lock:
            buckets = self._tier_to_connections_to_rate.get(tier_name)
            if not buckets:
                return self._prior(tier_name)
            own = buckets.get(connections)
            count, newest = max(buckets.items(), key=lambda item: item[1].updated_at)
            if own is not None and own.updated_at >= newest.updated_at:
                return own.value
            if count == ANY_CONNECTIONS or count >= connections:
                return newest.value * min(1.0, connections / max(count, 1))
            # from fewer connections: linear, but no more than was ever measured with as
            # many or more (a disk is bandwidth-bound: eight reads get what one gets)
            scaled = newest.value * connections / count
            ceiling = [rate.best for other, rate in buckets.items() if other >= connections]
            return min(scaled, max(ceiling)) if ceiling else scaled

    def best_rate(self, tier_name: str, connections: int = 1) -> float:
        """The fastest the tier ever delivered with ``connections`` or more reads in flight
        (the fastest with any count when none was measured so), or its prior when that is
        more (a tier measured only while it was slow)."""
        connections = max(1, int(connections))
        with self._lock:
            buckets = self._tier_to_connections_to_rate.get(tier_name)
            if not buckets:
                return self._prior(tier_name)
            as_many = [rate.best for count, rate in buckets.items() if count >= connections]
            best = max(as_many) if as_many else max(rate.best for rate in buckets.values())
            return max(best, self.priors.get(tier_name, 0.0))

    def _prior(self, tier_name: str) -> float:
        """The rate assumed before any measurement of the tier."""
        return self.priors.get(tier_name, DEFAULT_PRIOR_BYTES_PER_S)

    def measured_at(self, tier_name: str) -> float:
        """When the tier was last measured (the clock's seconds; -inf: never)."""
        with self._lock:
            buckets = self._tier_to_connections_to_rate.get(tier_name, {})
            return max((rate.updated_at for rate in buckets.values()), default=float("-inf"))

    def snapshot(self) -> dict[tuple[str, int], float]:
        """(tier, connections) -> the moving average measured there (``/metrics``; 0
        connections: a rate that holds whatever the reads in flight)."""
        with self._lock:
            return {
                (tier, count): rate.value
                for tier, buckets in self._tier_to_connections_to_rate.items()
                for count, rate in buckets.items()
            }
