"""Prompt-lookup n-gram drafting: propose the tokens that followed the most recent earlier
occurrence of the sequence's own suffix (no draft model, no GPU work)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Finds the longest suffix n-gram (``max_n`` down to ``min_n`` tokens) that occurred earlier
    in a request's tokens (prompt and output) and proposes the tokens that followed its most
    recent occurrence, ``num_speculative_tokens`` of them (continuing the copy into the drafts
    when the occurrence is closer to the end than that).

    The scheduler calls :meth:`propose` once per running decode request per step, with the
    request's id so that its tokens are kept as an array extended by the new tokens only (a
    32k-token list costs ~1 ms to convert, the search itself ~0.1 ms), and :meth:`forget` when
    the request finishes.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if min_n < 1:
            raise ValueError(f"ngram min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"ngram max_n ({max_n}) must be >= min_n ({min_n})")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        # request id -> (buffer, number of valid tokens at its front)
        self._request_id_to_tokens: dict[str, tuple[np.ndarray, int]] = {}

    @property
    def cached_request_ids(self) -> set[str]:
        return set(self._request_id_to_tokens)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's cached tokens (unknown ids are ignored)."""
        self._request_id_to_tokens.pop(request_id, None)

    def _tokens_of(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        """The request's tokens as an int64 array, converting only tokens new since the last call
        (the whole list again when it shrank or its old tokens changed)."""
        buffer, num_cached = self._request_id_to_tokens.get(request_id, (np.empty(0, np.int64), 0))
        num_tokens = len(token_ids)
        if num_tokens < num_cached or (num_cached and buffer[num_cached - 1] != token_ids[num_cached - 1]):
            num_cached = 0
        if num_tokens > len(buffer):
            grown = np.empty(max(2 * num_tokens, 64), dtype=np.int64)
            grown[:num_cached] = buffer[:num_cached]
            buffer = grown
        buffer[num_cached:num_tokens] = token_ids[num_cached:num_tokens]
        self._request_id_to_tokens[request_id] = (buffer, num_tokens)
        return buffer[:num_tokens]

    def propose(
        self,
        token_ids: Sequence[int] | np.ndarray,
        max_num_drafts: int | None = None,
        request_id: str | None = None,
    ) -> list[int]:
        """Return ``min(num_speculative_tokens, max_num_drafts)`` draft token ids for a sequence
        whose next token is unknown; an empty list when no suffix n-gram recurs. With a
        ``request_id`` the tokens are cached for that request's next call.
        Does not modify ``token_ids``."""
        limit = (
            self.num_speculative_tokens
            if max_num_drafts is None
            else min(self.num_speculative_tokens, max_num_drafts)
        )
        if request_id is not None and not isinstance(token_ids, np.ndarray):
            tokens = self._tokens_of(request_id, token_ids)
        else:
            tokens = np.asarray(token_ids, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
        num_tokens = len(tokens)
        if limit <= 0 or num_tokens < 2:
            return []
        last_token = tokens[-1]
        # End positions e (exclusive) of earlier windows: the window is tokens[e - n:e] and its
        # follower tokens[e] must exist, so e <= num_tokens - 1; the suffix itself ends at num_tokens.
        candidate_ends = np.flatnonzero(tokens[:-1] == last_token) + 1
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            ends = candidate_ends[candidate_ends >= n]
            for offset in range(2, n + 1):
                if len(ends) == 0:
                    break
                ends = ends[tokens[ends - offset] == tokens[num_tokens - offset]]
            if len(ends):
                # Copy what followed the match; when the match is so recent that fewer than
                # `limit` tokens follow it, keep copying into the drafts themselves (a repeating
                # sequence is predicted to go on repeating).
                follow_start = int(ends[-1])
                period = num_tokens - follow_start
                return tokens[follow_start + np.arange(limit) % period].tolist()
        return []
