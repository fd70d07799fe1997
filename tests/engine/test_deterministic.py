"""`deterministic=True` end to end on CPU in bfloat16: a request's tokens are the same
whether it runs alone or in a batch, whatever the chunked-prefill budget, with GPU
prefix-cache hits, with CPU-tier offload hits and with n-gram speculation.

Greedy and seeded sampled requests; a tiny Qwen3 (per-head q/k norms) and a tiny
Qwen2 (QKV bias) checkpoint. Tokens of a tiny random model have wide logit margins,
so the last test also checks the forward pass bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from connector import OffloadConfig
from engine import LLM, EngineArgs, SamplingParams
from engine.config import ModelConfig
from engine.deterministic import BatchInvariantLinear, make_batch_invariant
from engine.models import load_model
from kernels import fixed_order
from kernels.reference import reshape_and_cache_ref

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    """Six prompts: two share a 64-token prefix (prefix-cache hits), some repeat a
    pattern (n-gram drafts get proposed and accepted)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(64)]
    pattern = [rng.randrange(3, 500) for _ in range(7)]
    return [
        shared + [rng.randrange(3, 500) for _ in range(40)],
        [rng.randrange(3, 500) for _ in range(23)],
        pattern * 12,
        shared + [rng.randrange(3, 500) for _ in range(9)],
        [rng.randrange(3, 500) for _ in range(130)],
        [rng.randrange(3, 500) for _ in range(5)] + pattern * 4,
    ]


def sampling_params(num_prompts: int) -> list[SamplingParams]:
    """Greedy for even prompts, seeded temperature sampling for odd ones."""
    return [
        GREEDY
        if i % 2 == 0
        else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=i, ignore_eos=True)
        for i in range(num_prompts)
    ]


def run(model_dir, one_at_a_time: bool = False, **engine_args) -> list[list[int]]:
    args = {"dtype": "bfloat16", "device": "cpu", "deterministic": True, **engine_args}
    llm = LLM(str(model_dir), **args)
    prompts, params = make_prompts(), sampling_params(len(make_prompts()))
    if one_at_a_time:
        return [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def alone(model_dir) -> list[list[int]]:
    """Each request alone in the engine, whole prompt in one step, no prefix cache."""
    return run(model_dir, one_at_a_time=True, enable_prefix_caching=False)


def test_tokens_do_not_depend_on_the_batch_or_the_chunking(model_dir, alone):
    assert run(model_dir, max_num_batched_tokens=8192) == alone
    # chunks of at most 24 tokens, split differently for every prompt; prefix-cache hits
    assert run(model_dir, max_num_batched_tokens=24, max_num_seqs=3) == alone


def test_asynchronous_scheduling_keeps_the_tokens(model_dir, alone):
    assert run(model_dir, async_scheduling=True, max_num_batched_tokens=24) == alone


def test_weights_streamed_from_cpu_memory_keep_the_tokens(model_dir, alone):
    # the batch-invariant linear layers read the same parameters, views into the offload ring
    assert run(model_dir, cpu_offload_gb=0.0002, max_num_batched_tokens=24) == alone


def test_tokens_do_not_depend_on_the_batch_with_a_qkv_bias(tiny_model_dir):
    qwen2 = tiny_model_dir("qwen2")
    assert run(qwen2, max_num_batched_tokens=24) == run(
        qwen2, one_at_a_time=True, enable_prefix_caching=False
    )


def test_tokens_do_not_depend_on_speculation(model_dir, alone):
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        device="cpu",
        deterministic=True,
        speculative="ngram",
        num_speculative_tokens=3,
    )
    prompts = make_prompts()
    assert [o.token_ids for o in llm.generate(prompts, sampling_params(len(prompts)))] == alone
    assert llm.stats.spec_decode.num_verifications > 0


def test_tokens_do_not_depend_on_a_cpu_tier_hit(model_dir, alone):
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        device="cpu",
        deterministic=True,
        enable_prefix_caching=False,
        kv_offload=OffloadConfig(chunk_size=16, cpu_bytes=32 << 20),
    )
    prompts, params = make_prompts(), sampling_params(len(make_prompts()))
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == alone
    assert [o.token_ids for o in second] == alone
    assert all(o.metrics.num_external_cached_tokens > 0 for o in second)


def test_the_mode_swaps_the_linear_layers_and_is_off_by_default(model_dir):
    assert EngineArgs().deterministic is False
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        EngineArgs(deterministic="yes").validate()
    plain = LLM(str(model_dir), dtype="bfloat16", device="cpu")
    assert not any(isinstance(m, BatchInvariantLinear) for m in plain.engine.model.modules())
    det = LLM(str(model_dir), dtype="bfloat16", device="cpu", deterministic=True)
    names = {name for name, m in det.engine.model.named_modules() if isinstance(m, BatchInvariantLinear)}
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"} <= names
    # parameter names stay the checkpoint's (weight streaming and fingerprints read them)
    assert (
        dict(plain.engine.model.named_parameters()).keys() == dict(det.engine.model.named_parameters()).keys()
    )


