"""An engine's KV events (issue 33, item 1): a real engine with CPU and disk tiers
publishes, and a real follower sees, the block hashes its GPU prefix cache holds and the
chunk keys its tiers hold, as a router would hash the same prompt; removals, a reset of
the prefix cache and a salted request's own keys too. Bad flags are refused."""

from __future__ import annotations

import time

import pytest

from connector import OffloadConfig
from engine import LLM, SamplingParams
from engine.block_manager import hash_block, root_hash
from kv_events.follower import KVEventFollower
from kv_events.messages import CPU, DISK, GPU
from tests.engine.hf_reference import random_prompt

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 16
CHUNK_SIZE = 32


def block_hashes(prompt: list[int], salt: str | None = None) -> list[str]:
    """The hex hashes of the prompt's full blocks, as the engine's prefix cache chains them."""
    parent, hashes = root_hash(salt), []
    for start in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block(parent, prompt[start : start + BLOCK_SIZE])
        hashes.append(parent.hex())
    return hashes


def until(condition, follower: KVEventFollower, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s ({follower.state.medium_to_keys})")
        follower.poll(0.05)


def test_the_engine_publishes_what_its_caches_hold(tiny_model_dir, tmp_path):
    config = OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=8 << 20, disk_path=str(tmp_path / "disk"), disk_bytes=64 << 20
    )
    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_offload=config,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        engine_id="replica-a",
    )
    publisher = llm.engine.kv_events
    follower = KVEventFollower(publisher.endpoint, publisher.replay_endpoint)
    try:
        token_db = llm.engine.offload_cache_engine.token_db
        prompt = random_prompt(100, seed=3)
        llm.generate([prompt], GREEDY)
        llm.flush_kv_offload()
        chunk_keys = [span.key for span in token_db.chunk_spans(prompt)]
        gpu_hashes = block_hashes(prompt)
        until(
            lambda: set(chunk_keys) <= follower.state.medium_to_keys.get(DISK, set()),
            follower,
            "the disk tier's chunks",
        )
        held = follower.state
        assert (held.engine_id, held.block_size, held.chunk_size) == ("replica-a", BLOCK_SIZE, CHUNK_SIZE)
        # a router hashing the prompt finds all of it in each medium
        assert held.num_leading(GPU, gpu_hashes) == len(gpu_hashes) == 6
        assert held.num_leading(CPU, chunk_keys) == len(chunk_keys) == 4  # 3 whole chunks, one partial
        # a salted request's KV is under other names: another tenant's prompt matches nothing
        salted = random_prompt(64, seed=4)
        llm.generate([{"prompt_token_ids": salted, "cache_salt": "tenant-b"}], GREEDY)
        salted_hashes = block_hashes(salted, "tenant-b")
        until(lambda: held.num_leading(GPU, salted_hashes) == 4, follower, "the salted blocks")
        assert held.num_leading(GPU, block_hashes(salted)) == 0
        salted_keys = [span.key for span in token_db.chunk_spans(salted, "tenant-b")]
        until(lambda: held.num_leading(CPU, salted_keys) == 2, follower, "the salted chunks")
        assert not {span.key for span in token_db.chunk_spans(salted)} & held.medium_to_keys[CPU]
        # a reset of the prefix cache clears the GPU medium, the tiers keep theirs
        assert llm.reset_prefix_cache()
        until(lambda: GPU not in held.medium_to_keys, follower, "the cleared GPU cache")
        assert held.num_leading(CPU, chunk_keys) == 4
        # a chunk deleted from the disk tier is reported gone
        disk = llm.engine.offload_cache_engine.tiers.lower[0]
        assert disk.delete(chunk_keys[1])
        until(lambda: held.num_leading(DISK, chunk_keys) == 1, follower, "the deleted disk chunk")
        assert follower.synced and follower.num_gaps == 0
    finally:
        follower.close()
        llm.engine.shutdown()
        llm.engine.runner.connector.close()


def test_a_follower_that_joins_late_gets_the_engines_state(tiny_model_dir, tmp_path):
    """The CPU tier evicts: a small one holds only the last prompts' chunks, and a follower
    started afterwards gets exactly what it holds from the snapshot."""
    slot_bytes = 2 * 2 * CHUNK_SIZE * 2 * 16 * 4  # the tiny model's chunk: 2 layers, 2 KV heads of 16
    config = OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=3 * slot_bytes)
    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_offload=config,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    try:
        cpu = llm.engine.offload_cache_engine.tiers.cpu
        assert cpu.num_slots == 3
        llm.generate([random_prompt(64, seed=seed) for seed in range(5)], GREEDY)
        llm.flush_kv_offload()
        time.sleep(0.2)  # a publishing interval or more
        publisher = llm.engine.kv_events
        follower = KVEventFollower(publisher.endpoint, publisher.replay_endpoint)
        follower.poll(0.0)
        assert follower.synced and follower.num_snapshots == 1
        assert follower.state.medium_to_keys[CPU] == set(cpu.keys()) and len(cpu.keys()) == 3
        follower.close()
    finally:
        llm.engine.shutdown()


def test_events_need_both_endpoints(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_events_endpoint and kv_events_replay_endpoint go together"):
        LLM(tiny_model_dir("llama"), dtype="float32", device="cpu", kv_events_endpoint="tcp://127.0.0.1:*")
