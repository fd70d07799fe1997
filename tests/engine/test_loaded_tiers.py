"""`RequestOutput.metrics.tier_to_loaded_tokens`: where a request's loaded tokens came
from, per tier, on a real engine with a CPU and a disk tier (tiny float32 model)."""

from __future__ import annotations

import random

from connector import OffloadConfig
from engine import LLM, SamplingParams

CHUNK_SIZE = 64
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_loaded_tokens_are_attributed_to_the_tier_they_came_from(tiny_model_dir, tmp_path) -> None:
    config = OffloadConfig(
        chunk_size=CHUNK_SIZE,
        cpu_bytes=32 << 20,
        disk_path=str(tmp_path / "disk"),
        disk_bytes=64 << 20,
        # Every hit is loaded: the planner's fetch deadline (a fraction of the measured
        # recompute time, milliseconds here) must not turn a busy machine into a miss.
        load_policy="always",
    )
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", kv_offload=config)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(300)]

    (first,) = llm.generate([prompt], PARAMS)
    assert first.metrics.tier_to_loaded_tokens == {}  # nothing was loaded

    llm.flush_kv_offload()
    assert llm.reset_prefix_cache()
    (from_cpu,) = llm.generate([prompt], PARAMS)
    assert from_cpu.metrics.num_external_cached_tokens == 299
    assert from_cpu.metrics.tier_to_loaded_tokens == {"cpu": 299}

    # Forget the CPU copies: the same prompt now loads from the disk tier.
    tiers = llm.engine.offload_cache_engine.tiers
    llm.flush_kv_offload()
    for key in tiers.cpu.keys():  # noqa: SIM118 (a storage backend, not a mapping)
        assert tiers.cpu.delete(key)
    assert llm.reset_prefix_cache()
    (from_disk,) = llm.generate([prompt], PARAMS)
    assert from_disk.token_ids == first.token_ids
    assert from_disk.metrics.tier_to_loaded_tokens == {"disk": 299}

    stats = llm.engine.scheduler.connector.request_stats(from_disk.request_id)
    assert stats.tier_to_loaded_tokens == {"disk": 299} and stats.num_loaded_tokens == 299

    # The disk hit was promoted into the CPU tier: the next load reads it from there.
    assert llm.reset_prefix_cache()
    (promoted,) = llm.generate([prompt], PARAMS)
    assert promoted.metrics.tier_to_loaded_tokens == {"cpu": 299}
