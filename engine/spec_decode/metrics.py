"""Counters of speculative decoding over an engine's life."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    """Updated by the engine core after every step that verified drafts; read by tests,
    benchmarks and /metrics."""

    #: draft tokens scheduled for verification
    num_draft_tokens: int = 0
    #: draft tokens the rejection sampler accepted
    num_accepted_tokens: int = 0
    #: request-steps that carried at least one draft
    num_verifications: int = 0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification in one step."""
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        self.num_verifications += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verification; each verification also emits one more token."""
        return self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0
