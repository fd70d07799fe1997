"""engine.request.index_of_token_outside_vocab: the prompt check every request passes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.request import index_of_token_outside_vocab

VOCAB = 50

elements = st.one_of(
    st.integers(min_value=-3, max_value=VOCAB + 3),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, min_value=0, max_value=VOCAB),
    st.text(max_size=2),
)


def slow_reference(token_ids, vocab_size):
    for index, token in enumerate(token_ids):
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            return index
    return None


@given(st.lists(elements, max_size=30))
def test_matches_the_element_by_element_check(token_ids):
    assert index_of_token_outside_vocab(token_ids, VOCAB) == slow_reference(token_ids, VOCAB)


@given(st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=30))
def test_ints_in_range_pass(token_ids):
    assert index_of_token_outside_vocab(token_ids, VOCAB) is None


def test_a_none_among_ints_is_reported_not_taken_for_success():
    assert index_of_token_outside_vocab([1, 2, None, 3], VOCAB) == 2
    assert index_of_token_outside_vocab([1, 2.0], VOCAB) == 1
    assert index_of_token_outside_vocab([0, VOCAB], VOCAB) == 1
    assert index_of_token_outside_vocab((3, -1), VOCAB) == 1
    assert index_of_token_outside_vocab([], VOCAB) is None