def _hidden_states(model, sequences: list[list[int]], block_size: int = 8) -> list[torch.Tensor]:
    """The model's final hidden states of each sequence, all computed in one flat batch
    (every token of every sequence new, causal within its sequence) -> [len, hidden] each."""
    config = model.config
    blocks = [-(-len(s) // block_size) for s in sequences]
    kv_cache = torch.zeros(
        (config.num_layers, 2, sum(blocks), block_size, config.num_kv_heads, config.head_dim),
        dtype=model.model.embed_tokens.weight.dtype,
    )
    tables = torch.zeros((len(sequences), max(blocks)), dtype=torch.int32)
    slots, first_block = [], 0
    for row, (seq, num_blocks) in enumerate(zip(sequences, blocks, strict=True)):
        tables[row, :num_blocks] = torch.arange(first_block, first_block + num_blocks)
        slots.append(first_block * block_size + torch.arange(len(seq)))
        first_block += num_blocks
    slot_mapping = torch.cat(slots)
    seq_lens = torch.tensor([len(s) for s in sequences], dtype=torch.int32)
    starts = torch.tensor([0, *seq_lens.tolist()]).cumsum(0).int()

    def attention(layer_idx, query, key, value):
        reshape_and_cache_ref(key.contiguous(), value.contiguous(), kv_cache[layer_idx], slot_mapping)
        return fixed_order.paged_attention_rows(
            query, kv_cache[layer_idx], tables, seq_lens, starts, config.head_dim**-0.5
        )

    input_ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    with torch.inference_mode():
        hidden = model(input_ids, positions, attention)
    return list(hidden.split(seq_lens.tolist()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_layer_gives_a_sequence_the_same_bits_in_any_batch(model_dir, dtype):
    """The whole forward pass, bit for bit (tokens can hide differences that a tiny model's
    wide logit margins absorb). Without make_batch_invariant, float32 fails here on CPU:
    torch's batched GEMM rounds differently from its one-row GEMV."""
    model = load_model(ModelConfig.from_dir(model_dir), model_dir, torch.device("cpu"), dtype)
    make_batch_invariant(model)
    prompts = make_prompts()
    alone = _hidden_states(model, [prompts[0]])[0]
    batched = _hidden_states(model, [prompts[4], prompts[0], prompts[1]])[1]
    assert torch.equal(alone, batched)
    logits_alone = model.compute_logits(alone[-3:])
    logits_batched = model.compute_logits(torch.cat([batched[-3:], alone[:40]]))[:3]
    assert torch.equal(logits_alone, logits_batched)


def test_the_start_up_warm_up_compiles_every_tile_a_layer_can_meet(model_dir, monkeypatch):
    """warm_up_linear_tiles runs each (weight shape, tile) that any row count up to the
    bounds would pick -- layers up to the token budget, the LM head up to its rows -- once."""
    from triton.runtime.interpreter import InterpretedFunction

    from engine.deterministic import warm_up_linear_tiles
    from kernels import matmul

    if not isinstance(matmul._linear_kernel, InterpretedFunction):
        pytest.skip("the Triton GEMM runs on CPU through the interpreter only (TRITON_INTERPRET=1)")
    model = load_model(ModelConfig.from_dir(model_dir), model_dir, torch.device("cpu"), torch.bfloat16)
    make_batch_invariant(model)
    calls = []
    real_linear = matmul.linear

    def recording_linear(x, weight, bias=None, **kwargs):
        calls.append((tuple(weight.shape), matmul.tile_for(x.dtype, x.shape[0], weight.shape[0])))
        return real_linear(x, weight, bias, **kwargs)

    monkeypatch.setattr(matmul, "linear", recording_linear)
    max_rows, max_logit_rows = 1100, 20
    assert warm_up_linear_tiles(model, max_rows, max_logit_rows) == len(calls)
    vocab = model.config.hf_config.vocab_size
    expected = set()
    for module in model.modules():
        if isinstance(module, BatchInvariantLinear):
            bound = max_logit_rows if module.weight.shape[0] == vocab else max_rows
            shape = tuple(module.weight.shape)
            expected |= {(shape, matmul.tile_for(torch.bfloat16, m, shape[0])) for m in range(1, bound + 1)}
    assert len(calls) == len(set(calls)) and set(calls) == expected
    assert len({tile for _, tile in calls}) >= 3  # the plan's bands: decode, narrow, big


def test_the_cli_flag_reaches_engine_args():
    import click
    from click.testing import CliRunner

    from engine.engine_flags import engine_args_from_options, engine_options

    seen = {}

    @click.command()
    @engine_options
    def command(**options):
        seen.update(engine_args_from_options(options))

    assert CliRunner().invoke(command, ["--deterministic"]).exit_code == 0
    assert EngineArgs(**seen).deterministic is True
    assert CliRunner().invoke(command, []).exit_code == 0
    assert EngineArgs(**seen).deterministic is False


def test_row_wise_sampling_probs_do_not_depend_on_the_other_rows():
    from engine.sampler import sampling_probs

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7 + 0.1 * i, top_k=50 * i, top_p=1.0 - 0.1 * i) for i in range(5)]
    batched = sampling_probs(logits, params, row_wise=True)
    for i in range(5):
        assert torch.equal(batched[i], sampling_probs(logits[i : i + 1], [params[i]])[0])
        assert torch.equal(
            batched[i], sampling_probs(logits[[i, 0]], [params[i], params[0]], row_wise=True)[0]
        )
