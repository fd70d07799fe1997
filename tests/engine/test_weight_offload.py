"""`cpu_offload_gb` on CPU: the same code path as on CUDA (ring of "device" buffers that
are other CPU tensors, synchronous copies), so the bookkeeping is tested in CI. Greedy
float32 tokens equal the engine's without offload; bad values are clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from bench.presets import llama31_config
from connector import OffloadConfig
from engine import LLM, SamplingParams
from engine.config import EngineArgs, ModelConfig
from engine.models.weight_offload import GIB, pin_as_one_allocation, plan_weight_offload
from tests.engine.hf_reference import random_prompt

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
_SHARED = random_prompt(150, seed=7)
#: 1..150 tokens; two share a 96-token prefix (prefix caching) and one repeats itself (n-gram drafts)
PROMPTS = [
    random_prompt(1, seed=1),
    random_prompt(37, seed=2),
    _SHARED,
    _SHARED[:96] + random_prompt(20, seed=3),
    random_prompt(8, seed=4) * 6,
]


def six_layer_config():
    """A small in-memory Llama with six layers: offloading five of them reuses each slot
    of the two-buffer ring several times per pass."""
    return llama31_config(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
    )


def layer_gib(model, num_layers: int, dtype=torch.float32) -> float:
    """`num_layers` decoder layers of `model` (a folder or an in-memory config), in GiB."""
    config = (
        ModelConfig.from_dir(model)
        if not hasattr(model, "num_hidden_layers")
        else ModelConfig.from_hf_config(model)
    )
    return num_layers * plan_weight_offload(config, dtype, 0).bytes_per_layer / GIB


def token_ids(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(prompts, params)]


def test_plan_takes_the_most_whole_last_layers_that_fit():
    config = ModelConfig.from_hf_config(six_layer_config())
    empty = plan_weight_offload(config, torch.float32, 0)
    assert empty.offloaded_layer_ids == () and empty.num_offloaded_bytes == 0
    per_layer = empty.bytes_per_layer
    # q/k/v/o, gate/up/down, two norms of a 64-wide layer with 2 of 4 heads as KV, float32
    assert per_layer == 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 160 + 2 * 64)
    for num_bytes, expected in [
        (per_layer, (5,)),
        (2.5 * per_layer, (4, 5)),
        (6 * per_layer, (0, 1, 2, 3, 4, 5)),
        (empty.model_bytes, (0, 1, 2, 3, 4, 5)),  # more than the layers: all of them, not the embeddings
    ]:
        plan = plan_weight_offload(config, torch.float32, num_bytes / GIB)
        assert plan.offloaded_layer_ids == expected
        assert plan.num_offloaded_bytes == len(expected) * per_layer
    # bf16 layers are half the bytes: the same GiB holds twice the layers
    assert len(plan_weight_offload(config, torch.bfloat16, 2 * per_layer / GIB).offloaded_layer_ids) == 4


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, "8", None, True, [1]])
def test_bad_values_are_rejected_before_loading(value):
    with pytest.raises(ValueError, match="cpu_offload_gb must be a"):
        EngineArgs(cpu_offload_gb=value).validate()


def test_more_than_the_weights_or_less_than_a_layer_is_rejected(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    with pytest.raises(ValueError, match=r"cpu_offload_gb=1 is more than the model's weights \(0\.000"):
        LLM(model_dir, dtype="float32", device="cpu", cpu_offload_gb=1)
    with pytest.raises(ValueError, match="is less than one decoder layer"):
        LLM(model_dir, dtype="float32", device="cpu", cpu_offload_gb=layer_gib(model_dir, 1) / 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_identical_with_and_without_offload(tiny_model_dir, arch):
    """Each tiny checkpoint (two layers) with its last layer and with both layers offloaded,
    with chunked prefill (64-token budget) and prefix caching."""
    model_dir = tiny_model_dir(arch)
    engine_args = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 64}
    expected = token_ids(LLM(model_dir, **engine_args))
    for num_layers in (1, 2):
        llm = LLM(model_dir, cpu_offload_gb=layer_gib(model_dir, num_layers), **engine_args)
        offloader = llm.engine.model.weight_offloader
        assert offloader.offloaded_layer_ids == tuple(range(2 - num_layers, 2))
        assert token_ids(llm) == expected
        # every pass copied every offloaded layer once
        assert offloader.num_layer_copies == num_layers * llm.stats.num_steps


def test_ring_of_two_buffers_serves_five_layers():
    """Five of six layers offloaded: their parameters are views into the two ring buffers
    (layer j of the offloaded run in buffer j % 2); the resident layer keeps its own. The
    slots are refilled during the pass, and the tokens do not change."""
    config = six_layer_config()
    engine_args = {"load_format": "dummy", "dtype": "float32", "device": "cpu", "max_num_batched_tokens": 64}
    expected = token_ids(LLM(config, **engine_args))
    llm = LLM(config, cpu_offload_gb=layer_gib(config, 5), **engine_args)
    offloader = llm.engine.model.weight_offloader
    layers = llm.engine.model.model.layers
    assert offloader.offloaded_layer_ids == (1, 2, 3, 4, 5)
    assert len(offloader.ring) == 2 and len(offloader.host_buffers) == 5
    ring_ptrs = [buffer.untyped_storage().data_ptr() for buffer in offloader.ring]
    for j, layer_id in enumerate(offloader.offloaded_layer_ids):
        assert {p.untyped_storage().data_ptr() for p in layers[layer_id].parameters()} == {ring_ptrs[j % 2]}
    assert not {p.untyped_storage().data_ptr() for p in layers[0].parameters()} & set(ring_ptrs)
    assert token_ids(llm) == expected
    assert offloader.num_layer_copies == 5 * llm.stats.num_steps
    # the host buffers hold the weights: the ring's content after a pass is the last two layers'
    assert torch.equal(offloader.ring[0], offloader.host_buffers[4])
    assert torch.equal(offloader.ring[1], offloader.host_buffers[3])
    assert not torch.equal(offloader.host_buffers[0], offloader.host_buffers[2])


def test_offload_with_speculative_decoding_and_the_kv_connector():
    """n-gram drafts verified by offloaded layers; KV saved by one engine and loaded by the
    next through the connector's CPU tier (the KV of offloaded layers is the same KV)."""
    config = six_layer_config()
    engine_args = {
        "load_format": "dummy",
        "dtype": "float32",
        "device": "cpu",
        "speculative": "ngram",
        "num_speculative_tokens": 3,
    }
    expected = token_ids(LLM(config, **engine_args))
    kv_offload = OffloadConfig(chunk_size=32, cpu_bytes=32 << 20)
    llm = LLM(config, cpu_offload_gb=layer_gib(config, 4), kv_offload=kv_offload, **engine_args)
    assert token_ids(llm) == expected
    assert llm.stats.spec_decode.num_accepted_tokens > 0
    llm.reset_prefix_cache()
    second = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in second] == expected
    assert sum(o.metrics.num_external_cached_tokens for o in second) >= 150 - 32


