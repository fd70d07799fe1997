"""Greedy token ids equal Hugging Face `generate` for every tiny arch, with the
default settings, chunked prefill, prefix caching and preemption (float32, CPU)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, random_prompt

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NUM_NEW_TOKENS = 32

_SHARED = random_prompt(600, seed=105)
#: 8 prompts of 1..600 tokens; the last two share a 320-token prefix with the 600-token one
PROMPTS = [
    random_prompt(1, seed=100),
    random_prompt(9, seed=101),
    random_prompt(40, seed=102),
    random_prompt(130, seed=103),
    random_prompt(333, seed=104),
    _SHARED,
    _SHARED[:320] + random_prompt(50, seed=106),
    _SHARED[:320] + random_prompt(200, seed=107),
]
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_model_dir):
    """(model_dir, HF greedy outputs), computed once per arch."""
    model_dir = tiny_model_dir(request.param)
    return model_dir, hf_greedy(model_dir, PROMPTS, NUM_NEW_TOKENS)


def _token_ids(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY)
    assert all(len(o.token_ids) == NUM_NEW_TOKENS and o.finish_reason == "length" for o in outputs)
    return [o.token_ids for o in outputs]


def test_default_settings_match_hf(arch_case):
    model_dir, expected = arch_case
    llm = LLM(model_dir, dtype="float32", device="cpu")
    assert _token_ids(llm) == expected
    # every prompt token and every output token but the last went through the model once
    assert llm.stats.num_computed_tokens_total == sum(len(p) for p in PROMPTS) + len(PROMPTS) * (
        NUM_NEW_TOKENS - 1
    )


def test_chunked_prefill_matches_hf(arch_case):
    model_dir, expected = arch_case
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=64)
    assert _token_ids(llm) == expected
    # 1,846 prompt tokens at 64 per step: many steps carry chunks of several requests
    assert llm.stats.num_steps > sum(len(p) for p in PROMPTS) // 64


def test_prefix_caching_matches_hf(arch_case):
    model_dir, expected = arch_case
    llm = LLM(model_dir, dtype="float32", device="cpu")
    assert _token_ids(llm, [PROMPTS[5]]) == [expected[5]]
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    hits = [o.metrics.num_local_cached_tokens for o in outputs]
    # the repeated 600-token prompt hits its 37 full blocks; the two sharing 320 tokens hit 20 blocks
    assert hits == [0, 0, 0, 0, 0, 592, 320, 320]


def test_preemption_matches_hf(arch_case):
    model_dir, expected = arch_case
    # 42 blocks of 16 = 672 tokens: the longest request (632) fits alone; the five short ones
    # admitted first take 35 blocks and need 10 more while decoding, so someone is preempted
    llm = LLM(model_dir, dtype="float32", device="cpu", num_gpu_blocks=42)
    assert _token_ids(llm) == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
