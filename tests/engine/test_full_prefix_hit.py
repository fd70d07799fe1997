"""A prompt whose every block is already in the GPU prefix cache computes only its
last token, reads that token's KV from the shared block and never rewrites it."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.engine.hf_reference import random_prompt

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_full_hit_computes_one_token_and_leaves_shared_blocks_alone(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cpu")
    block_size = llm.engine.block_manager.block_size
    prompt = random_prompt(4 * block_size, seed=400)  # exactly 4 full blocks
    first = llm.generate([prompt], GREEDY)[0]
    block_ids = [llm.engine.block_manager.hash_to_block_id[h] for h in _prompt_block_hashes(llm, prompt)]
    kv_cache = llm.engine.runner.kv_cache  # [layers, 2, blocks, block_size, heads, head_dim]
    # Mark the last prompt token's KV: a rewrite of the shared block would replace the mark.
    kv_cache[:, :, block_ids[-1], block_size - 1] *= 1.0 + 2**-20
    kv_before = kv_cache[:, :, block_ids].clone()
    computed_before = llm.stats.num_computed_tokens_total

    again = llm.generate([prompt], GREEDY)[0]

    assert again.token_ids == first.token_ids
    assert again.metrics.num_local_cached_tokens == len(prompt) - 1
    # the prompt step computed 1 token, then 5 decode steps
    assert llm.stats.num_computed_tokens_total - computed_before == 1 + 5
    assert kv_cache[:, :, block_ids].equal(kv_before)


def _prompt_block_hashes(llm: LLM, prompt: list[int]) -> list:
    from engine.block_manager import _ROOT_HASH, hash_block

    size = llm.engine.block_manager.block_size
    hashes, parent = [], _ROOT_HASH
    for start in range(0, len(prompt), size):
        parent = hash_block(parent, prompt[start : start + size])
        hashes.append(parent)
    return hashes


def test_full_hit_stores_nothing_the_tiers_hold(tiny_model_dir, tmp_path, caplog):
    """With a disk-only tier, a fully cached prompt saves no chunk again: the scheduler
    still asks the connector, whose answer says the tier holds every chunk."""
    import logging

    from engine import OffloadConfig

    offload = OffloadConfig(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=64 << 20, chunk_size=16)
    llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cpu", kv_offload=offload)
    prompt = random_prompt(4 * llm.engine.block_manager.block_size, seed=401)
    with caplog.at_level(logging.INFO, logger="engine.engine_core"):
        first = llm.generate([prompt], GREEDY)[0]
        llm.flush_kv_offload()
        again = llm.generate([prompt], GREEDY)[0]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("req=")]
    assert len(lines) == 2
    assert f"saved={len(prompt)}" in lines[0]
    assert f"gpu_hit={len(prompt) - 1}" in lines[1] and " saved=0 " in lines[1]
    assert again.token_ids == first.token_ids
