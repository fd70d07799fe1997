"""The checkpoint reader (engine.models.weight_reader): every tensor lands where
safetensors' own reader puts it, the files are hashed as they are read (the digest equals
the fingerprint's), and bad files are errors naming them."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.tiny_model import make_tiny_model
from engine import LLM
from engine.models.fingerprint import WeightHashCache, file_digest, model_fingerprint
from engine.models.weight_reader import read_checkpoint


def write_shards(folder):
    generator = torch.Generator().manual_seed(0)
    shards = {
        "a.safetensors": {
            "w.x": torch.randn(64, 48, generator=generator),
            "w.bf16": torch.randn(40, 8, generator=generator).to(torch.bfloat16),
            "unused": torch.randn(3, generator=generator),
        },
        "b.safetensors": {"w.y": torch.randn(5, 7, 3, generator=generator), "w.ids": torch.arange(11)},
        "c.safetensors": {"w.z": torch.randn(1000, generator=generator).half()},
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    return sorted(folder.glob("*.safetensors"))


def targets():
    return {
        "w.x": torch.empty(64, 48),
        "w.bf16": torch.empty(40, 8),  # float32 from a bf16 file: converted
        "w.y": torch.empty(5, 7, 3),
        "w.ids": torch.empty(11, dtype=torch.int64),
        "w.z": torch.empty(1000, dtype=torch.float16),
    }


@pytest.mark.parametrize("max_threads", [1, 3])
def test_tensors_equal_safetensors_and_digests_equal_the_fingerprint(tmp_path, max_threads):
    files = write_shards(tmp_path / "ckpt")
    name_to_param = targets()
    stats, loaded = read_checkpoint(
        files, name_to_param, hash_paths=frozenset(files), max_threads=max_threads
    )
    assert loaded == set(name_to_param)
    for path in files:
        assert stats.path_to_digest[path] == file_digest(path)
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name in name_to_param:
                    expected = f.get_tensor(name).to(name_to_param[name].dtype)
                    assert torch.equal(name_to_param[name], expected), name
    assert stats.num_files == 3 and stats.num_threads == max_threads
    assert stats.num_bytes == sum(path.stat().st_size for path in files)  # every byte, hashed


def test_without_hashing_unused_tensors_are_not_read(tmp_path):
    files = write_shards(tmp_path / "ckpt")
    stats, _ = read_checkpoint(files, {"w.z": torch.empty(1000, dtype=torch.float16)})
    assert stats.path_to_digest == {} and stats.num_bytes < 1000 * 2 + 1000


def test_bad_files_are_errors_that_name_them(tmp_path):
    files = write_shards(tmp_path / "ckpt")
    with pytest.raises(
        ValueError, match=r"weight w\.x in a\.safetensors has shape \(64, 48\), expected \(48, 64\)"
    ):
        read_checkpoint(files, {"w.x": torch.empty(48, 64)})
    data = files[2].read_bytes()
    files[2].write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"c\.safetensors: tensor 'w\.z' ends past the end of the file"):
        read_checkpoint(files, targets())
    files[2].write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"c\.safetensors: a safetensors header of \d+ bytes does not fit"):
        read_checkpoint(files, targets())


def test_an_engine_hashes_while_it_reads_and_the_fingerprint_reads_nothing_again(tmp_path, monkeypatch):
    from connector import OffloadConfig

    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=3)
    monkeypatch.setenv("KVSTASH_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(
        model_dir, dtype="float32", device="cpu", kv_offload=OffloadConfig(cpu_bytes=1 << 24, chunk_size=64)
    )
    phases = llm.engine.startup.snapshot()
    assert {"weights", "fingerprint", "kv_cache", "tiers", "warmup"} <= set(phases)
    stats = llm.engine.startup.weight_read_stats
    assert stats.path_to_digest and stats.num_bytes >= sum(
        p.stat().st_size for p in model_dir.glob("*.safetensors")
    )
    # the digests the load recorded are the bytes' own: a fresh hash of a copy agrees
    copy = shutil.copytree(model_dir, tmp_path / "copy")
    fresh = model_fingerprint(copy, WeightHashCache(tmp_path / "other-cache"))
    cached = WeightHashCache(tmp_path / "cache")
    assert model_fingerprint(model_dir, cached) == fresh and cached.num_files_hashed == 0
    namespace = llm.engine.offload_cache_engine.token_db.namespace
    assert (
        namespace
        == LLM(
            copy, dtype="float32", device="cpu", kv_offload=OffloadConfig(cpu_bytes=1 << 24, chunk_size=64)
        ).engine.offload_cache_engine.token_db.namespace
    )
