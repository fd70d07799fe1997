"""Which replica a request goes to: the best expected time to first token given what each
replica holds of the prompt and what it already has to do, among the replicas a bounded
imbalance allows.

A replica's cost for the request, in prompt tokens' worth of compute:

    queued_tokens + REQUEST_COST_TOKENS * in_flight + sum over the prompt of tier_cost

``queued_tokens`` are the prompt tokens its requests in flight compute (as this router
estimated them when it sent them), ``in_flight`` their number (each decoding request slows
every step a little), and the new prompt costs 1 per token it recomputes and
``tier_cost[tier]`` per token it loads from a tier: the ratio of the replica's measured
load and prefill rates (`costs`), or a default ratio where it measured none.

Bounded imbalance: a replica may take the request only while it would then have at most
``MAX_IMBALANCE`` times the mean in-flight count (this request counted) plus one; the
replica with the fewest in flight always may, so there is always a choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.server.router.costs import DEFAULT_TIER_COST
from engine.server.router.matching import PrefixMatch
from engine.server.upstream.pool import Engine

#: what one request in flight adds to a replica's cost (its share of every step)
REQUEST_COST_TOKENS = 64.0
#: no replica takes more than this times the mean in-flight count, plus one
MAX_IMBALANCE = 1.5


@dataclass(frozen=True)
class Candidate:
    engine: Engine
    match: PrefixMatch
    #: a token's cost when loaded from each tier on this replica (recomputing it costs 1)
    tier_cost: Mapping[str, float] = field(default_factory=lambda: DEFAULT_TIER_COST)


@dataclass(frozen=True)
class Decision:
    """The replicas in the order to try them (the first is the choice), the reason in a
    word (``prefix``: it holds more of the prompt than some other; ``load``: the prefix
    made no difference; ``imbalance``: a cheaper replica was over the bound), and each
    candidate's prompt tokens to compute."""

    order: list[Engine]
    reason: str
    matches: dict[int, PrefixMatch]
    prompt_tokens: dict[int, float]

    def match(self, engine: Engine) -> PrefixMatch:
        return self.matches[id(engine)]

    def tokens_at(self, engine: Engine) -> float:
        return self.prompt_tokens[id(engine)]


def new_tokens(
    num_prompt_tokens: int, match: PrefixMatch, tier_cost: Mapping[str, float] = DEFAULT_TIER_COST
) -> float:
    """The prompt's cost on a replica holding ``match``: 1 per recomputed token,
    ``tier_cost[tier]`` per loaded one."""
    saved = sum(count * (1.0 - tier_cost[tier]) for tier, count in match.by_tier().items())
    return max(0.0, num_prompt_tokens - saved)


def choose(candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
    """Rank ``candidates`` (live replicas in turn order: ties go round-robin); at least one."""
    if not candidates:
        raise ValueError("choose needs at least one candidate replica")
    total_in_flight = sum(c.engine.num_in_flight for c in candidates)
    bound = MAX_IMBALANCE * (total_in_flight + 1) / len(candidates) + 1
    tokens = {id(c.engine): new_tokens(num_prompt_tokens, c.match, c.tier_cost) for c in candidates}

    def cost(c: Candidate) -> float:
        return c.engine.queued_tokens + REQUEST_COST_TOKENS * c.engine.num_in_flight + tokens[id(c.engine)]

    ranked = sorted(candidates, key=cost)  # stable: equal costs keep the turn order
    allowed = [c for c in ranked if c.engine.num_in_flight + 1 <= bound]
    over = [c for c in ranked if c.engine.num_in_flight + 1 > bound]
    chosen = allowed[0]
    if chosen is not ranked[0]:
        reason = "imbalance"
    elif any(tokens[id(c.engine)] > tokens[id(chosen.engine)] for c in candidates):
        reason = "prefix"
    else:
        reason = "load"
    return Decision(
        order=[c.engine for c in allowed + over],
        reason=reason,
        matches={id(c.engine): c.match for c in candidates},
        prompt_tokens=tokens,
    )
