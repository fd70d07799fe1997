"""Circuit breaker per lower tier: a tier that fails or times out is skipped for a
back-off period, so a dead or blackholed remote costs each request nothing.

Closed → (a failure or a timeout) → open for ``backoff_s`` → half-open: one call
goes through as a probe; its success closes the breaker, its failure opens it
again for twice the back-off (capped). An incident (first trip to close) is
logged once when it starts and once when it ends. Thread-safe: lookups and
fetches report from their worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class CircuitBreaker:
    """One per lower tier, owned by the connector's tier lookups and fetcher."""

    def __init__(
        self,
        tier_name: str,
        *,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier_name = tier_name
        self.initial_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until: float | None = None  # None: closed
        self._backoff_s = backoff_s
        self._probing = False
        #: times the breaker opened (also re-openings after a failed probe)
        self.num_trips = 0
        #: calls skipped because the breaker was open
        self.num_skipped = 0

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None

    def allow(self) -> bool:
        """Whether a call to the tier may go ahead now (counts a skip when not)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._clock() >= self._open_until and not self._probing:
                self._probing = True  # half-open: this caller is the probe
                return True
            self.num_skipped += 1
            return False

    def succeeded(self) -> None:
        with self._lock:
            if self._open_until is None:
                return
            self._open_until = None
            self._probing = False
            self._backoff_s = self.initial_backoff_s
        log.info("tier %s answers again: breaker closed", self.tier_name)

    def failed(self, what: str) -> None:
        """A call failed or timed out (``what`` says which, for the log)."""
        with self._lock:
            first = self._open_until is None
            if not first and not self._probing:
                return  # calls that were already in flight when it opened
            if not first:
                self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
            self._probing = False
            self._open_until = self._clock() + self._backoff_s
            self.num_trips += 1
            backoff_s = self._backoff_s
        if first:
            log.warning(
                "tier %s skipped for %.1f s (%s); retried with growing back-off until it answers",
                self.tier_name,
                backoff_s,
                what,
            )
