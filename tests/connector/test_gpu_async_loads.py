"""On a CUDA GPU: hits on disk are fetched into the pinned CPU tier in the background
and loaded in the admitting step; tokens stay exact whether everything was loaded,
recomputed, or split by a chunk missing midway. Skipped without CUDA."""

from __future__ import annotations

import pytest

from connector import OffloadConfig


@pytest.mark.gpu
def test_async_loads_from_disk_keep_tokens_exact_on_cuda(tiny_model_dir, tmp_path):
    from engine import LLM, SamplingParams
    from storage_backends.disk_backend import key_to_filename

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 13 + n) % 480 + 5 for i in range(n)] for n in (300, 520, 129, 777)]
    common = dict(dtype="float32", device="cuda", num_gpu_blocks=256, enable_prefix_caching=False)
    model = str(tiny_model_dir("llama"))
    reference = [o.token_ids for o in LLM(model, **common).generate(prompts, params)]

    def config(**fields):
        return OffloadConfig(chunk_size=64, cpu_bytes=64 << 20, disk_path=str(tmp_path), **fields)

    writer = LLM(model, **common, kv_offload=config())
    writer.generate(prompts, params)
    writer.flush_kv_offload()
    writer.engine.runner.connector.close()  # a disk folder takes one engine at a time

    loader = LLM(model, **common, kv_offload=config(load_policy="always"))
    outputs = loader.generate(prompts, params)
    assert [o.token_ids for o in outputs] == reference
    assert [o.metrics.tier_to_loaded_tokens for o in outputs] == [{"disk": len(p) - 1} for p in prompts]

    spans = loader.engine.offload_cache_engine.token_db.chunk_spans(prompts[3])
    loader.engine.runner.connector.close()
    (tmp_path / key_to_filename(spans[5].key)).unlink()  # a read that fails midway
    splitter = LLM(model, **common, kv_offload=config(load_policy="always"))
    split = splitter.generate(prompts[3:], params)[0]
    assert split.token_ids == reference[3]
    assert split.metrics.tier_to_loaded_tokens == {"disk": 5 * 64}


@pytest.mark.gpu
def test_pipelined_loads_from_a_slow_cache_server_keep_tokens_exact_on_cuda(tiny_model_dir):
    """The fetch's chunks are copied to the GPU as they arrive (several pieces, each in a
    step that computes nothing for the request), on the mover's CUDA stream; the tokens
    equal recompute's and those of the same hit loaded in one piece."""
    from benchmarks.support.cache_server_process import CacheServerProcess
    from benchmarks.support.delay_proxy import DelayProxy
    from engine import LLM, SamplingParams
    from tests.connector.test_pipelined_loads import step_until_loaded

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [(i * 17 + 3) % 480 + 5 for i in range(256)]
    common = dict(dtype="float32", device="cuda", num_gpu_blocks=256, enable_prefix_caching=False)
    model = str(tiny_model_dir("llama"))
    reference = LLM(model, **common).generate([prompt], params)[0].token_ids
    server = CacheServerProcess("--memory-gb", "0.25").start()
    try:
        with DelayProxy(server.port) as proxy:
            url = f"grpc://127.0.0.1:{proxy.port}?bulk=off"  # every value through the proxy

            def config(**fields):
                return OffloadConfig(
                    chunk_size=32, cpu_bytes=64 << 20, remote_url=url, remote_reads_in_flight=1, **fields
                )

            writer = LLM(model, **common, kv_offload=config())
            writer.generate([prompt], params)
            writer.flush_kv_offload()
            proxy.rate_bytes_per_s = 110_000  # a 16 KiB chunk takes ~0.15 s
            for pipelined in (True, False):
                loader = LLM(
                    model, **common, kv_offload=config(load_policy="always", pipelined_loads=pipelined)
                )
                loader.engine.add_request("hit", prompt, params)
                pieces = step_until_loaded(loader.engine, "hit")
                outputs = []
                while loader.engine.has_unfinished_requests():
                    outputs += [o for o in loader.engine.step() if o.finished]
                assert outputs[0].token_ids == reference
                assert outputs[0].metrics.tier_to_loaded_tokens == {"grpc": 255}
                assert (len(pieces) >= 2) if pipelined else (pieces == [])
                loader.engine.runner.connector.close()
    finally:
        server.close()
