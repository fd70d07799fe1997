"""On a CUDA device the engine runs attention through the Triton kernels and replays
decode steps as CUDA graphs; in float32 its greedy tokens still equal Hugging Face
`generate` (marker `gpu`)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import random_prompt

pytestmark = pytest.mark.gpu

PROMPTS = [random_prompt(n, seed=200 + n) for n in (1, 15, 16, 17, 100, 333, 600, 64)]


def hf_greedy_cuda(model_dir, prompts, max_new_tokens, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"enforce_eager": True}, {"max_num_batched_tokens": 64}, {"num_gpu_blocks": 42}],
)
def test_cuda_float32_greedy_matches_hf(tiny_model_dir, arch, engine_kwargs):
    model_dir = tiny_model_dir(arch)
    expected = hf_greedy_cuda(model_dir, PROMPTS, 32, torch.float32)
    llm = LLM(model_dir, dtype="float32", device="cuda", **engine_kwargs)
    assert (llm.engine.runner.decode_graphs is None) == bool(engine_kwargs.get("enforce_eager"))
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_mostly_agrees_with_hf(tiny_model_dir, dtype):
    """Half precision reorders roundings, so exact equality is not promised; the first
    tokens of most prompts still agree with HF in the same dtype."""
    model_dir = tiny_model_dir("qwen3")
    expected = hf_greedy_cuda(model_dir, PROMPTS, 4, getattr(torch, dtype))
    llm = LLM(model_dir, dtype=dtype, device="cuda")
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    num_first_equal = sum(o.token_ids[0] == e[0] for o, e in zip(outputs, expected, strict=True))
    assert num_first_equal >= len(PROMPTS) - 1


def test_dummy_8b_shaped_layer_runs_in_bf16():
    """The benchmark's in-memory config path with random weights (2 layers only)."""
    from benchmarks.engine_throughput import llama_config

    config = llama_config(tiny=False)
    config.num_hidden_layers = 2
    llm = LLM(config, load_format="dummy", device="cuda", dtype="bfloat16", num_gpu_blocks=512)
    prompts = [random_prompt(512, seed=i, vocab_size=config.vocab_size) for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outputs)


#: bf16 tolerance: the engine's token may trail HF's argmax by at most this many nats
BF16_LOGPROB_TOLERANCE = 0.15


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_cuda_bfloat16_tokens_are_hf_top_choices(tiny_model_dir, arch):
    """bf16 log-probs: every token the engine picks greedily is, by HF's own bf16
    log-probs on the same sequence, within BF16_LOGPROB_TOLERANCE of HF's best."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(arch)
    num_new = 24
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_batched_tokens=128)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    worst_gap = 0.0
    with torch.inference_mode():
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            ids = torch.tensor([prompt + output.token_ids], device="cuda")
            logprobs = model(ids).logits[0].float().log_softmax(-1)
            # row t predicts token t + 1
            rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + num_new]
            chosen = rows.gather(1, torch.tensor(output.token_ids, device="cuda")[:, None])[:, 0]
            worst_gap = max(worst_gap, (rows.max(dim=1).values - chosen).max().item())
    assert worst_gap <= BF16_LOGPROB_TOLERANCE, f"engine token trails HF argmax by {worst_gap:.3f} nats"
