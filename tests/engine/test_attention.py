"""engine.attention: a step mixing paged sequences and whole-prompt prefills gives
the reference attention of the whole batch; the runner lays the batch out paged-first.

Runs the Triton kernel under the CPU interpreter (TRITON_INTERPRET=1, as CI does) and
on CUDA (gpu marker), with the fused SDPA path on the dense spans either way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine import attention
from kernels import reshape_and_cache
from kernels.paged_attention import _paged_attention_kernel
from kernels.reference import paged_attention_ref, reshape_and_cache_ref
from tests.kernels.cases import ATTENTION_TOLERANCES, attention_batch, random_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 16


def _device_cases():
    interpreted = isinstance(_paged_attention_kernel, InterpretedFunction)
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not interpreted, reason="needs TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]


def _mixed_step(device: str, dtype: torch.dtype, num_new: list[int], seq_lens: list[int], num_paged: int):
    """Sequences [0, num_paged) are paged, the rest whole prompts (num_new == seq_len)."""
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 4
    tables, seq_lens_t, starts = attention_batch(
        num_new, seq_lens, num_blocks, BLOCK_SIZE, seed=21, device=device
    )
    kv_layer = random_kv((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype, device, seed=22)
    num_tokens = sum(num_new)
    query = random_kv((num_tokens, NUM_HEADS, HEAD_DIM), dtype, device, seed=23)
    key = random_kv((num_tokens, NUM_KV_HEADS, HEAD_DIM), dtype, device, seed=24)
    value = random_kv((num_tokens, NUM_KV_HEADS, HEAD_DIM), dtype, device, seed=25)
    # The step's K/V go into the cache first, at each new token's position, as the runner does.
    slots = []
    for b, (n, length) in enumerate(zip(num_new, seq_lens, strict=True)):
        positions = torch.arange(length - n, length, device=device)
        slots.append(tables[b, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    reshape_and_cache_ref(key, value, kv_layer, torch.cat(slots))
    bounds = starts.tolist()
    metadata = attention.AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        seq_lens=seq_lens_t,
        query_start_loc=starts,
        max_query_len=max(num_new[:num_paged], default=1),
        max_seq_len=max(seq_lens),
        num_paged_seqs=num_paged,
        dense_spans=tuple((bounds[b], bounds[b + 1]) for b in range(num_paged, len(num_new))),
    )
    expected = paged_attention_ref(query, kv_layer, tables, seq_lens_t, starts, HEAD_DIM**-0.5)
    return (query, key, value, kv_layer, metadata), expected


@pytest.mark.parametrize("device", _device_cases())
@pytest.mark.parametrize(
    "num_new,seq_lens,num_paged",
    [
        ([5, 1, 40, 33], [60, 17, 40, 33], 2),  # prefix prefill and decode, then two whole prompts
        ([50, 20], [50, 20], 0),  # whole prompts only
        ([1, 1], [300, 9], 2),  # paged only (split-KV on CUDA)
    ],
)
def test_mixed_step_matches_reference(device, num_new, seq_lens, num_paged):
    dtype = torch.bfloat16
    args, expected = _mixed_step(device, dtype, num_new, seq_lens, num_paged)
    out = attention.attend(*args, HEAD_DIM**-0.5)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[dtype])


@pytest.mark.parametrize("device", _device_cases())
@pytest.mark.parametrize("num_paged", [2, 4])  # with a dense span after the paged ones; all paged
def test_a_step_checks_paged_inputs_at_its_first_layer_only(device, num_paged, monkeypatch):
    """The step's layers share one metadata: the paged kernel's shape/dtype/device checks run
    at the first layer, the others reuse them and the views (each layer's result unchanged)."""
    from kernels import validation

    num_new, seq_lens = [5, 1, 40, 33], [60, 17, 40, 33]
    if num_paged == 4:
        seq_lens = [60, 17, 52, 33]  # the third sequence over a prefix: paged
    args, expected = _mixed_step(device, torch.bfloat16, num_new, seq_lens, num_paged)
    query, key, value, kv_layer, metadata = args
    calls = []
    check = validation.check_attention_inputs
    monkeypatch.setattr(validation, "check_attention_inputs", lambda *a: calls.append(1) or check(*a))
    for _layer in range(3):
        out = attention.attend(query, key, value, kv_layer, metadata, HEAD_DIM**-0.5)
        torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCES[torch.bfloat16])
    assert len(calls) == 1
    views = metadata.paged_views()
    assert views is metadata.paged_views() and views.block_tables.shape[0] == num_paged
    # a step's first layer still rejects a bad input
    fresh = dataclasses.replace(metadata)  # a new step: nothing checked yet
    with pytest.raises(ValueError, match="head_dim"):
        attention.attend(query[..., :-1], key, value, kv_layer, fresh, HEAD_DIM**-0.5)


