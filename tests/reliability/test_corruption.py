"""Stored chunks are damaged behind the engine's back: random byte flips, truncation,
a header of another format version, and a well-formed chunk of another dtype and
shape under the key. Disk files and Redis values, each the only tier.

Every damaged chunk must be detected (counted by the tier's checksum check or by
the cache engine's shape check) and logged once, every request must still produce
the reference's token ids (the damaged chunk is a miss that is recomputed), and hits
must come back once the engine has stored the chunks again.
"""

from __future__ import annotations

import logging
import random
import struct

import torch

from connector import OffloadConfig
from storage_backends.chunk import KVChunk, encode_chunk
from storage_backends.disk_backend import parse_record
from tests.reliability.engine_stream import (
    CHUNK_SIZE,
    StreamTally,
    cache_engine_of,
    make_prompts,
    new_llm,
    run_until_full_hits,
    tiers_of,
)

KINDS = ("flip", "truncate", "version", "foreign")
NUM_PROMPTS = 8
_VERSION_FIELD = struct.Struct("<H")  # the chunk header's format version, at offset 4


def damage(chunk_bytes: bytes, kind: str, rng: random.Random, key: str) -> bytes:
    """``chunk_bytes`` (one serialized chunk, stored under ``key``) damaged in the way ``kind`` names."""
    data = bytearray(chunk_bytes)
    if kind == "flip":
        for offset in rng.sample(range(len(data)), rng.randint(1, 3)):
            data[offset] ^= rng.randrange(1, 256)
        return bytes(data)
    if kind == "truncate":
        return bytes(data[: rng.randrange(1, len(data))])
    if kind == "version":
        (version,) = _VERSION_FIELD.unpack_from(data, 4)
        _VERSION_FIELD.pack_into(data, 4, version + 1)
        return bytes(data)
    # "foreign": a valid chunk, but float16 and half the tokens of what the engine expects
    foreign = torch.randn(
        2, 2, CHUNK_SIZE // 2, 2, 16, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))
    )
    return encode_chunk(KVChunk(foreign.to(torch.float16)), key=key)


def one_chunk_prompts(seed: int) -> list[list[int]]:
    """Prompts of one full chunk plus a few tokens: with partial chunks off, one stored key each."""
    return make_prompts(NUM_PROMPTS, seed=seed, min_tokens=CHUNK_SIZE + 4, max_tokens=CHUNK_SIZE + 12)


def config(**tiers) -> OffloadConfig:
    return OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=0, staging_bytes=0, save_partial_chunks=False, **tiers
    )


def corruption_scenario(llm, backend, prompts, reference, caplog, corrupt_all) -> dict:
    """Store, damage every stored value (``corrupt_all() -> kinds used``), serve, check detection."""
    tally = StreamTally()
    tally.run(llm, prompts, reference)
    tiers_of(llm).flush()
    kinds_used = corrupt_all()
    assert len(kinds_used) == len(prompts)
    corrupt_before = backend.stats()["corrupt"]
    caplog.clear()
    hits = tally.run(llm, prompts, reference)
    num_detected_by_tier = backend.stats()["corrupt"] - corrupt_before
    num_detected_by_engine = cache_engine_of(llm).num_corrupt_chunks
    assert hits == [0] * len(prompts), "a damaged chunk must never be loaded"
    assert num_detected_by_tier == len(kinds_used) - kinds_used.count("foreign")
    assert num_detected_by_engine == kinds_used.count("foreign")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == len(kinds_used), [r.getMessage() for r in warnings]  # one line per damaged chunk
    # With partial chunks off, a healthy store holds each prompt's one full chunk.
    num_rounds = run_until_full_hits(
        tally, llm, prompts, reference, expected_hits=[CHUNK_SIZE] * len(prompts)
    )
    tally.assert_clean()
    return {
        "num_requests": tally.num_requests,
        "num_failed": tally.num_failed,
        "num_tokens_compared": tally.num_tokens_compared,
        "num_tokens_differing": tally.num_tokens_differing,
        "num_corruptions_injected": len(kinds_used),
        "injected_by_kind": {kind: kinds_used.count(kind) for kind in KINDS},
        "num_corruptions_detected": num_detected_by_tier + num_detected_by_engine,
        "detected_by_checksum": num_detected_by_tier,
        "detected_by_shape_check": num_detected_by_engine,
        "warnings_logged": len(warnings),
        "rounds_until_hits_resumed": num_rounds,
    }


def test_disk_chunk_files_corrupted(model_dir, reference, reliability_report, caplog, tmp_path):
    folder = tmp_path / "kv"
    llm = new_llm(model_dir, config(disk_path=str(folder), disk_bytes=64 << 20))
    (disk,) = tiers_of(llm).lower
    rng = random.Random(31)

    def corrupt_all() -> list[str]:
        kinds = []
        for index, path in enumerate(sorted(folder.glob("*.kvc"))):
            kind = KINDS[index % len(KINDS)]
            record = path.read_bytes()
            key, chunk_offset = parse_record(record)  # the serialized chunk's place in the file
            path.write_bytes(record[:chunk_offset] + damage(record[chunk_offset:], kind, rng, key))
            kinds.append(kind)
        return kinds

    with caplog.at_level(logging.INFO):
        figures = corruption_scenario(llm, disk, one_chunk_prompts(32), reference, caplog, corrupt_all)
    reliability_report.record(
        "disk files corrupted", "byte flips, truncation, other format version, foreign dtype/shape", **figures
    )


def test_redis_values_corrupted(model_dir, reference, reliability_report, caplog, redis_url):
    import redis

    llm = new_llm(model_dir, config(remote_url=redis_url))
    (backend,) = tiers_of(llm).lower
    rng = random.Random(33)

    def corrupt_all() -> list[str]:
        kinds = []
        with redis.Redis.from_url(redis_url) as client:
            for index, key in enumerate(sorted(client.keys("kvstash:*"))):
                kind = KINDS[index % len(KINDS)]
                tier_key = key.decode().removeprefix("kvstash:")
                client.set(key, damage(client.get(key), kind, rng, tier_key))
                kinds.append(kind)
        return kinds

    with caplog.at_level(logging.INFO):
        figures = corruption_scenario(llm, backend, one_chunk_prompts(34), reference, caplog, corrupt_all)
    reliability_report.record(
        "redis values corrupted",
        "byte flips, truncation, other format version, foreign dtype/shape",
        **figures,
    )
