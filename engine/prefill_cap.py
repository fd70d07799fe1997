"""How many prompt tokens one step may compute: the cap that keeps other requests'
tokens flowing while a long prompt is prefilled (chunked prefill, docs/architecture.md, Engine).

Two limits, each below the scheduler's token budget:

- ``long_prefill_token_threshold`` (vLLM's semantics): a prompt gets at most that many
  tokens per step, whatever else runs (0: off).
- ``max_decode_gap_ms``: while at least one other request is decoding, a step's prompt
  tokens are sized so that the step is predicted to last about ``STEP_TARGET_FRACTION``
  of it, by the engine's step-time model (:class:`engine.step_time.StepTimeModel`:
  a step's fixed cost, an eager pass's extra cost, a cost per token and per query-key
  pair of attention, fitted from the engine's own steps). When no chunk fits (a step
  that runs eagerly costs more than the budget by itself), the chunk is the smallest
  whose tokens cost at least the step's fixed costs: the budget is missed, but the
  prompt advances at half the engine's speed or better, never a few tokens per step.
  A lone prompt keeps its full chunk (and its TTFT). Until the engine measured a step
  with prompt tokens, the cap plans at a low prior rate, so a first capped step is
  short rather than long (0: off).

The scheduler calls :meth:`PrefillCap.for_step` once per ``schedule`` and, for each
request that computes prompt tokens in it, :meth:`StepPrefillCap.limit` then (once the
request is scheduled) :meth:`StepPrefillCap.spend`. Never touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.step_time import StepTimeModel

#: the share of ``max_decode_gap_ms`` a capped step aims at. The rest is for what the
#: estimate misses: the host's work between two steps (scheduling, sampling, outputs), a
#: chunk slower than the one measured before it (its attention reads a longer prefix), a
#: first capped step whose rate was measured on steps without decodes.
STEP_TARGET_FRACTION = 0.75
#: the least share of a capped step that its prompt tokens get: below it a chunk costs
#: more in fixed step costs than in work (an eager pass dearer than the budget by itself),
#: and the prompt would crawl; the cap then overruns the budget instead
MIN_TOKEN_SHARE_OF_STEP = 1 / 3
#: prefill tokens per second assumed by the cap before the engine measured any step: low,
#: so that an unmeasured engine's first capped step is short (it is measured right away)
CAP_PRIOR_TOKENS_PER_S = 2_000.0


@dataclass(frozen=True)
class PrefillCap:
    """The engine's prefill limits (from `EngineArgs`) and its step-time model."""

    block_size: int
    long_prefill_token_threshold: int = 0
    max_decode_gap_ms: float = 0.0
    step_times: StepTimeModel | None = None

    def for_step(self, num_decoding: int) -> StepPrefillCap:
        """The limits of one step; ``num_decoding``: requests in the step that decode."""
        time_budget_s = None
        if num_decoding > 0 and self.max_decode_gap_ms > 0:
            time_budget_s = self.max_decode_gap_ms * 1e-3 * STEP_TARGET_FRACTION
        return StepPrefillCap(self, time_budget_s, num_decoding)

    def model(self) -> StepTimeModel:
        """The model the cap plans with: the engine's once it measured a step with prompt
        tokens, before that one at the low prior rate."""
        model = self.step_times
        if model is None or model.num_prefill_steps == 0:
            return StepTimeModel(prior_tokens_per_s=CAP_PRIOR_TOKENS_PER_S)
        return model


