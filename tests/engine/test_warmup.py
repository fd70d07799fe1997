"""engine.warmup and the fused path's length buckets: bucketing is exact (trailing
padding under a causal mask), and a warmed-up engine gives the same tokens as a
cold one, stores nothing in the tiers and leaves no block or prefix-cache entry
behind. CPU, float32 (the warm-up runs the same steps there as on CUDA)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from engine import EngineArgs, EngineCore, OffloadConfig, SamplingParams
from engine.attention import (
    DENSE_PREFILL_MIN_TOKENS,
    dense_bucket_len,
    dense_bucket_lens,
    dense_causal_attention,
)
from engine.warmup import WarmupLimits, warm_up
from tests.engine.hf_reference import random_prompt

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@given(st.integers(min_value=1, max_value=1 << 20))
def test_a_bucket_holds_the_span_with_little_padding(num_tokens: int) -> None:
    bucket = dense_bucket_len(num_tokens)
    assert bucket >= num_tokens
    assert bucket - num_tokens < max(64, num_tokens / 16 + 1)
    assert dense_bucket_len(bucket) == bucket, "a bucket is its own bucket"


@given(st.integers(min_value=DENSE_PREFILL_MIN_TOKENS, max_value=40_000))
def test_the_warm_up_list_holds_every_bucket_a_span_can_take(num_tokens: int) -> None:
    lens = dense_bucket_lens(40_000)
    assert dense_bucket_len(num_tokens) in lens
    assert lens == sorted(set(lens))


def test_bucket_list_sizes_and_bad_lengths() -> None:
    assert dense_bucket_lens(DENSE_PREFILL_MIN_TOKENS - 1) == []
    assert len(dense_bucket_lens(16_384)) <= 16 * 4 + 1, "16 buckets per doubling from 1k to 16k"
    with pytest.raises(ValueError, match="at least one token"):
        dense_bucket_len(0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("num_tokens", [65, 100, 1025, 1501])
def test_padded_causal_attention_equals_the_unpadded_one(dtype, atol, num_tokens) -> None:
    assert dense_bucket_len(num_tokens) > num_tokens, "the case must exercise padding"
    gen = torch.Generator().manual_seed(num_tokens)
    query = torch.randn(num_tokens, 8, 16, generator=gen).to(dtype)
    key = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)
    value = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)
    got = dense_causal_attention(query, key, value, 0.25)
    expected = F.scaled_dot_product_attention(
        *(t.transpose(0, 1).unsqueeze(0) for t in (query, key, value)),
        is_causal=True,
        scale=0.25,
        enable_gqa=True,
    )[0].transpose(0, 1)
    assert got.shape == (num_tokens, 8, 16)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


def _engine(model_dir, tmp_path, **kwargs) -> EngineCore:
    offload = OffloadConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), chunk_size=64)
    args = EngineArgs(
        dtype="float32",
        device="cpu",
        num_gpu_blocks=96,
        max_num_batched_tokens=256,
        max_model_len=512,
        kv_offload=offload,
        **kwargs,
    )
    return EngineCore(model_dir, args)


def _generate(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
    return [finished[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("speculative", [False, True])
def test_a_warmed_engine_gives_the_cold_engines_tokens_and_keeps_nothing(
    tiny_model_dir, tmp_path, caplog, speculative
) -> None:
    model_dir = tiny_model_dir("llama")
    spec = {"speculative": "ngram", "num_speculative_tokens": 3} if speculative else {}
    prompts = [random_prompt(300, seed=1), random_prompt(40, seed=2), random_prompt(300, seed=1)[:200]]
    cold = _engine(model_dir, tmp_path / "cold", **spec)
    expected = _generate(cold, prompts)

    warm = _engine(model_dir, tmp_path / "warm", **spec)
    free_before = warm.block_manager.num_free_blocks
    connector_tiers = warm.runner.connector
    with caplog.at_level(logging.INFO, logger="engine.warmup"):
        report = warm_up(
            warm.runner,
            WarmupLimits(
                max_num_batched_tokens=256,
                max_model_len=512,
                max_num_seqs=8,
                num_speculative_tokens=3 if speculative else 0,
                chunk_size=64,
            ),
        )
    assert report.num_steps >= 16 + (1 if speculative else 0)
    assert sum("warm-up:" in record.getMessage() for record in caplog.records) == 1
    assert warm.runner.connector is connector_tiers, "the connector is attached again"
    assert warm.block_manager.num_free_blocks == free_before
    assert warm.stats.num_steps == 0, "warm-up steps are not engine steps"
    assert warm.offload_cache_engine.tiers.stats()["tiers"]["cpu"]["puts"] == 0, "warm-up stored nothing"

    assert _generate(warm, prompts) == expected
    # the third prompt shares 192 tokens (12 blocks) with the first: the prefix cache holds
    # the first request's blocks, not warm-up garbage
    assert warm.stats.num_computed_tokens_total == cold.stats.num_computed_tokens_total


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1025, 1501, 3001])
def test_padded_causal_attention_on_cuda(num_tokens) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    query, key, value = (
        torch.randn(num_tokens, h, 128, generator=gen).to("cuda", torch.bfloat16) for h in (32, 8, 8)
    )
    got = dense_causal_attention(query, key, value, 128**-0.5)
    expected = F.scaled_dot_product_attention(
        *(t.transpose(0, 1).unsqueeze(0) for t in (query, key, value)),
        is_causal=True,
        scale=128**-0.5,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_the_cuda_engine_warms_up_at_start_and_keeps_its_tokens(tiny_model_dir, caplog) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(1100, seed=3), random_prompt(70, seed=4)]
    outputs = []
    for warmup in (False, True):
        args = EngineArgs(
            dtype="bfloat16", device="cuda", num_gpu_blocks=256, max_model_len=2048, warmup=warmup
        )
        with caplog.at_level(logging.INFO, logger="engine.warmup"):
            engine = EngineCore(model_dir, args)
        assert any("warm-up:" in r.getMessage() for r in caplog.records) == warmup
        outputs.append(_generate(engine, prompts))
        del engine
        caplog.clear()
    assert outputs[0] == outputs[1]
