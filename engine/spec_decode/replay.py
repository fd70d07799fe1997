"""A draft proposer that replays known continuations, for measuring verification at a
chosen acceptance rate (benchmarks) and for testing the accept path (tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


class ReplayProposer:
    """Proposes, for a request whose tokens start with a known prompt, the tokens of that
    prompt's recorded continuation at the request's next output positions. Each draft is
    replaced by another token with probability ``corrupt_fraction``, decided by a hash of
    (``seed``, output position), so a rerun corrupts the same positions.

    With continuations from a greedy run of the same model, a greedy request accepts exactly
    the uncorrupted drafts before the first corrupted one. Same interface as
    ``NgramProposer``; stateless between calls."""

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_to_continuation: Mapping[tuple[int, ...], Sequence[int]],
        vocab_size: int,
        corrupt_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 0.0 <= corrupt_fraction <= 1.0:
            raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 to corrupt a draft, got {vocab_size}")
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.corrupt_fraction = corrupt_fraction
        self.seed = seed
        self.prompt_to_continuation = {tuple(p): list(c) for p, c in prompt_to_continuation.items()}
        self.prompt_lengths = sorted({len(p) for p in self.prompt_to_continuation})

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def propose(
        self, token_ids: Sequence[int], max_num_drafts: int | None = None, request_id: str | None = None
    ) -> list[int]:
        """Up to ``min(num_speculative_tokens, max_num_drafts)`` drafts; none for an unknown prompt."""
        limit = (
            self.num_speculative_tokens
            if max_num_drafts is None
            else min(self.num_speculative_tokens, max_num_drafts)
        )
        for prompt_length in self.prompt_lengths:
            continuation = self.prompt_to_continuation.get(tuple(token_ids[:prompt_length]))
            if continuation is None or len(token_ids) < prompt_length:
                continue
            first = len(token_ids) - prompt_length
            return [
                self._maybe_corrupt(first + i, t)
                for i, t in enumerate(continuation[first : first + max(limit, 0)])
            ]
        return []

    def _maybe_corrupt(self, position: int, token_id: int) -> int:
        rng = np.random.default_rng([self.seed, position])
        if rng.random() >= self.corrupt_fraction:
            return token_id
        return (token_id + 1 + int(rng.integers(self.vocab_size - 1))) % self.vocab_size
