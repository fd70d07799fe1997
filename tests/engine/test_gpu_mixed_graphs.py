"""Mixed CUDA graphs on a real GPU (marker `gpu`): steps of up to max_graph_tokens new
tokens that are not pure decodes replay a captured graph, and in float32 the tokens
equal those of the eager engine (`enforce_eager`): chunked prefill under a small
budget beside decodes, a prompt's suffix after a CPU-tier hit, and speculative
verification with n-gram and replayed drafts."""

from __future__ import annotations

import pytest

from engine import LLM, OffloadConfig, SamplingParams
from engine.mixed_graphs import token_buckets
from engine.spec_decode.replay import ReplayProposer
from tests.engine.hf_reference import random_prompt

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
#: fewer decode graphs and no warm-up: the engines start in seconds (neither changes a token)
FAST = {"dtype": "float32", "device": "cuda", "warmup": False, "max_num_seqs": 16}


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_chunked_prefill_beside_decodes_matches_eager(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    prompts = [random_prompt(n, seed=800 + n) for n in (700, 5, 130, 64, 1, 333)]
    kwargs = {**FAST, "max_num_batched_tokens": 96}
    expected = _tokens(LLM(model_dir, enforce_eager=True, **kwargs), prompts)
    llm = LLM(model_dir, **kwargs)
    runner = llm.engine.runner
    assert runner.mixed_graphs is not None and runner.mixed_graphs.buckets == token_buckets(96)
    assert llm.engine.step_times.graph_token_limit == 96
    assert _tokens(llm, prompts) == expected
    assert runner.step_kinds["mixed_graph"] > 5
    assert runner.step_kinds["eager"] == 0


def test_default_budget_uses_graphs_for_small_steps_only(tiny_model_dir):
    """Prompts of 1,100 and 600 tokens: the first step has 1,700 tokens (eager); the
    suffix of a prompt that shares a cached prefix replays a graph."""
    model_dir = tiny_model_dir("qwen2")
    shared = random_prompt(600, seed=810)
    first = [random_prompt(1100, seed=811), shared]
    second = [shared + random_prompt(40, seed=812)]
    eager = LLM(model_dir, enforce_eager=True, **FAST)
    expected = _tokens(eager, first), _tokens(eager, second)
    llm = LLM(model_dir, **FAST)
    assert llm.engine.runner.mixed_graphs.buckets[-1] == 512
    assert _tokens(llm, first) == expected[0]
    kinds = llm.engine.runner.step_kinds
    assert kinds["eager"] == 1
    assert _tokens(llm, second) == expected[1]
    assert kinds["eager"] == 1 and kinds["mixed_graph"] == 1


@pytest.mark.parametrize("layerwise,direct_host_loads", [(False, True), (False, False), (True, True)])
def test_suffix_after_a_cpu_tier_hit_matches_eager(tiny_model_dir, layerwise, direct_host_loads):
    """A suffix of 80, 3 or 1 token(s) after a CPU-tier hit replays a mixed graph (that
    waits per layer; even the one-token step, which a decode graph would run after the
    whole load) with the same tokens as eager steps, loaded directly from the pinned
    slots or through the staging buffers."""
    model_dir = tiny_model_dir("llama")
    prefix = random_prompt(512, seed=820)
    prompts = [prefix + random_prompt(n, seed=821 + n) for n in (80, 3, 1)]

    def run(**kwargs) -> tuple[list[list[int]], LLM]:
        offload = OffloadConfig(
            cpu_bytes=256 << 20, chunk_size=64, layerwise=layerwise, direct_host_loads=direct_host_loads
        )
        llm = LLM(model_dir, kv_offload=offload, **FAST, **kwargs)
        llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        llm.flush_kv_offload()
        llm.engine.runner.step_kinds.clear()
        tokens = []
        for prompt in prompts:  # one at a time: each loads the prefix from the CPU tier
            assert llm.reset_prefix_cache()
            output = llm.generate([prompt], GREEDY)[0]
            assert output.metrics.num_external_cached_tokens == 512
            tokens.append(output.token_ids)
        return tokens, llm

    expected, _ = run(enforce_eager=True)
    got, llm = run()
    assert got == expected
    kinds = llm.engine.runner.step_kinds
    if layerwise:  # its loads need the per-layer hooks: those steps run eagerly
        assert kinds["eager"] == len(prompts)
    else:
        assert kinds["mixed_graph"] == len(prompts) and kinds["eager"] == 0


def test_a_graph_waits_for_the_latest_record_of_an_external_event():
    """The mechanism behind a mixed graph's per-layer load waits: a captured wait on an
    external event waits, at each replay, for the record made before that replay on
    another stream (here one that spins ~tens of ms before writing the data)."""
    import torch

    event = torch.cuda.Event(external=True)
    event.record()
    source = torch.zeros(1 << 20, device="cuda")
    out = torch.empty_like(source)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.current_stream().wait_event(event)
        out.copy_(source)
    side = torch.cuda.Stream()
    for value in (1.0, 2.0):
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            source.fill_(value)
            event.record(side)
        graph.replay()
        torch.cuda.synchronize()
        assert bool((out == value).all())


REPLAY_PROMPTS = [random_prompt(n, seed=830 + n) for n in (40, 7, 300, 12)]


@pytest.fixture(scope="module")
def replay_case(tiny_model_dir):
    """The model and the eager plain engine's greedy tokens of REPLAY_PROMPTS (made once)."""
    model_dir = tiny_model_dir("qwen3")
    return model_dir, _tokens(LLM(model_dir, enforce_eager=True, **FAST), REPLAY_PROMPTS)


@pytest.mark.parametrize("corrupt_fraction", [0.0, 0.4, 1.0])
def test_replayed_drafts_match_plain_decoding(replay_case, corrupt_fraction):
    model_dir, expected = replay_case
    llm = LLM(model_dir, speculative="ngram", num_speculative_tokens=4, **FAST)
    llm.engine.scheduler.proposer = ReplayProposer(
        4,
        {tuple(p): c for p, c in zip(REPLAY_PROMPTS, expected, strict=True)},
        vocab_size=llm.engine.model_config.vocab_size,
        corrupt_fraction=corrupt_fraction,
        seed=9,
    )
    runner = llm.engine.runner
    assert runner.decode_graphs is not None and runner.mixed_graphs is not None
    assert _tokens(llm, REPLAY_PROMPTS) == expected
    assert runner.step_kinds["mixed_graph"] > 0
    assert runner.step_kinds["eager"] == 0
    if corrupt_fraction < 1.0:
        assert llm.stats.spec_decode.num_accepted_tokens > 0


def test_ngram_speculation_matches_plain_decoding(tiny_model_dir):
    model_dir = tiny_model_dir("mistral")
    text = random_prompt(24, seed=840)
    prompts = [text * 3, text[:10] + random_prompt(27, seed=841) + text[:10], [55]]
    expected = _tokens(LLM(model_dir, enforce_eager=True, **FAST), prompts)
    llm = LLM(model_dir, speculative="ngram", num_speculative_tokens=4, ngram_min_n=1, **FAST)
    assert _tokens(llm, prompts) == expected
    # random weights rarely continue an n-gram: drafts are verified, not necessarily accepted
    assert llm.stats.spec_decode.num_draft_tokens > 0
    assert llm.engine.runner.step_kinds["eager"] == 0


def test_bf16_graph_steps_mostly_agree_with_eager(tiny_model_dir):
    """bf16 reorders roundings between padded graph shapes and eager ones: exact
    equality is not promised (the deterministic mode promises it); the first tokens agree."""
    model_dir = tiny_model_dir("qwen3")
    prompts = [random_prompt(n, seed=850 + n) for n in (200, 17, 90)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kwargs = {**FAST, "dtype": "bfloat16", "max_num_batched_tokens": 64}
    expected = _tokens(LLM(model_dir, enforce_eager=True, **kwargs), prompts, params)
    got = _tokens(LLM(model_dir, **kwargs), prompts, params)
    assert sum(g[0] == e[0] for g, e in zip(got, expected, strict=True)) >= len(prompts) - 1
