"""How many prompt tokens one step may compute: the cap that keeps other requests'
tokens flowing while a long prompt is prefilled (chunked prefill, DESIGN §3).

Two limits, each below the scheduler's token budget:

- ``long_prefill_token_threshold`` (vLLM's semantics): a prompt gets at most that many
  tokens per step, whatever else runs (0: off).
- ``max_decode_gap_ms``: while at least one other request is decoding, a step's prompt
  tokens are sized so that the step lasts about ``STEP_TARGET_FRACTION`` of it, from the
  engine's measured prefill rate (:class:`connector.planner.PrefillRates`: tokens per
  second by the prompt position a step's prefill reaches, since attention makes tokens
  deep in a prompt slower; measured over whole steps with their decode tokens, so the
  estimate settles where a capped step lasts the time aimed at). A lone prompt keeps
  its full chunk (and its TTFT). Before any step was measured the rate is a low prior,
  so a first capped step is short rather than long (0: off).

The scheduler calls :meth:`PrefillCap.for_step` once per ``schedule`` and, for each
request that computes prompt tokens in it, :meth:`StepPrefillCap.limit` then (once the
request is scheduled) :meth:`StepPrefillCap.spend`. Never touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.planner import PrefillRates

#: the share of ``max_decode_gap_ms`` a capped step aims at. The rest is for what the
#: estimate misses: the host's work between two steps (scheduling, sampling, outputs), a
#: chunk slower than the one measured before it (its attention reads a longer prefix), a
#: first capped step whose rate was measured on steps without decodes.
STEP_TARGET_FRACTION = 0.75
#: prefill tokens per second assumed by the cap before the engine measured any step: low,
#: so that an unmeasured engine's first capped step is short (it is measured right away)
CAP_PRIOR_TOKENS_PER_S = 2_000.0


@dataclass(frozen=True)
class PrefillCap:
    """The engine's prefill limits (from `EngineArgs`) and its measured prefill rate."""

    block_size: int
    long_prefill_token_threshold: int = 0
    max_decode_gap_ms: float = 0.0
    rates: PrefillRates | None = None

    def for_step(self, any_decoding: bool) -> StepPrefillCap:
        """The limits of one step; ``any_decoding``: a request in the step is decoding."""
        time_budget_s = None
        if any_decoding and self.max_decode_gap_ms > 0:
            time_budget_s = self.max_decode_gap_ms * 1e-3 * STEP_TARGET_FRACTION
            if self.rates is not None:
                # The step's fixed cost (its decodes' forward pass) comes first.
                time_budget_s = max(0.0, time_budget_s - self.rates.fixed_step_s)
        return StepPrefillCap(self, time_budget_s)

    def rate(self, num_end: int) -> float:
        """Prefill tokens per second the cap plans with for a chunk ending at prompt
        position ``num_end``."""
        rate = self.rates.cautious_rate(num_end) if self.rates is not None else None
        return rate if rate is not None and rate > 0 else CAP_PRIOR_TOKENS_PER_S


class StepPrefillCap:
    """What is left of one step's prefill limits (made by :meth:`PrefillCap.for_step`)."""

    def __init__(self, cap: PrefillCap, time_budget_s: float | None) -> None:
        self.cap = cap
        #: seconds of prompt computation this step may still schedule (None: no time cap)
        self.time_left_s = time_budget_s
        self.num_prefills = 0

    def limit(self, num_computed: int, num_new: int) -> int:
        """How many of ``num_new`` prompt tokens from prompt position ``num_computed`` this
        step may compute; 0 means "not in this step". Side-effect free. The step's first
        prompt always gets at least a block (or all it has left), so it progresses however
        slow the estimate says the engine is; a capped chunk ends on a block boundary
        where it can."""
        threshold = self.cap.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        if self.time_left_s is None:
            return num_new
        block_size = self.cap.block_size
        # The rate depends on where the chunk ends, which depends on the rate: estimate the
        # chunk at the rate of a short one, then again at the rate where that one would end.
        num_fit = int(self.time_left_s * self.cap.rate(num_computed + min(num_new, block_size)))
        num_fit = min(num_fit, int(self.time_left_s * self.cap.rate(num_computed + min(num_new, num_fit))))
        if num_fit >= num_new:
            return num_new
        aligned = (num_computed + num_fit) // block_size * block_size - num_computed
        if aligned > 0:
            num_fit = aligned
        if self.num_prefills == 0:
            num_fit = max(num_fit, min(num_new, block_size))
        return max(0, num_fit)

    def spend_seconds(self, seconds: float) -> None:
        """Something else in the step (a load from the CPU tier) takes ``seconds``."""
        if self.time_left_s is not None and seconds > 0:
            self.time_left_s = max(0.0, self.time_left_s - seconds)

    def spend(self, num_computed: int, num_tokens: int) -> None:
        """A request was scheduled with ``num_tokens`` prompt tokens from position
        ``num_computed`` in this step."""
        self.num_prefills += 1
        if self.time_left_s is not None:
            spent_s = num_tokens / self.cap.rate(num_computed + num_tokens)
            self.time_left_s = max(0.0, self.time_left_s - spent_s)
