"""The step-time model learns only from steps whose time covers their device work
(marker `gpu`): on CUDA a step that samples nothing returns once its kernels are queued,
and the step after it then also lasts the earlier one's work. On the H100 an 8k-token
chunk so read 30-50 ms and the step after it 550 ms; fitted on those, the model put an
8k recompute at 79-130 ms (it takes 230) and the planner recomputed heads it should have
loaded."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_reference import random_prompt

pytestmark = pytest.mark.gpu


def test_steps_that_sample_nothing_and_the_step_after_them_are_not_observed(tiny_model_dir):
    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        device="cuda",
        warmup=False,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    model = llm.engine.step_times
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([random_prompt(32, seed=1)], params)  # one step that samples: observed
    before = model.num_prefill_steps
    # four steps of 64 tokens alone: three sample nothing, the fourth follows one that did not
    llm.generate([random_prompt(256, seed=2)], params)
    assert model.num_prefill_steps == before
    llm.generate([random_prompt(48, seed=3)], params)  # after a sampled step: observed again
    assert model.num_prefill_steps == before + 1
