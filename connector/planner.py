"""The load-or-recompute planner (DESIGN §5): per request, which chunks to load from
which tier and which tokens to recompute, from measured rates.

Rates are moving averages of the engine's own transfers (bytes per second per tier,
measured by the fetcher from each finished fetch) and of its prefill steps (tokens
per second, per prompt-length class: attention makes long prompts slower per
token). Until a tier has been measured its prior is conservative (slow).

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

A tier that the plans skip (its prior, or a measurement that is old now, says it is
slower than recomputing) would never be read again, so never measured: once per
``probe_interval_s`` per such tier, :meth:`LoadPlanner.claim_probe` names one chunk of
a request's hit that the scheduler side reads in the background (a probe: on nobody's
critical path; the request recomputes as planned). Its read measures the tier like
any fetch, so a tier faster than its prior is used from the next request on.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

#: bytes per second assumed for a tier before its first measured read
TIER_PRIOR_BYTES_PER_S = {"cpu": 10e9, "disk": 0.5e9, "redis": 0.1e9, "grpc": 0.2e9}
#: how long a fetch may take with ``load_policy: always`` (a hung read must still end)
ALWAYS_LOAD_DEADLINE_S = 600.0
#: the least share of a prefill step's time counted as its tokens' (the rest may be the
#: step's fixed cost, see PrefillRates)
MIN_PREFILL_SHARE_OF_STEP = 0.1
#: prefill tokens per second assumed before the first measured prefill step
PREFILL_PRIOR_TOKENS_PER_S = 20_000.0
#: a tier the plans skip is probed (one chunk read in the background) at most this often
TIER_PROBE_INTERVAL_S = 30.0
#: how long a probe's read may take before it counts as what the tier delivered by then
TIER_PROBE_DEADLINE_S = 30.0


class MovingRate:
    """Exponential moving average of a rate, starting from a prior; ``last`` is the
    latest sample (the prior until the first one)."""

    def __init__(self, prior: float, alpha: float) -> None:
        self.value = prior
        self.last = prior
        self.alpha = alpha
        self.num_samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        sample = amount / seconds
        self.value = sample if self.num_samples == 0 else (1 - self.alpha) * self.value + self.alpha * sample
        self.last = sample
        self.num_samples += 1


class PrefillRates:
    """The engine's measured prefill rate, in tokens per second by the prompt position a
    prefill reaches (classes of powers of two): attention makes a token deep in a prompt
    slower than one near its start, so a whole prompt of n tokens and a chunk of a longer
    prompt ending at n land in the same class.

    One per engine, shared by the load planner (load or recompute?) and the scheduler's
    prefill cap (how many prompt tokens fit a step while others decode). The engine core
    reports every step that computed prompt tokens (:meth:`observe`, step thread); the
    planner may read from its fetch threads, hence the lock. An unmeasured class starts
    from its nearest measured neighbour, else from ``prior``.

    A step has a fixed cost whatever its prompt tokens (the weights are read once per
    forward pass: ~7 ms for an 8B model on an H100). The engine core reports steps
    without prompt tokens (:meth:`observe_step_without_prefill`); that cost, a moving
    average, is taken off a prefill step's time before its tokens are divided by it.
    Without it a chunk of a few tokens measured as a few hundred tokens per second and
    the prefill cap, planning from that, kept the chunks that short (a 16k prompt took
    26 s on an H100 while another request decoded)."""

    def __init__(self, prior: float = PREFILL_PRIOR_TOKENS_PER_S, alpha: float = 0.3) -> None:
        self.prior = prior
        self.alpha = alpha
        self._lock = threading.Lock()
        self._length_class_to_rate: dict[int, MovingRate] = {}
        #: (length class, rate) of the latest observed step
        self._latest: tuple[int, float] | None = None
        #: seconds per step without prompt tokens (0 until measured)
        self._fixed_step = MovingRate(0.0, alpha)

    def observe_step_without_prefill(self, seconds: float) -> None:
        """A step that computed no prompt tokens (decodes only) took ``seconds``."""
        with self._lock:
            self._fixed_step.observe(seconds, 1.0)  # seconds per (one) step

    @property
    def fixed_step_s(self) -> float:
        """The measured cost of a step without prompt tokens (0 until measured)."""
        with self._lock:
            return self._fixed_step.value

    def observe(self, num_prompt_tokens: int, num_tokens: int, seconds: float) -> None:
        """A step computed ``num_tokens`` prompt tokens, reaching prompt position
        ``num_prompt_tokens`` at the deepest, in ``seconds`` (the whole step: other
        requests' decode tokens included)."""
        with self._lock:
            # The step's fixed cost is not the tokens' (at most 90% of the step, so a noisy
            # fixed-cost estimate cannot make a chunk look instantaneous).
            seconds = max(seconds - self._fixed_step.value, MIN_PREFILL_SHARE_OF_STEP * seconds)
            self._rate(num_prompt_tokens).observe(num_tokens, seconds)
            if num_tokens > 0 and seconds > 0:
                self._latest = (_length_class(num_prompt_tokens), num_tokens / seconds)

    def rate(self, num_prompt_tokens: int) -> float:
        """The moving average for this prompt length (the planner's estimate)."""
        with self._lock:
            return self._rate(num_prompt_tokens).value

    def cautious_rate(self, num_prompt_tokens: int) -> float | None:
        """A low estimate for a step reaching this prompt position, or None when nothing
        has been measured yet: the lowest of the class's moving average, its latest sample
        (a slowdown counts at once) and the latest step's rate when that step reached a
        class no deeper (tokens deeper in a prompt cost more: the next chunk of a prompt is
        at most as fast as the one before, whatever big, efficient steps measured in its
        class earlier)."""
        with self._lock:
            if not any(r.num_samples for r in self._length_class_to_rate.values()):
                return None
            rate = self._rate(num_prompt_tokens)
            value = min(rate.value, rate.last)
            if self._latest is not None and self._latest[0] <= _length_class(num_prompt_tokens):
                value = min(value, self._latest[1])
            return value

    def snapshot(self) -> dict[int, float]:
        """Moving averages by the shortest prompt length of each class (``2^k``)."""
        with self._lock:
            return {1 << (c - 1): rate.value for c, rate in self._length_class_to_rate.items()}

    def _rate(self, num_prompt_tokens: int) -> MovingRate:
        length_class = _length_class(num_prompt_tokens)
        rate = self._length_class_to_rate.get(length_class)
        if rate is None:
            rate = MovingRate(self.prior, self.alpha)
            self._length_class_to_rate[length_class] = rate
        if not rate.num_samples:
            # An unmeasured length class follows its nearest measured neighbour.
            measured = [c for c, r in self._length_class_to_rate.items() if r.num_samples]
            nearest = min(measured, key=lambda c: abs(c - length_class), default=None)
            if nearest is not None:
                rate.value = self._length_class_to_rate[nearest].value
                rate.last = self._length_class_to_rate[nearest].last
        return rate


def _length_class(num_prompt_tokens: int) -> int:
    """Prompt positions [2^(k-1), 2^k) are class k."""
    return max(1, num_prompt_tokens).bit_length()


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
        prefill_rates: PrefillRates | None = None,
        probe_interval_s: float = TIER_PROBE_INTERVAL_S,
        clock=time.monotonic,
    ) -> None:
        self.bytes_per_token = bytes_per_token
        self.deadline_fraction = deadline_fraction
        #: load every hit and wait for it (``load_policy: always``): no recompute trade-off
        self.always_load = always_load
        self.alpha = alpha
        #: bytes/s per tier name until its first measured read (read when a tier is first planned)
        self.tier_priors = {**TIER_PRIOR_BYTES_PER_S, **(tier_priors or {})}
        #: seconds between two probes of a tier the plans skip (0: never probe)
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self._tier_to_observed_at: dict[str, float] = {}
        self._tier_to_next_probe_at: dict[str, float] = {}
        #: the engine's (shared with its scheduler), or the planner's own
        self.prefill_rates = prefill_rates if prefill_rates is not None else PrefillRates()
        self._lock = threading.Lock()
        self._tier_to_rate: dict[str, MovingRate] = {}
        #: decisions so far, for /metrics (kvstash_planner_*)
        self.counts = {
            "requests": 0,
            "fetched_tokens": 0,
            "recomputed_tokens": 0,
            "cpu_tokens": 0,
            "probes": 0,
        }

    @contextlib.contextmanager
    def forced_loading(self) -> Iterator[None]:
        """Within the block, plan like ``load_policy: always`` (load every hit, wait for
        it). For warm-ups that must take a tier's load path whatever the rates say; the
        caller runs requests one at a time inside it (planning is on the step thread)."""
        previous = self.always_load
        self.always_load = True
        try:
            yield
        finally:
            self.always_load = previous

    # ---- measurements ------------------------------------------------------------
    def observe_read(self, tier_name: str, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._tier_rate(tier_name).observe(num_bytes, seconds)
            if num_bytes > 0 and seconds > 0:
                self._tier_to_observed_at[tier_name] = self._clock()

    def observe_prefill(self, num_prompt_tokens: int, num_tokens: int, seconds: float) -> None:
        """A step computed ``num_tokens`` prompt tokens of prompts up to ``num_prompt_tokens`` long."""
        self.prefill_rates.observe(num_prompt_tokens, num_tokens, seconds)

    def tier_rate(self, tier_name: str) -> float:
        with self._lock:
            return self._tier_rate(tier_name).value

    def prefill_rate(self, num_prompt_tokens: int) -> float:
        return self.prefill_rates.rate(num_prompt_tokens)

    def _tier_rate(self, tier_name: str) -> MovingRate:
        rate = self._tier_to_rate.get(tier_name)
        if rate is None:
            rate = MovingRate(self.tier_priors.get(tier_name, 0.1e9), self.alpha)
            self._tier_to_rate[tier_name] = rate
        return rate

    def snapshot(self) -> dict[str, float]:
        """Current rates: ``tier:<name>`` bytes/s and ``prefill:<2^k>`` tokens/s."""
        with self._lock:
            rates = {f"tier:{name}": rate.value for name, rate in self._tier_to_rate.items()}
        for num_tokens, value in self.prefill_rates.snapshot().items():
            rates[f"prefill:{num_tokens}"] = value
        return rates

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
        prefill = self.prefill_rate(num_prompt_tokens)
        rates = {"prefill": prefill}
        for tier in set(chunk_tiers[first_fetch:]) - {"cpu"}:
            rates[tier] = self.tier_rate(tier)

        def chunk_start(chunk: int) -> int:
            return chunk_ends[chunk - 1] if chunk > 0 else 0

        # Recompute the head [num_cpu_end, m) on the GPU while chunks [j, k) are fetched
        # (m = where chunk j starts), then load them and recompute the rest: minimise
        # max(head, fetch) + rest. j = first_fetch is "wait for the fetch"; k = j is
        # "recompute everything".
        best = (first_fetch, first_fetch)
        best_time = (num_prompt_tokens - num_cpu_end) / prefill
        for j in range(first_fetch, len(chunk_tiers)):
            num_head_end = max(num_cpu_end, chunk_start(j))
            if num_head_end >= num_loadable_end:
                break
            head_s = (num_head_end - num_cpu_end) / prefill
            tier_to_bytes: dict[str, int] = {}
            for k in range(j + 1, len(chunk_tiers) + 1):
                tier = chunk_tiers[k - 1]
                if tier != "cpu":
                    # A chunk is read whole even when part of it is on the GPU already.
                    size = (chunk_ends[k - 1] - chunk_start(k - 1)) * self.bytes_per_token
                    tier_to_bytes[tier] = tier_to_bytes.get(tier, 0) + size
                end = min(chunk_ends[k - 1], num_loadable_end)
                # Tiers are read in parallel, several reads each: the slowest tier decides.
                fetch_s = max((n / rates[t] for t, n in tier_to_bytes.items()), default=0.0)
                total = max(head_s, fetch_s) + (num_prompt_tokens - end) / prefill
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
        num_fetched = num_fetch_end - num_head_end
        head_s = (num_head_end - num_cpu_end) / prefill
        return LoadDecision(
            num_cpu_end=num_cpu_end,
            first_fetch_chunk=first_tail,
            num_fetch_chunks=tail_end - first_tail,
            num_fetch_end=num_fetch_end,
            fetch_deadline_s=(
                ALWAYS_LOAD_DEADLINE_S
                if self.always_load
                else head_s + self.deadline_fraction * num_fetched / prefill
            ),
            tier_to_planned_tokens=tier_to_tokens,
            num_planned_recompute_tokens=num_prompt_tokens - num_fetch_end + (num_head_end - num_cpu_end),
            rates=rates,
            num_head_end=num_head_end,
        )

    def claim_probe(self, decision: LoadDecision, chunk_tiers: Sequence[str]) -> int | None:
        """The index of a chunk of ``chunk_tiers`` (the hit ``decision`` was planned for)
        to read in the background so that a lower tier this plan skips is measured, or
        None. A tier qualifies when no read measured it within ``probe_interval_s`` and
        it was not probed within that time either; claiming starts that interval (the
        caller must start the read). Called by the scheduler side once per decision it
        acts on; never with ``load_policy: always`` (every hit is read anyway)."""
        if self.probe_interval_s <= 0 or self.always_load:
            return None
        fetched = range(decision.first_fetch_chunk, decision.first_fetch_chunk + decision.num_fetch_chunks)
        now = self._clock()
        with self._lock:
            for index, tier in enumerate(chunk_tiers):
                # chunks before the fetch range are in the CPU tier or on the GPU already
                if tier == "cpu" or index < decision.first_fetch_chunk or index in fetched:
                    continue
                observed_at = self._tier_to_observed_at.get(tier, -math.inf)
                next_probe_at = self._tier_to_next_probe_at.get(tier, -math.inf)
                if now - observed_at < self.probe_interval_s or now < next_probe_at:
                    continue
                self._tier_to_next_probe_at[tier] = now + self.probe_interval_s
                self.counts["probes"] += 1
                return index
        return None

    def record(self, decision: LoadDecision, num_computed: int) -> None:
        """Count a decision that was acted on (a request admitted or its fetch started)."""
        with self._lock:
            self.counts["requests"] += 1
            self.counts["fetched_tokens"] += decision.num_fetch_end - max(
                decision.num_cpu_end, decision.num_head_end
            )
            self.counts["cpu_tokens"] += max(0, decision.num_cpu_end - num_computed)
            self.counts["recomputed_tokens"] += decision.num_planned_recompute_tokens
