"""The step-time model's predictions keep a physical shape when its steps cannot tell its
terms apart: a user who sends only 16k prompts (steps of 16,384 prompt tokens, decodes,
and the one-token steps after a hit) gives steps of two prompt lengths for three costs.
The free fit then settles on a negative pair cost, and on an H100 it predicted an 8k
prompt at 1.06 s and a 16k one at 0.53 s: the planner took the rest of a 16k hit as
nearly free and loaded 2k of its 16k tokens. Predictions now come from the nearest
parameters with no negative cost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.step_time import StepTimeModel


def sixteen_k_user(model: StepTimeModel, prefill_s: float = 0.5) -> None:
    steps = []
    for _ in range(2):  # the warm-up's short prompt
        steps += [([(0, 256)], 0.035), ([], 0.007)]
    for _ in range(8):  # 16k prompts recomputed, decodes, hits' last tokens
        steps += [([(0, 16384)], prefill_s), ([], 0.007), ([(16383, 1)], 0.012)]
    for chunks, seconds in steps:
        model.observe_step(chunks, seconds)


def test_predictions_grow_with_the_prompt_when_only_one_long_length_was_seen():
    model = StepTimeModel(graph_token_limit=512, chunk_tokens=16384)
    sixteen_k_user(model)
    lengths = [256, 1024, 2048, 4096, 8192, 12288, 16384, 32768]
    seconds = [model.prefill_seconds(0, n) for n in lengths]
    assert seconds == sorted(seconds), dict(zip(lengths, seconds, strict=True))
    assert model.prefill_seconds(0, 8192) < model.prefill_seconds(0, 16384)
    # the tail of a prompt deep in its context costs at least as much per token as its head
    assert model.prefill_seconds(8192, 16384) >= model.prefill_seconds(0, 8192) - 1e-9
    # what was seen most is still predicted near what it took
    assert model.prefill_seconds(0, 16384) == pytest.approx(0.5, rel=0.25)
    parameters = model.parameters()
    assert all(value >= -1e-12 for value in parameters.values()), parameters


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 32768), min_size=1, max_size=6),
    seconds_per_token=st.floats(1e-6, 1e-3),
    fixed_s=st.floats(0.001, 0.1),
)
def test_no_prediction_of_a_longer_prompt_is_shorter(lengths, seconds_per_token, fixed_s):
    """Whatever steps were seen, a prompt that extends another is never predicted faster."""
    model = StepTimeModel(graph_token_limit=512, chunk_tokens=8192)
    for n in lengths:
        model.observe_step([(0, n)], fixed_s + seconds_per_token * n)
        model.observe_step([], fixed_s / 2)
    previous = 0.0
    for n in (128, 1024, 4096, 8192, 16384, 32768):
        predicted = model.prefill_seconds(0, n)
        assert predicted >= previous - 1e-12
        previous = predicted