def test_cli_flag(tiny_model_dir):
    """`kvstash generate --cpu-offload-gb`: a number of GiB offloads; text and negative
    values are usage errors that name the flag or the field."""
    from click.testing import CliRunner

    from engine.cli import main

    model_dir = tiny_model_dir("qwen3")
    base = ["generate", str(model_dir), "--prompt", "hello there", "--device", "cpu", "--dtype", "float32"]
    plain = CliRunner().invoke(main, base)
    assert plain.exit_code == 0, plain.output
    offloaded = CliRunner().invoke(main, [*base, "--cpu-offload-gb", repr(layer_gib(model_dir, 2))])
    assert offloaded.exit_code == 0, offloaded.output
    assert offloaded.output == plain.output
    not_a_number = CliRunner().invoke(main, [*base, "--cpu-offload-gb", "eight"])
    assert not_a_number.exit_code != 0
    assert "--cpu-offload-gb" in not_a_number.output and "'eight' is not a valid float" in not_a_number.output
    negative = CliRunner().invoke(main, [*base, "--cpu-offload-gb", "-1"])
    assert negative.exit_code != 0
    assert "cpu_offload_gb must be a finite number of GiB >= 0, got -1.0" in negative.output


def test_pinned_buffers_are_allocated_to_waste_the_least():
    """torch's caching host allocator rounds a pinned allocation up to a power of two."""
    llama_8b_layer = 436_207_616  # bf16 bytes: 512 MiB pinned each, 8 GiB for 19 in one
    assert pin_as_one_allocation(19, llama_8b_layer)
    assert not pin_as_one_allocation(3, 1 << 20)  # 3 x 1 MiB exactly; one would take 4 MiB
    assert pin_as_one_allocation(3, 5 << 20)  # 16 MiB instead of 3 x 8 MiB
