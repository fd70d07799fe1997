"""`cpu_offload_gb` on CUDA (marker `gpu`): offloaded layers in pinned host memory, copied
through a two-buffer device ring on a side stream, also inside the decode CUDA graphs.
Greedy tokens equal the engine's without offload; the KV pool grows by the device
memory the offloaded layers no longer take."""

from __future__ import annotations

import gc

import pytest
import torch

from bench.presets import llama31_config
from connector import OffloadConfig
from engine import LLM, SamplingParams
from engine.model_runner import kv_bytes_per_block
from tests.engine.test_weight_offload import GREEDY, PROMPTS, layer_gib, six_layer_config, token_ids

pytestmark = pytest.mark.gpu

#: start-up warm-up compiles every shape class; these tests need only what they run
FAST = {"device": "cuda", "warmup": False, "max_num_seqs": 4}


def close(llm: LLM) -> None:
    if llm.engine.runner.connector is not None:
        llm.engine.runner.connector.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def assert_offloaded_on_cuda(llm: LLM, num_layers: int) -> None:
    offloader = llm.engine.model.weight_offloader
    assert len(offloader.offloaded_layer_ids) == num_layers
    assert all(buffer.is_pinned() for buffer in offloader.host_buffers)
    assert all(buffer.is_cuda for buffer in offloader.ring)
    assert all(p.is_cuda for p in llm.engine.model.parameters())


@pytest.fixture(scope="module")
def qwen3_plain_tokens(tiny_model_dir) -> list[list[int]]:
    """Greedy float32 tokens of the engine without offload (graphs and eager agree in
    float32: both equal Hugging Face, tests/engine/test_gpu_parity.py)."""
    plain = LLM(tiny_model_dir("qwen3"), dtype="float32", **FAST)
    expected = token_ids(plain)
    close(plain)
    return expected


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_float32_greedy_tokens_identical_with_offload(tiny_model_dir, qwen3_plain_tokens, enforce_eager):
    """qwen3 (per-head q/k norms in the ring too), both layers offloaded; with decode CUDA
    graphs the layer copies are captured into the graphs and replayed."""
    model_dir = tiny_model_dir("qwen3")
    expected = qwen3_plain_tokens
    args = {**FAST, "dtype": "float32", "enforce_eager": enforce_eager}
    llm = LLM(model_dir, cpu_offload_gb=layer_gib(model_dir, 2), **args)
    assert_offloaded_on_cuda(llm, 2)
    assert (llm.engine.runner.decode_graphs is None) == enforce_eager
    assert token_ids(llm) == expected
    close(llm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_reuse_under_cuda_graphs(dtype):
    """Five of six layers through two ring buffers (each slot refilled twice per pass, the
    refill waiting for the layer that reads it), graphs on; bf16 runs the glue kernels."""
    config = six_layer_config()
    args = {**FAST, "load_format": "dummy", "dtype": dtype}
    plain = LLM(config, **args)
    expected = token_ids(plain)
    close(plain)
    llm = LLM(config, cpu_offload_gb=layer_gib(config, 5, getattr(torch, dtype)), **args)
    assert_offloaded_on_cuda(llm, 5)
    assert llm.engine.runner.decode_graphs is not None
    assert token_ids(llm) == expected
    close(llm)


def test_offload_with_speculative_decoding_and_layerwise_kv_loads(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    args = {**FAST, "dtype": "float32", "speculative": "ngram", "num_speculative_tokens": 3}
    plain = LLM(model_dir, **args)
    expected = token_ids(plain)
    close(plain)
    kv_offload = OffloadConfig(chunk_size=32, cpu_bytes=32 << 20, layerwise=True)
    llm = LLM(model_dir, cpu_offload_gb=layer_gib(model_dir, 2), kv_offload=kv_offload, **args)
    assert token_ids(llm) == expected
    llm.reset_prefix_cache()
    second = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in second] == expected
    assert sum(o.metrics.num_external_cached_tokens for o in second) > 0
    close(llm)


def _plain_pool(config, args: dict) -> tuple[int, int]:
    """(KV blocks, bytes per block) of an engine without offload, closed on return."""
    plain = LLM(config, **args)
    num_blocks = plain.engine.runner.kv_cache.shape[2]
    per_block = kv_bytes_per_block(plain.engine.model_config, 16, torch.bfloat16)
    close(plain)
    return num_blocks, per_block


def test_kv_pool_grows_by_the_freed_device_memory():
    """Llama-3.1-8B-shaped layers (six), bf16: offloading four of them frees two layers'
    worth of device memory (the ring keeps two), and the KV pool sized from free memory
    takes it."""
    config = llama31_config(num_hidden_layers=6)
    args = {
        **FAST,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "enforce_eager": True,
        "gpu_memory_utilization": 0.5,
        # 64 sequences: the pool is bounded by memory, not by max_num_seqs x max_model_len
        "max_num_seqs": 64,
    }
    free_before, _ = torch.cuda.mem_get_info()
    plain_blocks, per_block = _plain_pool(config, args)
    # The plain engine's last reference died with _plain_pool's frame (close() alone
    # cannot drop the caller's name: the H100 run kept 38 GB here before this helper).
    gc.collect()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after >= free_before - (256 << 20), "the first engine's memory was not given back"
    llm = LLM(config, cpu_offload_gb=layer_gib(config, 4, torch.bfloat16), **args)
    offloader = llm.engine.model.weight_offloader
    freed = offloader.num_offloaded_bytes - offloader.num_ring_bytes
    assert freed >= 800 << 20
    assert llm.engine.runner.kv_cache.shape[2] - plain_blocks >= 0.9 * freed // per_block
    outputs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outputs)
    close(llm)
