"""The prompt-lookup n-gram proposer against a brute-force definition, and its edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec_decode import NgramProposer


def brute_force_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: longest suffix n-gram first; among its earlier occurrences (each followed
    by at least one token), the one that starts last; then copy k tokens from right after it,
    appending each copied token so the copy can run on into the drafts."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[len(tokens) :]
    return []


def test_proposes_what_followed_the_suffix() -> None:
    proposer = NgramProposer(num_speculative_tokens=4, min_n=1, max_n=3)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2]
    # Capped by the caller (e.g. tokens left before max_tokens).
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], max_num_drafts=2) == [4, 5]
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], max_num_drafts=0) == []
    # Fewer than k tokens follow the match: the copy runs on into the drafts.
    assert proposer.propose([7, 8, 9, 7, 8]) == [9, 7, 8, 9]
    assert proposer.propose([5, 5, 5]) == [5, 5, 5, 5]


def test_prefers_longest_n_then_most_recent_match() -> None:
    proposer = NgramProposer(num_speculative_tokens=2, min_n=1, max_n=3)
    # "3" alone recurs most recently (followed by 50), but "2 3" recurs earlier (followed by 40).
    tokens = [1, 2, 3, 40, 9, 3, 50, 9, 2, 3]
    assert proposer.propose(tokens) == [40, 9]
    # Two occurrences of "2 3": the later one wins.
    tokens = [2, 3, 10, 11, 2, 3, 20, 21, 2, 3]
    assert proposer.propose(tokens) == [20, 21]


def test_min_n_and_no_match() -> None:
    assert NgramProposer(num_speculative_tokens=3, min_n=2, max_n=4).propose([5, 6, 7, 8, 6]) == []
    assert NgramProposer(num_speculative_tokens=3, min_n=1, max_n=4).propose([5, 6, 7, 8, 6]) == [7, 8, 6]
    assert NgramProposer(num_speculative_tokens=3).propose([1, 2, 3, 4]) == []
    assert NgramProposer(num_speculative_tokens=3).propose([1]) == []
    assert NgramProposer(num_speculative_tokens=3).propose([]) == []


def test_long_context_finds_a_planted_match() -> None:
    """32k tokens of random ids with one earlier copy of the final 4-gram."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1000, 30_000, size=32_768)
    tokens[-4:] = [1, 2, 3, 4]
    tokens[10_000:10_004] = [1, 2, 3, 4]
    tokens[10_004:10_012] = np.arange(100, 108)
    proposer = NgramProposer(num_speculative_tokens=8, min_n=2, max_n=4)
    assert proposer.propose(tokens) == list(range(100, 108))
    assert proposer.propose(tokens.tolist()) == list(range(100, 108))


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    k=st.integers(1, 6),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 3),
)
def test_matches_brute_force(tokens: list[int], k: int, min_n: int, extra_n: int) -> None:
    proposer = NgramProposer(num_speculative_tokens=k, min_n=min_n, max_n=min_n + extra_n)
    assert proposer.propose(tokens) == brute_force_propose(tokens, k, min_n, min_n + extra_n)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"num_speculative_tokens": 2, "min_n": 0}, "min_n must be >= 1"),
        ({"num_speculative_tokens": 2, "min_n": 3, "max_n": 2}, r"max_n \(2\) must be >= min_n \(3\)"),
    ],
)
def test_bad_configuration_raises(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramProposer(**kwargs)


def test_bad_token_ids_raise() -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        NgramProposer(num_speculative_tokens=2).propose([[1, 2], [3, 4]])


def test_per_request_token_cache_gives_the_same_drafts():
    """With a request id the proposer converts only new tokens; results never differ from a
    fresh conversion, also after the list shrank or changed."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 5, size=200).tolist()
    cached = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    fresh = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    for length in [*range(1, 200, 7), 50, 60, 200]:
        assert cached.propose(tokens[:length], request_id="r") == fresh.propose(tokens[:length])
    changed = [*tokens[:59], 4 - tokens[59]]
    assert cached.propose(changed, request_id="r") == fresh.propose(changed)
    # Longer again, but its token 59 differs from the cached one: converted anew.
    assert cached.propose(tokens[:80], request_id="r") == fresh.propose(tokens[:80])
    assert cached.cached_request_ids == {"r"}
    cached.forget("r")
    assert cached.cached_request_ids == set()
