"""Reading model configs: context limits and dtypes."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, Qwen2Config

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from tests.engine.hf_reference import random_prompt

SHAPES = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def test_an_active_sliding_window_caps_the_context():
    mistral = MistralConfig(**SHAPES, max_position_embeddings=32768, sliding_window=4096)
    mistral.architectures = ["MistralForCausalLM"]
    assert ModelConfig.from_hf_config(mistral).max_model_len == 4096
    # Qwen2 names a window but only uses it with use_sliding_window
    qwen2 = Qwen2Config(
        **SHAPES, max_position_embeddings=32768, sliding_window=4096, use_sliding_window=False
    )
    qwen2.architectures = ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf_config(qwen2).max_model_len == 32768


def test_in_memory_config_of_an_unknown_family_is_rejected():
    config = MistralConfig(**SHAPES)
    config.architectures = ["MixtralForCausalLM"]
    config.model_type = "mixtral"
    with pytest.raises(ValueError, match="unknown architecture.*Mixtral"):
        ModelConfig.from_hf_config(config)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_on_cpu_and_agrees_on_the_first_token(tiny_model_dir, dtype):
    model_dir = tiny_model_dir("qwen3")
    prompts = [random_prompt(n, seed=500 + n) for n in (3, 40, 120)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    half = LLM(model_dir, dtype=dtype, device="cpu")
    assert half.engine.runner.kv_cache.dtype == getattr(torch, dtype)
    full = LLM(model_dir, dtype="float32", device="cpu")
    half_outputs, full_outputs = half.generate(prompts, params), full.generate(prompts, params)
    assert all(len(o.token_ids) == 4 for o in half_outputs)
    assert sum(h.token_ids[0] == f.token_ids[0] for h, f in zip(half_outputs, full_outputs, strict=True)) >= 2
