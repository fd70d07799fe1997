"""How long an engine step takes, learned from the engine's own steps: the model the
load planner (load or recompute?) and the scheduler's prefill cap (how many prompt
tokens fit a step while others decode) plan with. One per engine.

A step costs

    a + e * [eager prefill step] + b * prompt_tokens + h * query_key_pairs

- ``a``: what every step pays whatever its prompt tokens (the weights are read once per
  forward pass; the host's work): ~7 ms for an 8B model on an H100 with a CUDA graph;
- ``e``: what a step with prompt tokens pays on top when it runs eagerly (no CUDA graph
  holds it: more tokens than ``graph_token_limit``): on an H100 an eager 8B pass is
  host-bound, tens of milliseconds whatever its tokens;
- ``b``: the cost of one prompt token (its GEMMs);
- ``h``: the cost of one query-key pair of attention (a chunk's tokens attend over every
  position before them, so a chunk deep in a prompt costs more per token).

The parameters are fitted online by recursive least squares (a Kalman filter with a
relative noise, so long steps do not drown short ones, and a forgetting factor, so the
model follows a machine that changes), from a conservative prior. An older model kept
one rate per prompt-length class and took the decode-only step's cost off every prefill
step; an eager prefill step's own fixed cost (~45 ms on the H100) then read as slow
tokens, and the cap, planning chunks of a few tokens that each cost a whole eager pass,
took 14-40 s to prefill a 16k prompt while another request decoded.

The engine core reports every step that loads no KV (:meth:`StepTimeModel.observe_step`,
step thread; a step with loads also lasts its copies, which the planner times from the
tiers' rates);
the planner may read from fetch threads, hence the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

#: prefill tokens per second assumed before the first measured step (the prior of ``b``)
PREFILL_PRIOR_TOKENS_PER_S = 20_000.0
#: the prior of ``a``, seconds
STEP_PRIOR_S = 0.005
#: prior standard deviations of (a, e, b per 1e3 tokens, h per 1e6 pairs), seconds
_PRIOR_STD = np.array([0.02, 0.05, 0.1, 0.005])
#: a step's time is known to within this share (plus _NOISE_FLOOR_S)
_NOISE_SHARE = 0.05
_NOISE_FLOOR_S = 0.0005
#: how far each parameter may drift per observed step, as a share of its prior standard
#: deviation (a random walk: the model follows a machine that changes; unlike a forgetting
#: factor it does not inflate the directions the steps never excite, e.g. the split of a
#: prefill step's fixed cost into ``a`` and ``e`` when no decode-only step was seen)
_DRIFT_SHARE = 0.05
#: scale of the features, so that the parameters are of similar size
_TOKENS_UNIT = 1e3
_PAIRS_UNIT = 1e6

PromptChunk = tuple[int, int]  # (first prompt position computed, tokens computed)


class StepTimeModel:
    """Step time = a + e * eager + b * tokens + h * pairs, fitted from observed steps."""

    def __init__(
        self,
        *,
        prior_tokens_per_s: float = PREFILL_PRIOR_TOKENS_PER_S,
        graph_token_limit: int = 0,
        chunk_tokens: int = 8192,
    ) -> None:
        if prior_tokens_per_s <= 0:
            raise ValueError(f"prior_tokens_per_s must be > 0, got {prior_tokens_per_s}")
        #: steps with at most this many prompt tokens may replay a CUDA graph (the engine
        #: sets it; 0: every step with prompt tokens runs eagerly)
        self.graph_token_limit = graph_token_limit
        #: the engine's token budget per step: a recomputed prompt goes in chunks of it
        self.chunk_tokens = chunk_tokens
        self._lock = threading.Lock()
        self._theta = np.array([STEP_PRIOR_S, 0.0, _TOKENS_UNIT / prior_tokens_per_s, 0.0])
        self._covariance = np.diag(_PRIOR_STD**2)
        #: the parameters predictions use (the fit moved onto non-negative costs), made
        #: from the fit when a prediction needs them: None since the last observed step
        self._predicting: np.ndarray | None = self._theta.copy()
        self.num_prefill_steps = 0
        self.num_steps = 0

    @classmethod
    def from_parameters(
        cls,
        *,
        step_s: float,
        tokens_per_s: float,
        eager_step_s: float = 0.0,
        seconds_per_pair: float = 0.0,
        **kwargs,
    ) -> StepTimeModel:
        """A model that already knows its parameters (tests, benchmarks): as confident as
        after many steps, so that one observation moves it little."""
        model = cls(**kwargs)
        model._theta = np.array(
            [step_s, eager_step_s, _TOKENS_UNIT / tokens_per_s, seconds_per_pair * _PAIRS_UNIT]
        )
        model._covariance = np.diag((_PRIOR_STD * 0.01) ** 2)
        model._predicting = None
        model.num_prefill_steps = model.num_steps = 1
        return model

    # ---- the features of a step ------------------------------------------------------
    def _features(self, chunks: Sequence[PromptChunk]) -> np.ndarray:
        num_tokens = sum(n for _, n in chunks)
        # a chunk of n tokens from position s: its token i attends over s + i + 1 keys
        num_pairs = sum(n * start + n * (n + 1) / 2 for start, n in chunks)
        eager = 1.0 if num_tokens > self.graph_token_limit and num_tokens > 0 else 0.0
        return np.array([1.0, eager, num_tokens / _TOKENS_UNIT, num_pairs / _PAIRS_UNIT])

    # ---- measurements ---------------------------------------------------------------
    def observe_step(self, chunks: Sequence[PromptChunk], seconds: float) -> None:
        """A step computed the prompt ``chunks`` (none: decodes only) in ``seconds``
        (the whole step, from submission to its outputs)."""
        if not seconds > 0:
            return
        x = self._features(chunks)
        with self._lock:
            noise = (_NOISE_FLOOR_S + _NOISE_SHARE * seconds) ** 2
            px = self._covariance @ x
            gain = px / (noise + x @ px)
            # unconstrained (projecting it would break the filter); predictions clamp
            self._theta = self._theta + gain * (seconds - x @ self._theta)
            covariance = self._covariance - np.outer(gain, px) + np.diag((_DRIFT_SHARE * _PRIOR_STD) ** 2)
            # never more uncertain than the prior
            prior = _PRIOR_STD**2
            scale = np.sqrt(np.minimum(1.0, prior / np.maximum(np.diag(covariance), 1e-30)))
            self._covariance = covariance * np.outer(scale, scale)
            self._predicting = None  # made again when a prediction asks (not on every step)
            self.num_steps += 1
            if x[2] > 0:
                self.num_prefill_steps += 1

    # ---- predictions ----------------------------------------------------------------

    def _predicted(self) -> np.ndarray:
        """Under the lock: the parameters predictions use, made once per observed step at
        most (the projection solves sixteen small systems when the fit is infeasible)."""
        if self._predicting is None:
            self._predicting = _physical(self._theta, self._covariance)
        return self._predicting

    def step_seconds(self, chunks: Sequence[PromptChunk]) -> float:
        """The predicted time of a step computing the prompt ``chunks`` (besides decodes)."""
        fixed_s, tokens_s = self.split_seconds(chunks)
        return fixed_s + tokens_s

    def split_seconds(self, chunks: Sequence[PromptChunk]) -> tuple[float, float]:
        """The predicted time of such a step as (its fixed costs ``a + e * eager``, what
        its tokens cost ``b * tokens + h * pairs``)."""
        x = self._features(chunks)
        with self._lock:
            terms = x * self._predicted()
        # Each sum is what the steps measured; its terms alone may trade off against each
        # other (a fit on few kinds of steps), so only the sums are kept non-negative.
        return max(0.0, float(terms[0] + terms[1])), max(0.0, float(terms[2] + terms[3]))

    def prefill_seconds(self, begin: int, end: int) -> float:
        """The predicted time to recompute prompt positions [begin, end) alone, in steps of
        ``chunk_tokens`` (0 when empty)."""
        total = 0.0
        position = begin
        while position < end:
            num_tokens = min(self.chunk_tokens, end - position)
            total += self.step_seconds([(position, num_tokens)])
            position += num_tokens
        return total

    def rate(self, num_prompt_tokens: int) -> float:
        """Tokens per second of a whole prompt of this length recomputed alone."""
        num_prompt_tokens = max(1, num_prompt_tokens)
        return num_prompt_tokens / max(self.prefill_seconds(0, num_prompt_tokens), 1e-9)

    @property
    def fixed_step_s(self) -> float:
        """``a``: what a step costs whatever its prompt tokens."""
        return self.split_seconds(())[0]

    def parameters(self) -> dict[str, float]:
        """The parameters predictions use, in seconds, for logs and /metrics (none is
        negative, see :func:`_physical`)."""
        with self._lock:
            a, e, b, h = self._predicted()
        return {
            "step_s": float(a),
            "eager_step_s": float(e),
            "token_s": float(b) / _TOKENS_UNIT,
            "pair_s": float(h) / _PAIRS_UNIT,
        }


def _physical(theta: np.ndarray, covariance: np.ndarray) -> np.ndarray:
    """The most likely parameters given the fit (``theta`` and its ``covariance``) whose
    costs are never negative (``_NON_NEGATIVE``).

    A recomputed token never costs less than nothing, nor does a query-key pair or a
    step; but steps of only a few prompt lengths cannot tell the terms apart (a user
    sending 16k prompts and nothing else: steps of 16,384 tokens and decodes), and the
    filter may then settle on a negative pair cost offset by a high token cost. Its
    predictions of other lengths are then wrong in shape: on an H100 it put an 8k prompt
    at 1.06 s and a 16k one at 0.53 s, so the planner took the rest of a 16k hit as nearly
    free and loaded 2k of its 16k tokens (TTFT 1.15x the recompute's). So predictions use
    the point of the feasible region nearest to ``theta`` in the fit's own metric (the
    Mahalanobis distance of its covariance): each set of active constraints is tried
    (four constraints, sixteen sets) and the nearest feasible result kept. The filter
    itself keeps the free estimate (constraining it would bias later updates)."""
    if all(direction @ theta >= 0 for direction in _NON_NEGATIVE):
        return theta.copy()
    precision = np.linalg.pinv(covariance)
    best, best_distance = theta.copy(), np.inf
    for mask in range(1, 1 << len(_NON_NEGATIVE)):
        active = np.array([d for i, d in enumerate(_NON_NEGATIVE) if mask >> i & 1])
        spread = active @ covariance @ active.T
        try:
            step = covariance @ active.T @ np.linalg.solve(spread, active @ theta)
        except np.linalg.LinAlgError:
            continue
        candidate = theta - step
        if any(direction @ candidate < -1e-12 for direction in _NON_NEGATIVE):
            continue
        distance = step @ precision @ step
        if distance < best_distance:
            best, best_distance = candidate, distance
    return best


#: what is never negative (:func:`_physical`): a pair's cost, a token's, what an eager
#: prefill step pays on top of a graph step (e: an eager step is never the cheaper) and
#: any step's fixed cost (a)
_NON_NEGATIVE = (
    np.array([0.0, 0.0, 0.0, 1.0]),
    np.array([0.0, 0.0, 1.0, 0.0]),
    np.array([0.0, 1.0, 0.0, 0.0]),
    np.array([1.0, 0.0, 0.0, 0.0]),
)
