"""The offload namespace names the weights, not the folder: KV of one checkpoint is
never served to another, even at the same path, and copies of one checkpoint share."""

from __future__ import annotations

import shutil

from connector import OffloadConfig
from engine import LLM, SamplingParams
from engine.models.fingerprint import model_fingerprint
from engine.tiny_model import make_tiny_model
from tests.engine.hf_reference import random_prompt

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_fingerprint_follows_the_weights(tmp_path):
    first = make_tiny_model(tmp_path / "a", arch="qwen2", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    other = make_tiny_model(tmp_path / "b", arch="qwen2", seed=2)
    assert model_fingerprint(first) == model_fingerprint(copy)
    assert model_fingerprint(first) != model_fingerprint(other)


def test_checkpoint_replaced_in_place_gets_no_stale_hits(tmp_path):
    model_dir = tmp_path / "model"
    offload = OffloadConfig(cpu_bytes=0, disk_path=str(tmp_path / "kv"), disk_bytes=1 << 28, chunk_size=64)
    prompt = random_prompt(200, seed=3)

    make_tiny_model(model_dir, arch="llama", seed=1)
    first = LLM(model_dir, dtype="float32", device="cpu", kv_offload=offload)
    first.generate([prompt], PARAMS)
    first.flush_kv_offload()
    again = LLM(model_dir, dtype="float32", device="cpu", kv_offload=offload).generate([prompt], PARAMS)[0]
    assert again.metrics.num_external_cached_tokens == 199  # same weights: disk hits

    make_tiny_model(model_dir, arch="llama", seed=2)  # new weights, same folder
    replaced = LLM(model_dir, dtype="float32", device="cpu", kv_offload=offload).generate([prompt], PARAMS)[0]
    reference = LLM(model_dir, dtype="float32", device="cpu").generate([prompt], PARAMS)[0]
    assert replaced.metrics.num_external_cached_tokens == 0
    assert replaced.token_ids == reference.token_ids
