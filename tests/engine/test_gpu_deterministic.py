"""`deterministic=True` on a real GPU in bfloat16 (marker `gpu`): the same tokens for a
request alone or in a batch, at any chunked-prefill budget, after a CPU-tier hit and
with speculation (n-gram and replayed drafts), with decode CUDA graphs on. A Llama-3.1-shaped model with
random weights, small enough to start in seconds (benchmarks/deterministic.py runs the
8B shape)."""

from __future__ import annotations

import pytest
import torch

from bench.presets import llama31_config
from benchmarks.deterministic import make_prompts
from connector import OffloadConfig
from engine import LLM, SamplingParams
from engine.spec_decode.replay import ReplayProposer

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CONFIG = llama31_config(
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=8192,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPTS = make_prompts(12, 100, 1200, CONFIG.vocab_size, seed=1)


def new_llm(**engine_args) -> LLM:
    # no start-up warm-up: its sweep of shape classes costs more GPU time than these runs
    args = {
        "warmup": False,
        "dtype": "bfloat16",
        "device": "cuda",
        "load_format": "dummy",
        "num_gpu_blocks": 2048,
        **engine_args,
    }
    return LLM(CONFIG, **args)


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    llm = new_llm(deterministic=True, enable_prefix_caching=False)
    return [llm.generate([p], PARAMS)[0].token_ids for p in PROMPTS]


def test_batch_and_budget_do_not_change_tokens(alone):
    llm = new_llm(deterministic=True)
    assert llm.engine.runner.decode_graphs is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == alone
    llm.reset_prefix_cache()
    llm.engine.scheduler.max_num_batched_tokens = 64
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == alone


def test_cpu_tier_hits_and_ngram_do_not_change_tokens(alone):
    llm = new_llm(deterministic=True, kv_offload=OffloadConfig(chunk_size=256, cpu_bytes=2 << 30))
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == alone
    llm.flush_kv_offload()
    llm.reset_prefix_cache()
    second = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in second] == alone
    assert sum(o.metrics.num_external_cached_tokens for o in second) > 0
    spec = new_llm(deterministic=True, speculative="ngram", num_speculative_tokens=4)
    assert [o.token_ids for o in spec.generate(PROMPTS, PARAMS)] == alone
    # A random-weight model rarely repeats itself, so n-gram drafts may be few: replayed
    # drafts (30% corrupted) make every step verify several tokens, some rejected.
    continuations = {tuple(p): t for p, t in zip(PROMPTS, alone, strict=True)}
    spec.engine.scheduler.proposer = ReplayProposer(4, continuations, CONFIG.vocab_size, corrupt_fraction=0.3)
    spec.reset_prefix_cache()
    assert [o.token_ids for o in spec.generate(PROMPTS, PARAMS)] == alone
    stats = spec.stats.spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
