"""Speculative decoding in the engine (CPU, float32, the tiny archs): greedy outputs are
token-identical to decoding without it, with chunked prefill and with the CPU offload
tier; replayed drafts are accepted; sampled outputs keep their distribution."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, OffloadConfig, SamplingParams
from engine.spec_decode.replay import ReplayProposer
from tests.spec_decode.stats import chi_square_homogeneity_p_value

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NUM_NEW_TOKENS = 20
NUM_SPECULATIVE_TOKENS = 4
# Significance level of the chi-square test; seeds are fixed, so a pass is deterministic.
ALPHA = 1e-3


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    text = [rng.randrange(10, 500) for _ in range(24)]
    return [
        text * 3,  # repeats itself: the n-gram proposer finds matches
        text[:10] + [rng.randrange(10, 500) for _ in range(27)] + text[:10],
        [rng.randrange(10, 500)],
    ]


PROMPTS = _prompts()
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def spec_llm(model_dir, device: str = "cpu", **engine_args) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        device=device,
        speculative="ngram",
        num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
        ngram_min_n=1,
        **engine_args,
    )


def token_ids(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def assert_no_block_leak(llm: LLM) -> None:
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.fixture(scope="module")
def plain_case(tiny_model_dir):
    """Factory: arch -> (model_dir, greedy outputs of PROMPTS without speculation), once per arch."""
    arch_to_case = {}

    def get(arch: str):
        if arch not in arch_to_case:
            model_dir = tiny_model_dir(arch)
            arch_to_case[arch] = (model_dir, token_ids(LLM(model_dir, dtype="float32", device="cpu")))
        return arch_to_case[arch]

    return get


@pytest.fixture(params=ARCHS)
def arch_case(request, plain_case):
    return plain_case(request.param)


def test_greedy_ngram_matches_plain_decoding(arch_case):
    model_dir, expected = arch_case
    llm = spec_llm(model_dir)
    assert token_ids(llm) == expected
    stats = llm.stats.spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_verifications > 0
    assert llm.stats.num_generated_tokens_total == len(PROMPTS) * NUM_NEW_TOKENS
    assert_no_block_leak(llm)


def test_greedy_ngram_with_chunked_prefill_matches(arch_case):
    model_dir, expected = arch_case
    # 8 tokens per step: prompts are split and decode steps share the budget with drafts.
    llm = spec_llm(model_dir, max_num_batched_tokens=8)
    assert token_ids(llm) == expected
    assert llm.stats.spec_decode.num_draft_tokens > 0
    assert_no_block_leak(llm)


def test_greedy_ngram_with_kv_offload_matches(arch_case):
    model_dir, expected = arch_case
    offload = OffloadConfig(chunk_size=16, cpu_bytes=64 << 20)
    llm = spec_llm(model_dir, kv_offload=offload, enable_prefix_caching=False)
    assert token_ids(llm) == expected
    # The second run loads the prompts' KV from the CPU tier; outputs stay identical.
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert outputs[0].metrics.num_external_cached_tokens > 0
    # Only prompt tokens were stored: no chunk holds an output token or a rejected draft.
    cache_engine = llm.engine.offload_cache_engine
    for prompt, output in zip(PROMPTS, expected, strict=True):
        assert cache_engine.lookup(prompt) == len(prompt)
        assert cache_engine.lookup(prompt + output) <= len(prompt)
    assert_no_block_leak(llm)


def test_replayed_greedy_drafts_are_all_accepted(plain_case):
    """Drafts replayed from a greedy run are the target's argmax: every one is accepted, and
    each decode step emits K + 1 tokens."""
    model_dir, expected = plain_case("qwen3")
    llm = spec_llm(model_dir)
    llm.engine.scheduler.proposer = ReplayProposer(
        NUM_SPECULATIVE_TOKENS,
        {tuple(p): c for p, c in zip(PROMPTS, expected, strict=True)},
        vocab_size=llm.engine.model_config.vocab_size,
    )
    assert token_ids(llm) == expected
    stats = llm.stats.spec_decode
    assert stats.acceptance_rate == 1.0
    assert stats.mean_accepted_length == (3 * NUM_SPECULATIVE_TOKENS + 3) / 4
    # 1 prefill step, 3 steps of 5 tokens (1 + 15 = 16), 1 step of 3 drafts + 1 (20 = max_tokens).
    assert llm.stats.num_steps == 5
    assert_no_block_leak(llm)


def test_corrupted_drafts_are_rejected_and_rolled_back(plain_case):
    """A third of the replayed drafts are wrong: they are rejected, their KV slots are
    recomputed in later steps, and the output is still exactly the greedy one."""
    model_dir, expected = plain_case("llama")
    llm = spec_llm(model_dir, block_size=4)  # small blocks: rejected drafts span whole blocks
    llm.engine.scheduler.proposer = ReplayProposer(
        NUM_SPECULATIVE_TOKENS,
        {tuple(p): c for p, c in zip(PROMPTS, expected, strict=True)},
        vocab_size=llm.engine.model_config.vocab_size,
        corrupt_fraction=0.35,
        seed=3,
    )
    assert token_ids(llm) == expected
    stats = llm.stats.spec_decode
    assert 0.0 < stats.acceptance_rate < 1.0
    assert_no_block_leak(llm)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampled_tokens_keep_their_distribution(tiny_model_dir, device):
    """Seeded sampled requests with and without speculation: the tokens at the output
    positions that went through verification follow the same distribution (chi-square
    homogeneity over 400 seeds per arm, ALPHA)."""
    model_dir = tiny_model_dir("llama")
    prompt = PROMPTS[1][:8]
    num_seeds = 400
    greedy_continuation = token_ids(LLM(model_dir, dtype="float32", device=device), [prompt])[0]
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
        for s in range(num_seeds)
    ]
    plain = LLM(model_dir, dtype="float32", device=device, max_num_seqs=num_seeds)
    plain_outputs = token_ids(plain, [prompt] * num_seeds, params)
    spec = spec_llm(model_dir, device, max_num_seqs=num_seeds)
    # Greedy tokens as drafts: likely under top-k sampling, so many are accepted.
    spec.engine.scheduler.proposer = ReplayProposer(
        NUM_SPECULATIVE_TOKENS,
        {tuple(prompt): greedy_continuation},
        vocab_size=spec.engine.model_config.vocab_size,
    )
    spec_outputs = token_ids(spec, [prompt] * num_seeds, params)
    stats = spec.stats.spec_decode
    # Drafts are accepted often enough that both the accept and the residual paths shape the output.
    assert 0.05 < stats.acceptance_rate < 0.95, stats
    for position in (1, 2):
        p_value = chi_square_homogeneity_p_value(
            torch.tensor([o[position] for o in plain_outputs]),
            torch.tensor([o[position] for o in spec_outputs]),
        )
        assert p_value > ALPHA, f"output position {position}: p = {p_value}"


def test_stop_string_inside_accepted_drafts_ends_output_like_plain_decoding(plain_case):
    """A step that accepts several drafts keeps only the tokens up to the one that completes
    a stop string, so token ids and text equal decoding without speculation."""
    model_dir, expected = plain_case("llama")
    plain = LLM(model_dir, dtype="float32", device="cpu")
    stop = plain.tokenizer.decode(expected[0][7:9])
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, stop=stop)
    [want] = plain.generate(PROMPTS[:1], params)
    assert want.finish_reason == "stop" and len(want.token_ids) < NUM_NEW_TOKENS
    llm = spec_llm(model_dir)
    llm.engine.scheduler.proposer = ReplayProposer(
        NUM_SPECULATIVE_TOKENS,
        {tuple(PROMPTS[0]): expected[0]},
        vocab_size=llm.engine.model_config.vocab_size,
    )
    [got] = llm.generate(PROMPTS[:1], params)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert llm.stats.spec_decode.num_accepted_tokens > 0
    assert llm.stats.num_generated_tokens_total == len(want.token_ids)
    assert_no_block_leak(llm)


def _verifications(plain_case, corrupt_fraction: float) -> tuple[int, list[list[int]], list[list[int]]]:
    model_dir, expected = plain_case("qwen3")
    llm = spec_llm(model_dir)
    llm.engine.scheduler.proposer = ReplayProposer(
        NUM_SPECULATIVE_TOKENS,
        {tuple(p): c for p, c in zip(PROMPTS, expected, strict=True)},
        vocab_size=llm.engine.model_config.vocab_size,
        corrupt_fraction=corrupt_fraction,
        seed=5,
    )
    got = token_ids(llm)
    return llm.stats.spec_decode.num_verifications, got, expected


def test_an_engine_stops_verifying_drafts_that_never_pay(plain_case) -> None:
    num_verifications, got, expected = _verifications(plain_case, corrupt_fraction=1.0)
    assert got == expected
    num_decode_steps = sum(len(tokens) - 1 for tokens in expected)
    # without the back-off every decode step of every request verified drafts
    assert num_verifications < num_decode_steps / 2, (num_verifications, num_decode_steps)


def test_an_engine_keeps_verifying_drafts_that_pay(plain_case) -> None:
    num_verifications, got, expected = _verifications(plain_case, corrupt_fraction=0.0)
    assert got == expected
    num_tokens = sum(len(tokens) for tokens in expected)
    assert num_verifications >= num_tokens // (NUM_SPECULATIVE_TOKENS + 1) - len(PROMPTS)
