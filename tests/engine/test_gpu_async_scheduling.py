"""Async scheduling and the persistent batch on a real GPU (marker `gpu`): the same
tokens as the plain engine in float32 with real decode CUDA graphs, and the persistent
batch's inputs equal to the from-scratch ones with whole-prompt (dense) prefills in bf16."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def test_async_tokens_equal_the_plain_engine_with_cuda_graphs(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = [make_prompt(n, seed=n) for n in (3, 40, 129, 300, 17, 64, 9, 200)]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (1, 30, 12, 25, 40, 3, 18, 7)
    ]
    plain = LLM(model_dir, dtype="float32", device="cuda", num_gpu_blocks=256, warmup=False)
    plain.engine.runner.input_batch = None
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(
        model_dir, dtype="float32", device="cuda", num_gpu_blocks=256, warmup=False, async_scheduling=True
    )
    assert llm.engine.runner.decode_graphs is not None
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.runner.num_device_filled_input_ids > 0
    # and under preemption
    small = LLM(
        model_dir, dtype="float32", device="cuda", num_gpu_blocks=48, warmup=False, async_scheduling=True
    )
    assert [o.token_ids for o in small.generate(prompts, params)] == expected
    assert small.engine.scheduler.stats.num_preemptions > 0


def test_persistent_batch_inputs_equal_from_scratch_with_dense_prefills(tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir("qwen3")
    # eager: graphs do not change the inputs (and would only add start-up time)
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        device="cuda",
        num_gpu_blocks=512,
        warmup=False,
        enforce_eager=True,
        async_scheduling=True,
    )
    runner = llm.engine.runner
    batch, prepare = runner.input_batch, runner._prepare
    num_dense = 0

    def compare(plan):
        nonlocal num_dense
        runner.input_batch = None
        reference = prepare(plan)
        runner.input_batch = batch
        host, logits_rows = prepare(plan)
        assert logits_rows == reference[1]
        for name, value in vars(reference[0]).items():
            other = getattr(host, name)
            if isinstance(value, np.ndarray):
                assert np.array_equal(value, other), name
            else:
                assert value == other, name
        num_dense += bool(host.dense_spans)
        return host, logits_rows

    monkeypatch.setattr(runner, "_prepare", compare)
    prompts = [make_prompt(n, seed=n) for n in (1500, 20, 1100, 70)]
    llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert num_dense > 0
