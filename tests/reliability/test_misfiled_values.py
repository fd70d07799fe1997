"""Issue #17 item 2: values swapped key for key behind the engine's back (Redis, the disk
tier's files, the cache server's Redis below it). Every serialized chunk carries a hash of its
key, so a misfiled value is a miss: nothing is loaded and every token equals recompute.

Before the key hash, two prompts whose values were swapped loaded each other's KV and produced
tokens that differ from recompute (each of these tests fails on that code).
"""

from __future__ import annotations

import logging

import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from connector import OffloadConfig
from connector.tier_probe import PROBE_KEY_SUFFIX
from storage_backends.disk_backend import parse_record
from tests.reliability.engine_stream import (
    CHUNK_SIZE,
    StreamTally,
    make_prompts,
    new_llm,
    run_until_full_hits,
    tiers_of,
)

NUM_PROMPTS = 6  # three swapped pairs
PROBE_KEY = PROBE_KEY_SUFFIX.encode()
REDIS_PREFIX = b"kvstash:"


def one_chunk_prompts(seed: int) -> list[list[int]]:
    """Prompts of one full chunk plus a few tokens: with partial chunks off, one stored key each."""
    return make_prompts(NUM_PROMPTS, seed=seed, min_tokens=CHUNK_SIZE + 4, max_tokens=CHUNK_SIZE + 12)


def config(**tiers) -> OffloadConfig:
    return OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=0, staging_bytes=0, save_partial_chunks=False, **tiers
    )


def store(model_dir, offload: OffloadConfig, prompts, reference) -> StreamTally:
    """A first engine serves ``prompts`` (storing one chunk each) and is shut down."""
    llm = new_llm(model_dir, offload)
    tally = StreamTally()
    assert tally.run(llm, prompts, reference) == [0] * len(prompts)
    tiers_of(llm).flush()
    tiers_of(llm).close()
    return tally


def serve_after_swap(model_dir, offload: OffloadConfig, prompts, reference, corrupt_counter) -> dict:
    """A second engine serves ``prompts`` over the swapped store: no hit, tokens equal recompute,
    then hits come back once it has stored the chunks again."""
    llm = new_llm(model_dir, offload)
    try:
        tally = StreamTally()
        hits = tally.run(llm, prompts, reference)
        assert hits == [0] * len(prompts), f"a misfiled value was loaded: hits {hits}"
        num_detected = corrupt_counter(llm)
        tiers_of(llm).flush()
        num_rounds = run_until_full_hits(
            tally, llm, prompts, reference, expected_hits=[CHUNK_SIZE] * len(prompts)
        )
        tally.assert_clean()
        return {
            "num_requests": tally.num_requests,
            "num_tokens_compared": tally.num_tokens_compared,
            "num_tokens_differing": tally.num_tokens_differing,
            "num_detected": num_detected,
            "rounds_until_hits_resumed": num_rounds,
        }
    finally:
        tiers_of(llm).close()


def swap_redis_values(redis_url: str, keys: list[bytes] | None = None) -> int:
    """Swap the values of kvstash's keys (``keys``: these Redis keys only) pairwise with
    RENAME on the real server; returns how many moved."""
    import redis

    with redis.Redis.from_url(redis_url) as client:
        if keys is None:
            # chunk keys only: an engine of an earlier test that is not collected yet may
            # still measure this Redis under its probe key (connector.tier_probe)
            keys = [key for key in client.keys(REDIS_PREFIX + b"*") if not key.endswith(PROBE_KEY)]
        keys = sorted(keys)
        assert len(keys) == NUM_PROMPTS and all(client.exists(key) for key in keys), keys
        for first, second in zip(keys[0::2], keys[1::2], strict=True):
            parked = first + b".parked"
            client.rename(first, parked)
            client.rename(second, first)
            client.rename(parked, second)
        # and one more misfiling by GET/SET: a copy of the first value over the last key
        client.set(keys[-1], client.get(keys[0]))
    return len(keys)