class StepPrefillCap:
    """What is left of one step's prefill limits (made by :meth:`PrefillCap.for_step`)."""

    def __init__(self, cap: PrefillCap, time_budget_s: float | None, num_decoding: int = 0) -> None:
        self.cap = cap
        #: the step's decode tokens (they share a CUDA graph's tokens with the prompts)
        self.num_decoding = num_decoding
        #: the predicted length the step may reach (None: no time cap)
        self.time_budget_s = time_budget_s
        #: the step's other time (loads from the CPU tier in it), seconds
        self.other_s = 0.0
        #: prompt chunks scheduled in the step so far: (first position, tokens)
        self.chunks: list[tuple[int, int]] = []
        self._model = cap.model() if time_budget_s is not None else None

    @property
    def num_prefills(self) -> int:
        return len(self.chunks)

    @property
    def time_left_s(self) -> float | None:
        """Seconds the step may still grow by (None: no time cap)."""
        if self._model is None:
            return None
        return max(0.0, self.time_budget_s - self.other_s - self._model.step_seconds(self.chunks))

    def limit(self, num_computed: int, num_new: int) -> int:
        """How many of ``num_new`` prompt tokens from prompt position ``num_computed`` this
        step may compute; 0 means "not in this step". Side-effect free. The step's first
        prompt always gets at least a block (or all it has left), and never fewer tokens
        than make the step worth its fixed cost; a capped chunk ends on a block boundary
        where it can."""
        threshold = self.cap.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        model = self._model
        if model is None or num_new <= 0:
            return num_new
        block_size = self.cap.block_size
        budget_s = self.time_budget_s - self.other_s

        def step_s(num_tokens: int) -> float:
            return model.step_seconds([*self.chunks, (num_computed, num_tokens)])

        num_fit = _largest(lambda n: step_s(n) <= budget_s, num_new)
        graph_room = model.graph_token_limit - self.num_decoding - sum(n for _, n in self.chunks)
        if model.graph_token_limit > 0 and graph_room <= 0 and self.chunks:
            return 0  # the step's prompts filled the graph
        if model.graph_token_limit > 0 and 0 < graph_room < num_fit:
            # A step beyond the CUDA graphs runs eagerly: a fixed cost the model learns only
            # from such steps (the first one would overrun the budget), and a few times a
            # graph step's. While others decode, a prompt advances in graph-sized steps.
            num_fit = graph_room
        if num_fit >= num_new:
            return num_new
        aligned = (num_computed + num_fit) // block_size * block_size - num_computed
        if aligned > 0:
            num_fit = aligned
        if self.num_prefills == 0:
            # The step's only prompt: at least a block, and enough tokens to be worth the
            # step's fixed costs (rounded up to a block boundary). Within the graph's room
            # when it has some: the worth of an eager chunk rests on the model's per-token
            # rate, and where that rate came out low (on the H100 the first capped chunk of
            # a 16k prompt was 3,700-6,100 tokens, 109-178 ms) the cap broke its own budget.
            upper = num_new
            if model.graph_token_limit > 0 and graph_room > 0:
                upper = min(num_new, graph_room)
            num_worthwhile = _smallest_worthwhile(model, num_computed, upper)
            num_worthwhile = -(-(num_computed + num_worthwhile) // block_size) * block_size - num_computed
            if num_worthwhile > upper:  # rounded past the graph's room: down to a block boundary
                below = (num_computed + upper) // block_size * block_size - num_computed
                num_worthwhile = below if below > 0 else upper
            num_fit = max(num_fit, min(num_new, max(block_size, num_worthwhile)))
        return max(0, num_fit)

    def spend_seconds(self, seconds: float) -> None:
        """Something else in the step (a load from the CPU tier) takes ``seconds``."""
        if seconds > 0:
            self.other_s += seconds

    def spend(self, num_computed: int, num_tokens: int) -> None:
        """A request was scheduled with ``num_tokens`` prompt tokens from position
        ``num_computed`` in this step."""
        self.chunks.append((num_computed, num_tokens))


def _smallest_worthwhile(model: StepTimeModel, num_computed: int, upper: int) -> int:
    """The fewest tokens (<= ``upper``) from position ``num_computed`` that make at least
    ``MIN_TOKEN_SHARE_OF_STEP`` of their step (``upper`` when none). The step's fixed cost
    jumps where it no longer fits a CUDA graph, so each side of that limit is searched on
    its own."""
    limit = model.graph_token_limit
    ranges = [(1, min(limit, upper)), (limit + 1, upper)] if limit > 0 else [(1, upper)]
    for low, high in ranges:
        if low > high:
            continue

        def worthwhile(num_tokens: int) -> bool:
            fixed_s, tokens_s = model.split_seconds([(num_computed, num_tokens)])
            return tokens_s >= MIN_TOKEN_SHARE_OF_STEP * (fixed_s + tokens_s)

        if worthwhile(high):
            while low < high:  # the smallest worthwhile count in [low, high]
                middle = (low + high) // 2
                if worthwhile(middle):
                    high = middle
                else:
                    low = middle + 1
            return low
    return upper


def _largest(fits, upper: int) -> int:
    """The largest n in [0, upper] with ``fits(n)`` (0 when none), ``fits`` monotone
    (true up to some n, false after)."""
    low, high = 0, upper
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
