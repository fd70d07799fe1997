"""On a CUDA GPU: saves finish after their step (published once their copies are done)
while decode steps replay CUDA graphs; tokens stay exact. Skipped without CUDA."""

from __future__ import annotations

import pytest

from connector import OffloadConfig


@pytest.mark.gpu
def test_async_saves_with_graphs_and_preemption_keep_tokens_exact(tiny_model_dir):
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 11 + n) % 480 + 5 for i in range(n)] for n in (300, 520, 129, 777, 64, 410)]
    common = dict(dtype="float32", device="cuda", num_gpu_blocks=96, max_num_batched_tokens=256)
    reference = LLM(str(tiny_model_dir("llama")), **common).generate(prompts, params)

    llm = LLM(
        str(tiny_model_dir("llama")),
        **common,
        kv_offload=OffloadConfig(chunk_size=64, cpu_bytes=64 << 20),
    )
    assert llm.engine.runner.decode_graphs is not None  # graphs replay with a connector too
    first = llm.generate(prompts, params)
    # 96 blocks of 16 cannot hold every request at once: some were preempted mid-save.
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [o.token_ids for o in first] == [o.token_ids for o in reference]

    llm.flush_kv_offload()  # publishes the saves still in flight
    assert llm.reset_prefix_cache()
    second = llm.generate(prompts, params)
    assert [o.token_ids for o in second] == [o.token_ids for o in reference]
    num_chunk_tokens = [len(p) - len(p) % 64 for p in prompts]
    assert all(
        o.metrics.num_external_cached_tokens >= min(n, len(p) - 1)
        for o, n, p in zip(second, num_chunk_tokens, prompts, strict=True)
    )

    # Alone, a fully stored prompt computes one token after its load: a graph replay
    # that waits for the loads on the device.
    llm.flush_kv_offload()
    assert llm.reset_prefix_cache()
    single = llm.generate([prompts[3]], params)[0]
    assert single.metrics.num_external_cached_tokens == len(prompts[3]) - 1
    assert single.token_ids == reference[3].token_ids
