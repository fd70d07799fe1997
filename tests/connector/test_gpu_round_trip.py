"""On a CUDA GPU: store and retrieve through pinned CPU-tier slots, the mover's own
stream and the Triton pack/unpack kernels; bit-exact. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from connector import OffloadConfig, create_cache_engine

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 8, 128, 16, 128


def gpu_cache_engine(**fields):
    return create_cache_engine(
        OffloadConfig(**{"chunk_size": 256, "cpu_bytes": 256 << 20, **fields}),
        model_id="gpu-test",
        dtype=torch.bfloat16,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        device=torch.device("cuda"),
    )


def paged(fill=None, seed=0):
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if fill is not None:
        return torch.full(shape, fill, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16)


def shuffled_slots(num_tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    block_ids = torch.randperm(NUM_BLOCKS, generator=generator)
    slots = (block_ids[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
    return slots[:num_tokens].cuda()


@pytest.mark.gpu
def test_store_and_retrieve_on_cuda_are_bit_exact():
    engine = gpu_cache_engine()
    assert engine.tiers.cpu.pinned and all(piece.is_pinned() for piece in engine.tiers.cpu.pieces())
    num_tokens, start = 1500, 333  # 5 full chunks + a partial one; a non-aligned False prefix
    tokens = list(range(7, 7 + num_tokens))
    source, source_slots = paged(seed=1), shuffled_slots(num_tokens, 1)
    assert engine.store(tokens, kv_caches=source, slot_mapping=source_slots) == num_tokens
    target, target_slots = paged(fill=3.0), shuffled_slots(num_tokens, 2)
    mask = torch.arange(num_tokens) >= start
    ret_mask = engine.retrieve(tokens, mask, kv_caches=target, slot_mapping=target_slots)
    assert ret_mask.device.type == "cpu" and torch.equal(ret_mask, mask)
    got = target.flatten(2, 3)[:, :, target_slots].view(torch.int16)
    want = source.flatten(2, 3)[:, :, source_slots].view(torch.int16)
    assert torch.equal(got[:, :, start:], want[:, :, start:])
    assert bool((target.flatten(2, 3)[:, :, target_slots[:start]] == 3.0).all())
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device="cuda")
    untouched[target_slots] = False
    assert bool((target.flatten(2, 3)[:, :, untouched] == 3.0).all())
    engine.tiers.close()


@pytest.mark.gpu
@pytest.mark.parametrize("layerwise", [False, True])
def test_engine_on_cuda_reuses_offloaded_kv(tiny_model_dir, layerwise):
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (700, 257, 40)]
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        device="cuda",
        enable_prefix_caching=False,
        kv_offload=OffloadConfig(chunk_size=64, cpu_bytes=64 << 20, layerwise=layerwise),
    )
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert [o.metrics.num_external_cached_tokens for o in second] == [len(p) - 1 for p in prompts]