def test_dense_path_is_for_long_16_bit_whole_prompts_only():
    long_prompt = attention.DENSE_PREFILL_MIN_TOKENS
    assert attention.is_dense_prefill(0, long_prompt, 0, torch.bfloat16)
    assert not attention.is_dense_prefill(16, long_prompt, 0, torch.bfloat16)  # over a cached prefix
    assert not attention.is_dense_prefill(0, long_prompt - 1, 0, torch.float16)
    assert not attention.is_dense_prefill(0, long_prompt, 2, torch.bfloat16)  # with drafts
    assert not attention.is_dense_prefill(0, long_prompt, 0, torch.float32)  # float32 parity stays paged


@pytest.mark.parametrize("device", _device_cases()[:1])
def test_runner_lays_out_whole_prompts_after_paged_sequences(device, tiny_model_dir, monkeypatch):
    """The runner's paged-first layout with both paths live (the fused one opened to small
    float32 prompts here): greedy tokens equal the all-paged engine's, for prompts that are
    whole (fused), over a cached prefix (paged) and decoding (paged) in the same steps."""
    from engine import LLM, SamplingParams
    from tests.engine.hf_reference import random_prompt

    model_dir = tiny_model_dir("llama")
    shared = random_prompt(48, seed=500)
    # After the first prompt ran alone, one step holds a whole prompt listed first (fused) and
    # a short prompt and a prefix hit listed after it (paged): the runner moves it last.
    prompts = [shared + random_prompt(20, seed=502), random_prompt(30, seed=501), random_prompt(5, seed=503)]
    prompts.append(shared + random_prompt(9, seed=504))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]

    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=64)
    monkeypatch.setattr(attention, "DENSE_PREFILL_MIN_TOKENS", 16)
    monkeypatch.setattr(attention, "DENSE_PREFILL_DTYPES", (torch.float32,))
    # The CUDA path of the runner on CPU tensors: Triton kernels interpreted.
    monkeypatch.setattr(llm.engine.runner, "_on_cuda", True)
    monkeypatch.setattr(llm.engine.runner, "_reshape_and_cache", reshape_and_cache)
    num_dense_spans = []
    prepare = llm.engine.runner._prepare

    def counting_prepare(plan):
        host, rows = prepare(plan)
        num_dense_spans.append(len(host.dense_spans))
        return host, rows

    monkeypatch.setattr(llm.engine.runner, "_prepare", counting_prepare)
    outputs = [llm.generate(prompts[:1], params)[0].token_ids]  # caches the shared prefix
    later = llm.generate(prompts[1:], params)
    outputs += [o.token_ids for o in later]
    assert outputs == expected
    assert num_dense_spans[0] == 1 and num_dense_spans.count(1) == 2  # both whole prompts went fused
    assert later[-1].metrics.num_local_cached_tokens >= len(shared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_is_the_reference_bit_for_bit_and_validates_once(dtype, monkeypatch):
    """attend_reference = reshape_and_cache_ref + paged_attention_ref (torch.equal, cache
    included) at every layer of a step, with the metadata validated at its first layer."""
    from kernels import validation

    num_new, seq_lens = [5, 1, 40, 0, 33], [60, 17, 52, 9, 33]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 4
    tables, seq_lens_t, starts = attention_batch(
        num_new, seq_lens, num_blocks, BLOCK_SIZE, seed=31, device="cpu"
    )
    slots = []
    for b, (n, length) in enumerate(zip(num_new, seq_lens, strict=True)):
        positions = torch.arange(length - n, length)
        slots.append(tables[b, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    slot_mapping = torch.cat(slots)
    slot_mapping[3] = -1  # a token whose KV is already cached (a shared block): not rewritten
    metadata = attention.AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=seq_lens_t,
        query_start_loc=starts,
        max_query_len=max(num_new),
        max_seq_len=max(seq_lens),
        num_paged_seqs=len(num_new),
    )
    num_tokens = sum(num_new)
    calls = []
    check = validation.check_attention_values
    monkeypatch.setattr(validation, "check_attention_values", lambda *a: calls.append(1) or check(*a))
    for layer in range(3):
        kv_layer = random_kv(
            (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype, "cpu", seed=40 + layer
        )
        expected_kv = kv_layer.clone()
        query, key, value = (
            random_kv((num_tokens, heads, HEAD_DIM), dtype, "cpu", seed=50 + 3 * layer + i)
            for i, heads in enumerate((NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        )
        out = attention.attend_reference(layer, query, key, value, kv_layer, metadata, HEAD_DIM**-0.5)
        reshape_and_cache_ref(key, value, expected_kv, slot_mapping)
        expected = paged_attention_ref(query, expected_kv, tables, seq_lens_t, starts, HEAD_DIM**-0.5)
        assert torch.equal(kv_layer, expected_kv) and torch.equal(out, expected)
    assert len(calls) == 3 + 1  # the references' own three calls, and the plan's one
    # the same metadata object with new contents (a graph's buffers): layer 0 starts a new pass
    slot_mapping[7] = -1
    kv_layer = random_kv((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype, "cpu", seed=60)
    expected_kv = kv_layer.clone()
    attention.attend_reference(0, query, key, value, kv_layer, metadata, HEAD_DIM**-0.5)
    reshape_and_cache_ref(key, value, expected_kv, slot_mapping)
    assert torch.equal(kv_layer, expected_kv) and len(calls) == 5
    bad = dataclasses.replace(metadata, slot_mapping=slot_mapping + 10**6)
    with pytest.raises(ValueError, match="slot_mapping values"):
        attention.attend_reference(0, query, key, value, kv_layer, bad, HEAD_DIM**-0.5)


@pytest.mark.parametrize("device", _device_cases()[:1])
def test_runner_checks_cache_write_inputs_once_per_pass(device, tiny_model_dir, monkeypatch):
    """The runner's CUDA path (Triton kernels interpreted on CPU) checks the cache write's
    inputs at each pass's first layer only; tokens stay those of the CPU path."""
    from engine import LLM, SamplingParams
    from kernels import validation
    from tests.engine.hf_reference import random_prompt

    prompts = [random_prompt(23, seed=700), random_prompt(5, seed=701)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    expected = [
        o.token_ids
        for o in LLM(tiny_model_dir("llama"), dtype="float32", device="cpu").generate(prompts, params)
    ]
    llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cpu")
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "_on_cuda", True)
    monkeypatch.setattr(runner, "_reshape_and_cache", reshape_and_cache)
    checks, passes = [], []
    check = validation.check_slot_mapping
    monkeypatch.setattr(validation, "check_slot_mapping", lambda *a: checks.append(1) or check(*a))
    handle = llm.engine.model.register_forward_hook(lambda *_: passes.append(1))
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    handle.remove()
    assert outputs == expected
    assert llm.engine.model_config.num_layers > 1 and len(passes) >= 3 and len(checks) == len(passes)


@pytest.mark.parametrize("device", _device_cases()[:1])
def test_runner_fuses_rope_into_the_cache_write(device, tiny_model_dir, monkeypatch):
    """Layers whose RoPE is the one-launch kernel hand it to the runner's cache write
    (kernels.rotary_cache: one launch per layer for both), in eager steps and in decode
    replays (CUDA path, Triton kernels interpreted on CPU); float32 tokens stay the CPU
    path's."""
    from engine import LLM, SamplingParams
    from engine import model_runner as model_runner_module
    from engine.models.llama import Attention, fuse_rotary_into_attention
    from kernels.elementwise import rotary_qk
    from tests.engine.hf_reference import random_prompt
    from tests.engine.test_decode_graphs import EagerReplay

    prompts = [random_prompt(21, seed=710), random_prompt(6, seed=711)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = [
        o.token_ids
        for o in LLM(tiny_model_dir("llama"), dtype="float32", device="cpu").generate(prompts, params)
    ]
    llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cpu")
    runner, model = llm.engine.runner, llm.engine.model
    monkeypatch.setattr(runner, "_on_cuda", True)
    monkeypatch.setattr(runner, "_reshape_and_cache", reshape_and_cache)
    num_layers = llm.engine.model_config.num_layers
    assert fuse_rotary_into_attention(model) == 0  # torch's RoPE stays in the model
    for module in model.modules():
        if isinstance(module, Attention):
            module.rotary_impl = rotary_qk
    assert fuse_rotary_into_attention(model) == num_layers
    runner.decode_graphs = EagerReplay(
        runner._forward_with_metadata,
        attention.AttentionMetadata,
        runner.device,
        2,
        max_blocks_per_seq=8,
        max_seq_len=8 * runner.block_size,
    )
    calls = []
    fused = model_runner_module.rotary_and_cache
    monkeypatch.setattr(
        model_runner_module, "rotary_and_cache", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )
    monkeypatch.setattr(runner, "_reshape_and_cache", lambda *a, **k: pytest.fail("an unfused cache write"))
    passes = []
    handle = model.register_forward_hook(lambda *_: passes.append(1))
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    handle.remove()
    assert outputs == expected
    assert runner.decode_graphs.num_replays >= 3 and len(calls) == num_layers * len(passes)