def test_redis_values_swapped_key_for_key(model_dir, reference, reliability_report, caplog, redis_url):
    prompts = one_chunk_prompts(71)
    store(model_dir, config(remote_url=redis_url), prompts, reference)
    num_swapped = swap_redis_values(redis_url)

    def corrupt(llm) -> int:
        (redis_tier,) = tiers_of(llm).lower
        return redis_tier.stats()["corrupt"]

    with caplog.at_level(logging.WARNING):
        figures = serve_after_swap(model_dir, config(remote_url=redis_url), prompts, reference, corrupt)
    assert figures["num_detected"] == num_swapped
    assert sum("corrupt value" in r.getMessage() for r in caplog.records) >= num_swapped
    reliability_report.record("redis values swapped key for key", "RENAME/GET/SET on redis-server", **figures)


def test_disk_files_swapped_key_for_key(model_dir, reference, reliability_report, tmp_path):
    folder = tmp_path / "kv"
    offload = config(disk_path=str(folder), disk_bytes=64 << 20)
    prompts = one_chunk_prompts(73)
    store(model_dir, offload, prompts, reference)
    paths = sorted(folder.glob("*.kvc"))
    assert len(paths) == NUM_PROMPTS

    def split(path) -> tuple[bytes, bytes]:
        record = path.read_bytes()
        _, chunk_offset = parse_record(record)  # record header, key and padding | serialized chunk
        return record[:chunk_offset], record[chunk_offset:]

    # Each file keeps its own record header (key, file name) but gets its partner's chunk.
    for first, second in zip(paths[0::2], paths[1::2], strict=True):
        (first_head, first_chunk), (second_head, second_chunk) = split(first), split(second)
        first.write_bytes(first_head + second_chunk)
        second.write_bytes(second_head + first_chunk)

    def corrupt(llm) -> int:
        (disk_tier,) = tiers_of(llm).lower
        return disk_tier.stats()["corrupt"]

    figures = serve_after_swap(model_dir, offload, prompts, reference, corrupt)
    assert figures["num_detected"] == NUM_PROMPTS
    reliability_report.record(
        "disk chunks swapped key for key", "chunk bytes exchanged between files", **figures
    )


@pytest.fixture
def server_over_redis(redis_url):
    """A cache server with a small memory tier and the session's Redis below it."""
    server = CacheServerProcess("--memory-gb", "0.1", "--redis-url", redis_url)
    yield server
    server.close()


def test_cache_server_values_swapped_key_for_key(
    model_dir, reference, reliability_report, redis_url, server_over_redis
):
    import grpc

    from protos import kvstash_pb2
    from tests.cache_server.helpers import Stubs

    server = server_over_redis.start()
    prompts = one_chunk_prompts(75)
    store(model_dir, config(remote_url=server.url), prompts, reference)
    with Stubs(server.address) as stubs:
        keys = [
            entry.key for entry in stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(), timeout=10).entries
        ]
        assert len(keys) == NUM_PROMPTS
        # A client that Puts one key's value under another is refused and stores nothing.
        with pytest.raises(grpc.RpcError) as refused:
            stubs.put(keys[1], stubs.get(keys[0]))
        assert (
            refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "another key" in refused.value.details()
        )
    # Swapped in the Redis below the server, then the server restarts with an empty memory tier.
    assert server.stop() == 0
    # the keys the server listed (its Redis keys carry the backend's prefix). A CI run once
    # listed a seventh key: the planner's probe value, whose write had outlasted the engine's
    # close (tests/connector/test_slow_remote.py now covers that)
    num_swapped = swap_redis_values(redis_url, [REDIS_PREFIX + key.encode() for key in keys])
    server.start()

    def refused_by_server(llm) -> int:
        (grpc_tier,) = tiers_of(llm).lower
        assert grpc_tier.stats()["misses"] >= NUM_PROMPTS
        return num_swapped

    figures = serve_after_swap(
        model_dir, config(remote_url=server.url), prompts, reference, refused_by_server
    )
    assert server.log().count("corrupt value") >= num_swapped, server.log()
    reliability_report.record(
        "cache server values swapped key for key",
        "Put of another key's value; RENAME in the Redis below the server",
        **figures,
    )
