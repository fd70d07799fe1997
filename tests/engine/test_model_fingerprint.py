"""The offload namespace names the weights, not the folder: KV of one checkpoint is
never served to another, even at the same path, and copies of one checkpoint share."""

from __future__ import annotations

import os
import shutil

from bench.tiny_model import make_tiny_model
from connector import OffloadConfig
from connector.token_db import namespace_fingerprint
from engine import LLM, SamplingParams
from engine.models.fingerprint import CACHE_FILE_NAME, WeightHashCache, file_digest, model_fingerprint
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
    # load_policy "always": this test is about namespaces, not the planner (whose disk prior
    # may prefer recomputing the tiny model's 199 tokens on a busy machine: 1 run in 3)
    offload = OffloadConfig(
        cpu_bytes=0, disk_path=str(tmp_path / "kv"), disk_bytes=1 << 28, chunk_size=64, load_policy="always"
    )
    prompt = random_prompt(200, seed=3)

    def generate_once() -> object:
        """One engine on the folder, closed afterwards (the disk tier locks its folder)."""
        llm = LLM(model_dir, dtype="float32", device="cpu", kv_offload=offload)
        output = llm.generate([prompt], PARAMS)[0]
        llm.engine.runner.connector.close()  # finishes the write-through, releases the folder
        return output

    make_tiny_model(model_dir, arch="llama", seed=1)
    generate_once()
    again = generate_once()
    assert again.metrics.num_external_cached_tokens == 199  # same weights: disk hits

    make_tiny_model(model_dir, arch="llama", seed=2)  # new weights, same folder
    replaced = generate_once()
    reference = LLM(model_dir, dtype="float32", device="cpu").generate([prompt], PARAMS)[0]
    assert replaced.metrics.num_external_cached_tokens == 0
    assert replaced.token_ids == reference.token_ids


def flip_middle_byte(path) -> None:
    """Change one byte in the middle of ``path``, keeping its size and restoring its mtime."""
    status = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))


def test_checkpoints_differing_in_one_middle_byte_get_different_namespaces(tmp_path):
    """Issue #17 item 3: the old fingerprint sampled 16 x 64 KiB per file, so in a file over
    1 MiB the middle byte was never read and a fine-tune there shared the original's KV."""
    import torch
    from safetensors.torch import save_file

    first = tmp_path / "a"
    first.mkdir()
    (first / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    weights = {"layer.weight": torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))}  # 4 MiB
    save_file(weights, str(first / "model.safetensors"))
    second = tmp_path / "b"
    shutil.copytree(first, second)
    flip_middle_byte(second / "model.safetensors")

    def namespace(folder):
        model_id = model_fingerprint(folder, WeightHashCache(tmp_path / "cache"))
        return namespace_fingerprint(
            model_id=model_id, dtype=torch.bfloat16, num_layers=2, num_kv_heads=2, head_dim=64, chunk_size=256
        )

    assert namespace(first) != namespace(second)
    assert namespace(first) == namespace(shutil.copytree(first, tmp_path / "copy"))


def test_engines_of_checkpoints_differing_in_one_byte_use_different_namespaces(tmp_path):
    first = make_tiny_model(tmp_path / "a", arch="llama", seed=1)
    second = tmp_path / "b"
    shutil.copytree(first, second)
    (weights,) = second.glob("*.safetensors")
    flip_middle_byte(weights)
    offload = OffloadConfig(cpu_bytes=1 << 24, chunk_size=64)
    namespaces = [
        LLM(
            folder, dtype="float32", device="cpu", kv_offload=offload
        ).engine.offload_cache_engine.token_db.namespace
        for folder in (first, second)
    ]
    assert namespaces[0] != namespaces[1]


def test_an_unchanged_file_is_not_read_again(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=1)
    cache_dir = tmp_path / "cache"
    read_paths = []

    def counting_digest(path):
        read_paths.append(path.name)
        return file_digest(path)

    first = WeightHashCache(cache_dir, hash_file=counting_digest)
    fingerprint = model_fingerprint(model_dir, first)
    assert first.num_files_hashed == len(read_paths) >= 1
    assert (cache_dir / CACHE_FILE_NAME).is_file()
    # A restart: a new cache object loads the file and reads no weight byte.
    read_paths.clear()
    restarted = WeightHashCache(cache_dir, hash_file=counting_digest)
    assert model_fingerprint(model_dir, restarted) == fingerprint
    assert read_paths == [] and restarted.num_files_hashed == 0


def test_changed_mtime_or_size_hashes_again_and_a_corrupt_cache_is_ignored(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=1)
    cache_dir = tmp_path / "cache"
    fingerprint = model_fingerprint(model_dir, WeightHashCache(cache_dir))
    (weights,) = model_dir.glob("*.safetensors")

    # Same bytes, new mtime: hashed again, same answer.
    status = weights.stat()
    os.utime(weights, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))
    cache = WeightHashCache(cache_dir)
    assert model_fingerprint(model_dir, cache) == fingerprint and cache.num_files_hashed == 1

    # One byte changed with the mtime put back (the cache cannot see it), then the size changes too.
    flip_middle_byte(weights)
    cache = WeightHashCache(cache_dir)
    assert model_fingerprint(model_dir, cache) == fingerprint and cache.num_files_hashed == 0
    with weights.open("ab") as file:
        file.write(b"\0")
    os.utime(weights, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))
    cache = WeightHashCache(cache_dir)
    assert model_fingerprint(model_dir, cache) != fingerprint and cache.num_files_hashed == 1
    assert len(WeightHashCache(cache_dir)._load()) == 1  # the file's older identities were dropped

    for garbage in (
        "not json",
        '{"format": "other"}',
        "[1, 2]",
        '{"format": "kvstash-weight-hashes-v1", "files": 3}',
    ):
        (cache_dir / CACHE_FILE_NAME).write_text(garbage)
        cache = WeightHashCache(cache_dir)
        model_fingerprint(model_dir, cache)
        assert cache.num_files_hashed == 1  # ignored, hashed, and the file is sound again
        assert WeightHashCache(cache_dir)._load()


def test_model_id_overrides_the_weight_hash(tmp_path):
    first = make_tiny_model(tmp_path / "a", arch="llama", seed=1)
    other = make_tiny_model(tmp_path / "b", arch="llama", seed=2)
    offload = OffloadConfig(cpu_bytes=1 << 24, chunk_size=64)

    def namespace(folder, **args):
        llm = LLM(folder, dtype="float32", device="cpu", kv_offload=offload, **args)
        return llm.engine.offload_cache_engine.token_db.namespace

    assert namespace(first) != namespace(other)
    # Two different checkpoints given one id share a namespace: the operator's responsibility.
    assert namespace(first, model_id="team/llama-ft-7") == namespace(other, model_id="team/llama-ft-7")
    assert namespace(first, model_id="team/llama-ft-7") != namespace(first)
    assert namespace(first, model_id="team/llama-ft-7") != namespace(first, model_id="team/llama-ft-8")
