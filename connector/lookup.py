"""Lookups that never block a step: where each chunk of a prompt is, by tier.

The CPU tier answers at once (an in-memory index). The lower tiers are asked on
a small thread pool; the step thread waits for the answer at most ``wait_s`` per
call and otherwise returns "not known yet" (the scheduler skips the request for
that step and asks again, without a new query). A lookup still unanswered after
``timeout_s`` ends with what it found so far and opens the breaker of the tier
it was waiting on; a tier whose breaker is open is not asked at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from connector.breaker import CircuitBreaker
from storage_backends.thread_pools import started_thread_pool

if TYPE_CHECKING:
    from connector.tiers import TierManager


class PendingLookup:
    """One request's lookup in flight: the tier names found so far, chunk by chunk."""

    def __init__(self, keys: Sequence[str], chunk_tiers: list[str], started: float) -> None:
        self.keys = list(keys)
        #: tier name of each leading chunk found so far (grows while the walk runs)
        self.chunk_tiers = chunk_tiers
        self.started = started
        self.current_tier: str | None = None  # the tier being asked now (blamed on a timeout)
        self.future: Future | None = None
        self.final: list[str] | None = None  # the answer, once known


class TierLookups:
    """One per connector; used by the scheduler side (no tensors)."""

    def __init__(
        self,
        tiers: TierManager,
        name_to_breaker: dict[str, CircuitBreaker],
        *,
        wait_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tiers = tiers
        self.name_to_breaker = name_to_breaker
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.num_timeouts = 0

    def start(self, keys: Sequence[str]) -> PendingLookup:
        """Find the CPU tier's leading chunks now; ask the lower tiers for the rest in
        the background (not at all when the CPU tier holds every key)."""
        cpu = self.tiers.cpu
        num_cpu = cpu.contains(keys) if cpu is not None else 0
        pending = PendingLookup(keys, ["cpu"] * num_cpu, self._clock())
        if num_cpu == len(keys) or not self.tiers.lower:
            pending.final = list(pending.chunk_tiers)
            return pending
        with self._lock:
            if self._pool is None:
                self._pool = started_thread_pool(4, "kvstash-lookup")
            pending.future = self._pool.submit(self._walk, pending)
        return pending

    def result(self, pending: PendingLookup) -> list[str] | None:
        """The tier name of each chunk of the hit prefix, or None while the lower tiers
        have not answered (waits at most ``wait_s``). After ``timeout_s`` the answer is
        what was found so far, and the tier still being asked is skipped from then on."""
        if pending.final is not None:
            return pending.final
        try:
            pending.future.result(timeout=self.wait_s)
        except TimeoutError:
            if self._clock() - pending.started < self.timeout_s:
                return None
            self.num_timeouts += 1
            tier_name = pending.current_tier
            if tier_name is not None and tier_name in self.name_to_breaker:
                self.name_to_breaker[tier_name].failed(f"lookup unanswered after {self.timeout_s:.3f} s")
            pending.final = list(pending.chunk_tiers)
            return pending.final
        pending.final = list(pending.chunk_tiers)
        return pending.final

    def _walk(self, pending: PendingLookup) -> None:
        """A pool thread: the leading keys present in some tier, each from the first tier
        holding it (keys may alternate between tiers)."""
        keys = pending.keys
        num_found = len(pending.chunk_tiers)
        progressed = True
        while progressed and num_found < len(keys):
            progressed = False
            for tier in self.tiers.tiers:
                breaker = self.name_to_breaker.get(tier.name)
                if breaker is not None and not breaker.allow():
                    continue
                pending.current_tier = tier.name
                try:
                    num_more = tier.contains(keys[num_found:])
                except Exception as exc:
                    self.tiers.health[id(tier)].failed("contains", exc)
                    if breaker is not None:
                        breaker.failed(f"contains failed: {type(exc).__name__}: {exc}")
                    continue
                finally:
                    pending.current_tier = None
                self.tiers.health[id(tier)].succeeded("contains")
                if breaker is not None:
                    breaker.succeeded()
                if pending.final is not None:
                    return  # timed out meanwhile: the answer was given
                if num_more:
                    pending.chunk_tiers.extend([tier.name] * num_more)
                    num_found += num_more
                    progressed = True
                    if num_found == len(keys):
                        break

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
