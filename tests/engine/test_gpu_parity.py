"""On CUDA the engine runs the Triton kernels (reshape_and_cache, paged attention):
float32 greedy tokens equal Hugging Face's, and bfloat16 picks tokens that Hugging
Face rates within a stated log-probability tolerance of its own best."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import random_prompt

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NUM_NEW_TOKENS = 24
_SHARED = random_prompt(500, seed=7)
PROMPTS = [
    random_prompt(1, seed=1),
    random_prompt(17, seed=2),
    random_prompt(250, seed=3),
    _SHARED,
    _SHARED[:300] + random_prompt(90, seed=4),
    random_prompt(700, seed=5),
]
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
#: bf16 tolerance: the engine's token may trail HF's argmax by at most this many nats
BF16_LOGPROB_TOLERANCE = 0.15


def _hf_model(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_greedy_matches_hf_on_cuda(arch, tiny_model_dir):
    model_dir = tiny_model_dir(arch)
    model = _hf_model(model_dir, torch.float32)
    expected = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = model.generate(
                torch.tensor([prompt], device="cuda"),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64, device="cuda"),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            expected.append(ids[0, len(prompt) :].tolist())
    for settings in ({}, {"max_num_batched_tokens": 64}):
        llm = LLM(model_dir, dtype="float32", device="cuda", **settings)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected, settings


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_tokens_are_hf_top_choices(arch, tiny_model_dir):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_batched_tokens=128)
    outputs = llm.generate(PROMPTS, GREEDY)
    model = _hf_model(model_dir, torch.bfloat16)
    worst_gap = 0.0
    with torch.inference_mode():
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            assert len(output.token_ids) == NUM_NEW_TOKENS
            ids = torch.tensor([prompt + output.token_ids], device="cuda")
            logprobs = model(ids).logits[0].float().log_softmax(-1)
            # row t predicts token t + 1: rows of the prompt's last token and the outputs but the last
            rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + NUM_NEW_TOKENS]
            chosen = rows.gather(1, torch.tensor(output.token_ids, device="cuda")[:, None])[:, 0]
            gap = (rows.max(dim=1).values - chosen).max().item()
            worst_gap = max(worst_gap, gap)
    assert worst_gap <= BF16_LOGPROB_TOLERANCE, f"engine token trails HF argmax by {worst_gap:.3f} nats"
