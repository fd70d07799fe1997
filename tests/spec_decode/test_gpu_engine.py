"""Speculative decoding on a CUDA device (marker `gpu`): the Triton rejection sampler in
the engine, float32 greedy outputs identical to the plain engine (which decodes through
CUDA graphs), seeded sampled requests reproducible."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.spec_decode.replay import ReplayProposer
from tests.spec_decode.test_engine_spec import NUM_SPECULATIVE_TOKENS, PROMPTS, token_ids

pytestmark = pytest.mark.gpu


def cuda_spec_llm(model_dir, **engine_args) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        device="cuda",
        speculative="ngram",
        num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
        ngram_min_n=1,
        **engine_args,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_cuda_float32_greedy_spec_matches_plain(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    expected = token_ids(LLM(model_dir, dtype="float32", device="cuda"))
    ngram = cuda_spec_llm(model_dir)
    assert token_ids(ngram) == expected
    assert token_ids(cuda_spec_llm(model_dir, max_num_batched_tokens=8)) == expected
    for corrupt_fraction in (0.0, 0.4):
        llm = cuda_spec_llm(model_dir)
        llm.engine.scheduler.proposer = ReplayProposer(
            NUM_SPECULATIVE_TOKENS,
            {tuple(p): c for p, c in zip(PROMPTS, expected, strict=True)},
            vocab_size=llm.engine.model_config.vocab_size,
            corrupt_fraction=corrupt_fraction,
        )
        assert token_ids(llm) == expected
        rate = llm.stats.spec_decode.acceptance_rate
        assert rate == 1.0 if corrupt_fraction == 0.0 else 0.0 < rate < 1.0


def test_cuda_seeded_sampled_spec_is_reproducible(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    expected = token_ids(LLM(model_dir, dtype="float32", device="cuda"))
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in range(3)
    ]
    runs = []
    for _ in range(2):
        llm = cuda_spec_llm(model_dir)
        llm.engine.scheduler.proposer = ReplayProposer(
            NUM_SPECULATIVE_TOKENS,
            {tuple(p): c for p, c in zip(PROMPTS, expected, strict=True)},
            vocab_size=llm.engine.model_config.vocab_size,
        )
        runs.append(token_ids(llm, PROMPTS, params))
        assert llm.stats.spec_decode.num_draft_tokens > 0
    assert runs[0] == runs[1]
