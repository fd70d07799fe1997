"""The load-or-recompute planner (docs/architecture.md, Connector): per request, which chunks to load from
which tier and which tokens to recompute, from measured rates.

Recompute times come from the engine's step-time
model (:class:`engine.step_time.StepTimeModel`, fitted from its own steps), which the
planner reads through :class:`StepTimes` (the connector does not import the engine).

The plan for a prompt whose hit prefix is ``chunk_tiers`` (tier per chunk):
the leading chunks already in the CPU tier are loaded in the admitting step
(always: a host→device copy beats recomputing). After them, recomputing tokens
[0, m) needs nothing from [m, n): the head up to ``m`` is recomputed on the GPU
while chunks [j, k) (starting at m) are fetched into the CPU tier in the
background, then loaded, and the rest recomputed; j and k minimise
``max(head, fetch) + rest``. With m at the CPU run's end the request waits
unadmitted for its fetch. The fetch's deadline is the head's time plus
``deadline_fraction`` of the time recomputing the fetched tokens would take, so a
tier slower than its estimate delays the request by at most that fraction (the
chunks that arrived in time are used, the rest is recomputed).

Tier rates come from what each tier delivered to this engine, per number of reads in
flight (``connector.tier_rates``): a fetch of n chunks from a tier is planned at the rate
measured with ``min(n, reads_in_flight)`` reads in flight. Each remote tier is measured
when the connector opens it, and a tier the plans skip (a measurement says it is slower
than recomputing) is measured again in the background (``connector.tier_probe``, at most
once per ``probe_interval_s``): a tier that was slow is used again once it is fast. A tier
the prober does not measure (the local disk, whose probe would read from the page cache)
is measured again by a plan instead: once per ``probe_interval_s`` a hit on it is planned
at the best rate the tier ever delivered (or its prior, if more), and what that fetch
brings replaces the estimate
(its deadline bounds what a tier still slow costs that request).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from connector.config import reads_in_flight_for
from connector.tier_rates import TierRates

#: how long a fetch may take with ``load_policy: always`` (a hung read must still end)
ALWAYS_LOAD_DEADLINE_S = 600.0
#: a tier the plans skip is measured again (``connector.tier_probe``) at most this often
TIER_PROBE_INTERVAL_S = 5.0
#: prompt length at which "slower than recomputing" is judged for background measurements
BREAK_EVEN_PROMPT_TOKENS = 4096


class StepTimes(Protocol):
    """What the planner reads of the engine's step-time model (``engine.step_time.StepTimeModel``).
    Both may be called from any thread (the scheduler's, fetch threads)."""

    def rate(self, num_prompt_tokens: int) -> float:
        """Tokens per second of a whole prompt of this length recomputed alone."""
        ...

    def prefill_seconds(self, begin: int, end: int) -> float:
        """The predicted time to recompute prompt positions [begin, end) alone (0 when empty)."""
        ...


@dataclass
class LoadDecision:
    """What one request loads and recomputes (token counts are prompt positions)."""

    #: tokens [num_computed, num_cpu_end) are copied from the CPU tier when admitted
    num_cpu_end: int
    #: chunks [first_fetch_chunk, first_fetch_chunk + num_fetch_chunks) are fetched first
    first_fetch_chunk: int
    num_fetch_chunks: int
    #: tokens [num_head_end, num_fetch_end) arrive by the fetch
    num_fetch_end: int
    #: seconds the fetch may take before the request stops waiting for it
    fetch_deadline_s: float
    #: tokens per tier name the plan loads (CPU chunks inside the fetch count as cpu)
    tier_to_planned_tokens: dict[str, int] = field(default_factory=dict)
    num_planned_recompute_tokens: int = 0
    #: the rates used: tier name -> bytes/s, and "prefill" -> tokens/s
    rates: dict[str, float] = field(default_factory=dict)
    #: tokens [num_cpu_end, num_head_end) are recomputed while the fetch runs (the
    #: request is admitted at once); equal to ``num_cpu_end`` when it waits unadmitted
    num_head_end: int = 0
    #: lower tiers holding chunks of the hit that the plan recomputes instead of fetching
    skipped_tiers: frozenset[str] = frozenset()
    #: tiers this plan fetches from to measure them again (planned at their best rate)
    remeasured_tiers: frozenset[str] = frozenset()

    def describe(self) -> str:
        """One line for the request's log."""
        tiers = ",".join(f"{name}:{n}" for name, n in sorted(self.tier_to_planned_tokens.items()) if n)
        rates = ",".join(
            f"{name}={value / 1e9:.2f}GB/s" if name != "prefill" else f"prefill={value:.0f}tok/s"
            for name, value in sorted(self.rates.items())
        )
        return f"plan=[{tiers or 'none'}] recompute={self.num_planned_recompute_tokens} rates=[{rates}]"


class LoadPlanner:
    """One per connector; the scheduler side plans, the worker side reports rates."""

    def __init__(
        self,
        *,
        bytes_per_token: int,
        deadline_fraction: float = 0.5,
        always_load: bool = False,
        alpha: float = 0.3,
        tier_priors: dict[str, float] | None = None,
        step_times: StepTimes,
        probe_interval_s: float = TIER_PROBE_INTERVAL_S,
        reads_in_flight: int = 4,
        remote_reads_in_flight: int = 8,
        tier_to_reads_in_flight: dict[str, int] | None = None,
        max_fetch_bytes: int | None = None,
        background_probed_tiers: frozenset[str] = frozenset(),
        clock=time.monotonic,
    ) -> None:
        self.bytes_per_token = bytes_per_token
        self.deadline_fraction = deadline_fraction
        #: load every hit and wait for it (``load_policy: always``): no recompute trade-off
        self.always_load = always_load
        #: how long such a fetch may take (``forced_loading`` may shorten it)
        self._always_deadline_s = ALWAYS_LOAD_DEADLINE_S
        #: what each tier delivered, per reads in flight (its prior until measured)
        self.rates = TierRates(tier_priors, alpha=alpha, clock=clock)
        #: seconds between two background measurements of a tier the plans skip (0: never)
        self.probe_interval_s = probe_interval_s
        #: background reads in flight per local and per remote lower tier (the fetcher's):
        #: a fetch's connections (``reads_in_flight_for``)
        self.reads_in_flight = reads_in_flight
        self.remote_reads_in_flight = remote_reads_in_flight
        #: per tier name, the count its fetches truly keep in flight where it differs from the
        #: rule above (a tier with fewer connections of its own: ``tier_reads_in_flight``)
        self.tier_to_reads_in_flight = dict(tier_to_reads_in_flight or {})
        #: most bytes of lower-tier chunks one fetch brings (what the CPU tier or the staging
        #: area can hold for it; None: no bound): the tokens after them are recomputed
        self.max_fetch_bytes = max_fetch_bytes
        #: tiers a ``TierProber`` measures in the background; the others are measured again
        #: by a plan's fetch (``remeasured_tiers``). Set by the factory once it made the prober.
        self.background_probed_tiers = background_probed_tiers
        self._clock = clock
        #: tier name -> when a plan acted on last skipped it (it recomputed that tier's chunks)
        self._tier_to_skipped_at: dict[str, float] = {}
        self._tier_to_next_probe_at: dict[str, float] = {}
        #: tiers a recorded plan fetches from to measure them again: their next reported
        #: read replaces their estimate
        self._remeasured_tiers: set[str] = set()
        #: the engine's step-time model (shared with its scheduler's prefill cap)
        self.step_times = step_times
        self._lock = threading.Lock()
        #: decisions so far, for /metrics (kvstash_planner_*)
        self.counts = {
            "requests": 0,
            "fetched_tokens": 0,
            "recomputed_tokens": 0,
            "cpu_tokens": 0,
            "probes": 0,
        }

    @property
    def alpha(self) -> float:
        """Weight of a new sample in the rates' moving averages (tiers measured from now on)."""
        return self.rates.alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self.rates.alpha = value

    @property
    def tier_priors(self) -> dict[str, float]:
        """Bytes/s per tier name until its first measurement (mutable: tests set priors)."""
        return self.rates.priors

    @contextlib.contextmanager
    def forced_loading(self, deadline_s: float = ALWAYS_LOAD_DEADLINE_S) -> Iterator[None]:
        """Within the block, plan like ``load_policy: always`` (load every hit, wait for
        it), a fetch waiting at most ``deadline_s``. For warm-ups that must take a tier's
        load path whatever the rates say, and for a consumer's hand-over from a producer
        (``connector.handoff``); planning is on the step thread, one request at a time."""
        previous = self.always_load, self._always_deadline_s
        self.always_load, self._always_deadline_s = True, deadline_s
        try:
            yield
        finally:
            self.always_load, self._always_deadline_s = previous

    # ---- measurements ------------------------------------------------------------
    def observe_read(
        self,
        tier_name: str,
        num_bytes: int,
        seconds: float,
        connections: int | None = None,
        *,
        replace: bool = False,
    ) -> None:
        """Reads of ``tier_name`` delivered ``num_bytes`` in ``seconds``, ``connections`` at a
        time (None: a rate that holds whatever the reads in flight: the CPU tier's loads);
        ``replace``: what the tier delivers now (see ``TierRates.observe``; always so for
        the fetch a plan made to measure the tier again)."""
        with self._lock:
            if tier_name in self._remeasured_tiers and num_bytes > 0 and seconds > 0:
                self._remeasured_tiers.discard(tier_name)
                replace = True
        self.rates.observe(tier_name, num_bytes, seconds, connections, replace=replace)

    def tier_rate(self, tier_name: str, connections: int = 1) -> float:
        return self.rates.rate(tier_name, connections)

    def snapshot(self) -> dict[str, float]:
        """Current rates: ``tier:<name>`` bytes/s with one read in flight (``cpu``: any),
        ``tier:<name>@<n>`` measured with n in flight, and ``prefill:<n>`` tokens/s of a whole
        prompt of n tokens recomputed alone (n = 1,024 ... 32,768), from the step-time model."""
        measured = self.rates.snapshot()
        rates = {f"tier:{name}": self.rates.rate(name) for name in {name for name, _ in measured}}
        for (name, connections), value in measured.items():
            if connections:
                rates[f"tier:{name}@{connections}"] = value
        for exponent in range(10, 16):
            rates[f"prefill:{1 << exponent}"] = self.step_times.rate(1 << exponent)
        return rates

    def tiers_to_probe(self, tier_names) -> list[str]:
        """Of ``tier_names``, those to measure again now: the latest measurement is
        ``probe_interval_s`` old, the tier was not probed within that time, and since then
        a plan acted on skipped it or it measured slower than recomputing (so plans would
        skip it: it is used again once it is fast). Claiming starts the interval (the caller
        probes). Never with ``load_policy: always`` or a zero interval."""
        now = self._clock()
        claimed = []
        with self._lock:
            for tier in tier_names:
                if self._due_for_measuring(tier, now):
                    self._claim_measuring(tier, now)
                    claimed.append(tier)
        return claimed

    def _due_for_measuring(self, tier: str, now: float) -> bool:
        """Whether ``tier`` should be measured again now (see :meth:`tiers_to_probe`)."""
        if self.probe_interval_s <= 0 or self.always_load:
            return False
        measured_at = self.rates.measured_at(tier)
        if now - measured_at < self.probe_interval_s:
            return False
        if now < self._tier_to_next_probe_at.get(tier, -math.inf):
            return False
        if self._tier_to_skipped_at.get(tier, -math.inf) >= measured_at:
            return True
        # a tier is "slow" when loading a token takes longer than recomputing it in a mid-sized prompt
        break_even = self.bytes_per_token * self.step_times.rate(BREAK_EVEN_PROMPT_TOKENS)
        return self.rates.rate(tier, self.reads_in_flight_for(tier)) < break_even

    def _claim_measuring(self, tier: str, now: float) -> None:
        """Under the lock: the interval to ``tier``'s next measurement starts now."""
        self._tier_to_next_probe_at[tier] = now + self.probe_interval_s
        self.counts["probes"] += 1

    def reads_in_flight_for(self, tier_name: str) -> int:
        """How many reads of ``tier_name`` a fetch has in flight (remote tiers: more; at most
        what the tier runs at once)."""
        if tier_name in self.tier_to_reads_in_flight:
            return self.tier_to_reads_in_flight[tier_name]
        return reads_in_flight_for(tier_name, local=self.reads_in_flight, remote=self.remote_reads_in_flight)

    # ---- the plan ----------------------------------------------------------------
    def plan(
        self,
        chunk_tiers: Sequence[str],
        chunk_ends: Sequence[int],
        *,
        num_computed: int,
        num_prompt_tokens: int,
    ) -> LoadDecision:
        """Plan one request: ``chunk_tiers[i]`` holds chunk i, which ends at prompt token
        ``chunk_ends[i]``; tokens before ``num_computed`` are on the GPU already; the
        last prompt token is always computed. Side-effect free (see :meth:`record`)."""
        num_loadable_end = num_prompt_tokens - 1
        # Leading CPU-tier chunks: copied in the admitting step.
        index = 0
        num_cpu_end = num_computed
        while index < len(chunk_tiers) and (chunk_tiers[index] == "cpu" or chunk_ends[index] <= num_computed):
            num_cpu_end = max(num_cpu_end, min(chunk_ends[index], num_loadable_end))
            index += 1
        first_fetch = index
        step_times = self.step_times
        rates = {"prefill": step_times.rate(num_prompt_tokens)}
        now = self._clock()
        remeasured = set()
        for tier in set(chunk_tiers[first_fetch:]) - {"cpu"}:
            # a fetch reads its chunks of a tier reads_in_flight_for(tier) at a time
            num_chunks = sum(1 for name in chunk_tiers[first_fetch:] if name == tier)
            connections = min(num_chunks, self.reads_in_flight_for(tier))
            rates[tier] = self.tier_rate(tier, connections)
            if tier not in self.background_probed_tiers:
                with self._lock:
                    due = self._due_for_measuring(tier, now)
                if due:
                    # measured again by this fetch: planned at the best it ever delivered
                    rates[tier] = max(rates[tier], self.rates.best_rate(tier, connections))
                    remeasured.add(tier)

        def chunk_start(chunk: int) -> int:
            return chunk_ends[chunk - 1] if chunk > 0 else 0

        # Recompute times from each chunk's end to the prompt's end, once per plan.
        end_to_rest_s: dict[int, float] = {}

        def rest_s(end: int) -> float:
            if end not in end_to_rest_s:
                end_to_rest_s[end] = step_times.prefill_seconds(end, num_prompt_tokens)
            return end_to_rest_s[end]

        # Recompute the head [num_cpu_end, m) on the GPU while chunks [j, k) are fetched
        # (m = where chunk j starts), then load them and recompute the rest: minimise
        # max(head, fetch) + rest. j = first_fetch is "wait for the fetch"; k = j is
        # "recompute everything".
        best = (first_fetch, first_fetch)
        best_time = rest_s(num_cpu_end)
        for j in range(first_fetch, len(chunk_tiers)):
            num_head_end = max(num_cpu_end, chunk_start(j))
            if num_head_end >= num_loadable_end:
                break
            head_s = step_times.prefill_seconds(num_cpu_end, num_head_end)
            tier_to_bytes: dict[str, int] = {}
            for k in range(j + 1, len(chunk_tiers) + 1):
                tier = chunk_tiers[k - 1]
                if tier != "cpu":
                    # A chunk is read whole even when part of it is on the GPU already.
                    size = (chunk_ends[k - 1] - chunk_start(k - 1)) * self.bytes_per_token
                    tier_to_bytes[tier] = tier_to_bytes.get(tier, 0) + size
                    if (
                        self.max_fetch_bytes is not None
                        and sum(tier_to_bytes.values()) > self.max_fetch_bytes
                    ):
                        break  # no room for more of this fetch: the rest is recomputed
                end = min(chunk_ends[k - 1], num_loadable_end)
                # Tiers are read in parallel, several reads each: the slowest tier decides.
                fetch_s = max((n / rates[t] for t, n in tier_to_bytes.items()), default=0.0)
                total = max(head_s, fetch_s) + rest_s(end)
                if total < best_time:
                    best, best_time = (j, k), total
            if self.always_load:
                best = (first_fetch, len(chunk_tiers))
                break
        first_tail, tail_end = best
        num_head_end = max(num_cpu_end, chunk_start(first_tail)) if tail_end > first_tail else num_cpu_end
        num_fetch_end = num_head_end
        tier_to_tokens: dict[str, int] = {}
        if num_cpu_end > num_computed:
            tier_to_tokens["cpu"] = num_cpu_end - num_computed
        for chunk in range(first_tail, tail_end):
            start = max(chunk_start(chunk), num_fetch_end)
            end = min(chunk_ends[chunk], num_loadable_end)
            if end > start:
                tier_to_tokens[chunk_tiers[chunk]] = tier_to_tokens.get(chunk_tiers[chunk], 0) + end - start
                num_fetch_end = end
        head_s = step_times.prefill_seconds(num_cpu_end, num_head_end)
        # a tier the plan reads nothing from although it holds chunks of the hit (a split,
        # recomputing some of a tier's chunks while fetching others, uses the tier)
        fetched_tiers = {chunk_tiers[index] for index in range(first_tail, tail_end)}
        skipped = (
            frozenset(
                tier
                for index, tier in enumerate(chunk_tiers)
                if tier != "cpu" and index >= first_fetch and chunk_ends[index] > num_computed
            )
            - fetched_tiers
        )
        return LoadDecision(
            num_cpu_end=num_cpu_end,
            first_fetch_chunk=first_tail,
            num_fetch_chunks=tail_end - first_tail,
            num_fetch_end=num_fetch_end,
            fetch_deadline_s=(
                self._always_deadline_s
                if self.always_load
                else head_s + self.deadline_fraction * step_times.prefill_seconds(num_head_end, num_fetch_end)
            ),
            tier_to_planned_tokens=tier_to_tokens,
            num_planned_recompute_tokens=num_prompt_tokens - num_fetch_end + (num_head_end - num_cpu_end),
            rates=rates,
            num_head_end=num_head_end,
            skipped_tiers=skipped,
            remeasured_tiers=frozenset(remeasured & fetched_tiers),
        )

    def record(self, decision: LoadDecision, num_computed: int) -> None:
        """Count a decision that was acted on (a request admitted or its fetch started)."""
        now = self._clock()
        with self._lock:
            for tier in decision.skipped_tiers:
                self._tier_to_skipped_at[tier] = now
            for tier in decision.remeasured_tiers:
                self._claim_measuring(tier, now)
                self._remeasured_tiers.add(tier)
            self.counts["requests"] += 1
            self.counts["fetched_tokens"] += decision.num_fetch_end - max(
                decision.num_cpu_end, decision.num_head_end
            )
            self.counts["cpu_tokens"] += max(0, decision.num_cpu_end - num_computed)
            self.counts["recomputed_tokens"] += decision.num_planned_recompute_tokens
