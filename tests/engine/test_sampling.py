"""Sampling: greedy, temperature, top-k, top-p and per-request seeds behave as
documented in `engine.sampler` (statistical checks with fixed seeds)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import apply_top_k_top_p, sample
from tests.engine.hf_reference import random_prompt

PROBS = [0.5, 0.3, 0.15, 0.05]
NUM_DRAWS = 3000


def draw(params: SamplingParams, probs=PROBS, seed: int = 0, num_draws: int = NUM_DRAWS) -> Counter:
    logits = torch.tensor(probs).log().repeat(num_draws, 1)
    generator = torch.Generator().manual_seed(seed)
    return Counter(sample(logits, [params] * num_draws, [generator] * num_draws))


def frequencies(counts: Counter, size: int = len(PROBS)) -> list[float]:
    total = sum(counts.values())
    return [counts[i] / total for i in range(size)]


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None]) == [1, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature):
    counts = draw(SamplingParams(temperature=temperature))
    scaled = [p ** (1 / temperature) for p in PROBS]
    expected = [s / sum(scaled) for s in scaled]
    for got, want in zip(frequencies(counts), expected, strict=True):
        assert abs(got - want) < 0.035, (frequencies(counts), expected)


def test_higher_temperature_spreads_the_distribution():
    def entropy(counts: Counter) -> float:
        return -sum(f * math.log(f) for f in frequencies(counts) if f > 0)

    assert entropy(draw(SamplingParams(temperature=0.3))) < entropy(draw(SamplingParams(temperature=1.0)))
    assert entropy(draw(SamplingParams(temperature=1.0))) < entropy(draw(SamplingParams(temperature=3.0)))


def test_top_k_keeps_the_k_most_likely_tokens_renormalized():
    counts = draw(SamplingParams(temperature=1.0, top_k=2))
    assert set(counts) == {0, 1}
    assert abs(frequencies(counts)[0] - 0.5 / 0.8) < 0.035


@pytest.mark.parametrize("top_p,kept", [(0.5, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    counts = draw(SamplingParams(temperature=1.0, top_p=top_p))
    assert set(counts) == kept


def test_top_k_then_top_p_filters_compose():
    logits = torch.tensor([PROBS]).log()
    filtered = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.75]))
    # top-k 3 leaves 0.5/0.95, 0.3/0.95, 0.15/0.95; top-p 0.75 then needs the first two
    assert torch.isfinite(filtered[0]).tolist() == [True, True, False, False]


def test_seeded_generators_repeat_and_differ_by_seed():
    params = SamplingParams(temperature=1.0)
    first = [
        sample(torch.tensor([PROBS]).log(), [params], [torch.Generator().manual_seed(7)]) for _ in range(3)
    ]
    assert first[0] == first[1] == first[2]
    assert draw(params, seed=7, num_draws=50) == draw(params, seed=7, num_draws=50)
    assert list(draw(params, seed=7, num_draws=50).elements()) != list(
        draw(params, seed=8, num_draws=50).elements()
    )


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir("llama"), dtype="float32", device="cpu")


def test_seeded_generation_is_reproducible_alone_and_in_a_batch(llm):
    prompt = random_prompt(30, seed=11)
    params = SamplingParams(max_tokens=16, temperature=1.5, seed=1234, ignore_eos=True)
    (alone,) = llm.generate([prompt], params)
    (again,) = llm.generate([prompt], params)
    assert alone.token_ids == again.token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate([random_prompt(50, seed=12), prompt], [others, params])
    assert batch[1].token_ids == alone.token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.5, seed=4321, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].token_ids != alone.token_ids


def test_top_k_one_is_greedy(llm):
    prompt = random_prompt(25, seed=13)
    (greedy,) = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    (top1,) = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=2.0, top_k=1, ignore_eos=True))
    assert top1.token_ids == greedy.token_ids
