"""Shared helpers for engine tests: deterministic token-id prompts and the
Hugging Face greedy reference."""

from __future__ import annotations

from pathlib import Path

import torch

#: token ids used in random prompts: skip the tiny tokenizer's special tokens (0..4)
FIRST_PLAIN_TOKEN_ID = 5


def random_prompt(num_tokens: int, seed: int, vocab_size: int = 512) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PLAIN_TOKEN_ID, vocab_size, (num_tokens,), generator=generator).tolist()


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' own `generate` (float32, CPU), one
    prompt at a time (no padding), never stopping at EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs
