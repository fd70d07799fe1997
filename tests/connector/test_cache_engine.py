"""CacheEngine on synthetic paged KV: every mask rule, partial chunks, missing and
corrupt chunks, and a property test of retrieve-after-store."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from storage_backends.disk_backend import key_to_filename
from tests.connector.kv_helpers import (
    NUM_SLOTS,
    make_cache_engine,
    new_kv_cache,
    random_slots,
    token_rows,
)

SENTINEL = 7.0


def mask_from(start: int, num_tokens: int) -> torch.Tensor:
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[:start] = False
    return mask


def stored(cache_engine, tokens, seed=0):
    """Store ``tokens`` from a random cache; returns (cache, slots)."""
    source = new_kv_cache(seed)
    slots = random_slots(len(tokens), seed)
    cache_engine.store(tokens, kv_caches=source, slot_mapping=slots)
    return source, slots


def retrieve_into_sentinel(cache_engine, tokens, mask, seed=1):
    target = new_kv_cache(fill=SENTINEL)
    slots = random_slots(len(tokens), seed)
    ret_mask = cache_engine.retrieve(tokens, mask, kv_caches=target, slot_mapping=slots)
    return target, slots, ret_mask


def assert_only_written(target, target_slots, written_token_ids, expected_rows):
    """Rows of ``written_token_ids`` equal ``expected_rows``; every other slot still holds the sentinel."""
    written_slots = target_slots[written_token_ids]
    torch.testing.assert_close(token_rows(target, written_slots), expected_rows, rtol=0, atol=0)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[written_slots] = False
    assert bool((target.flatten(2, 3)[:, :, untouched] == SENTINEL).all())


def test_retrieve_after_store_restores_every_token(cache_engine):
    tokens = list(range(100, 130))
    source, source_slots = stored(cache_engine, tokens)
    target, target_slots, ret_mask = retrieve_into_sentinel(cache_engine, tokens, None)
    assert ret_mask.dtype == torch.bool and ret_mask.device.type == "cpu" and bool(ret_mask.all())
    assert_only_written(target, target_slots, torch.arange(30), token_rows(source, source_slots))


def test_false_prefix_not_chunk_aligned_writes_only_true_tokens(cache_engine):
    tokens = list(range(100, 130))  # chunks [0,8) [8,16) [16,24) [24,30)
    source, source_slots = stored(cache_engine, tokens)
    target, target_slots, ret_mask = retrieve_into_sentinel(cache_engine, tokens, mask_from(13, 30))
    assert ret_mask.tolist() == [False] * 13 + [True] * 17
    # tokens 8..12 share chunk 1 with the loaded ones but are not rewritten
    assert_only_written(target, target_slots, torch.arange(13, 30), token_rows(source, source_slots[13:]))


def test_all_false_mask_retrieves_and_writes_nothing(cache_engine):
    tokens = list(range(20))
    stored(cache_engine, tokens)
    target, _, ret_mask = retrieve_into_sentinel(cache_engine, tokens, torch.zeros(20, dtype=torch.bool))
    assert not bool(ret_mask.any())
    assert bool((target == SENTINEL).all())


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.tensor([True, False] + [True] * 18), "F...FT...T"),
        (torch.tensor([False] * 5 + [True] * 5 + [False] * 10), "F...FT...T"),
        (torch.ones(19, dtype=torch.bool), "mask has 19 entries"),
        (torch.ones(20, dtype=torch.int64), "1-D bool tensor"),
        (torch.ones(2, 10, dtype=torch.bool), "1-D bool tensor"),
        ([True] * 20, "1-D bool tensor"),
    ],
)
def test_bad_masks_raise_and_lose_nothing(cache_engine, mask, message):
    tokens = list(range(20))
    stored(cache_engine, tokens)
    target = new_kv_cache(fill=SENTINEL)
    with pytest.raises(ValueError, match=message):
        cache_engine.retrieve(tokens, mask, kv_caches=target, slot_mapping=random_slots(20))
    with pytest.raises(ValueError, match=message):
        cache_engine.store(tokens, mask, kv_caches=target, slot_mapping=random_slots(20))
    assert bool((target == SENTINEL).all())
    assert cache_engine.lookup(tokens) == 20  # the stored chunks are still there, unchanged
    _, _, ret_mask = retrieve_into_sentinel(cache_engine, tokens, None)
    assert bool(ret_mask.all())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slot_mapping": random_slots(19)}, "slot_mapping has 19 entries"),
        ({"slot_mapping": random_slots(20).int()}, "slot_mapping must be int64"),
        ({"slot_mapping": random_slots(20).view(4, 5)}, "1-D int64"),
        ({"slot_mapping": torch.full((20,), NUM_SLOTS)}, r"must lie in \[0, 256\)"),
        ({"slot_mapping": torch.full((20,), -1)}, r"must lie in \[0, 256\)"),
        ({"kv_caches": new_kv_cache()[:1]}, "kv_caches has shape"),
        ({"kv_caches": new_kv_cache().half()}, "kv_caches has dtype"),
        ({"kv_caches": [new_kv_cache()[0], new_kv_cache()[1]]}, "kv_caches must be one tensor"),
    ],
)
def test_bad_slot_mapping_or_kv_caches_raise(cache_engine, change, message):
    tokens = list(range(20))
    arguments = {"kv_caches": new_kv_cache(), "slot_mapping": random_slots(20), **change}
    with pytest.raises(ValueError, match=message):
        cache_engine.store(tokens, **arguments)
    with pytest.raises(ValueError, match=message):
        cache_engine.retrieve(tokens, **arguments)
    assert cache_engine.lookup(tokens) == 0


def test_bad_token_ids_raise(cache_engine):
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 2\*\*32\)"):
        cache_engine.lookup([1, -2, 3])


def test_partial_chunk_is_keyed_on_its_own(cache_engine):
    tokens = list(range(100, 130))
    stored(cache_engine, tokens)
    assert cache_engine.lookup(tokens) == 30
    assert cache_engine.lookup(tokens[:29]) == 24  # 29 tokens end in another partial chunk
    assert cache_engine.lookup(tokens + [5, 6]) == 24  # so does a longer prompt
    assert cache_engine.lookup([1] + tokens[1:]) == 0  # chain hash: chunk 0 differs, all differ


def test_without_partial_chunks_the_tail_is_not_stored_nor_retrieved():
    cache_engine = make_cache_engine(save_partial_chunks=False)
    tokens = list(range(100, 130))
    source, source_slots = stored(cache_engine, tokens)
    assert cache_engine.lookup(tokens) == 24
    target, target_slots, ret_mask = retrieve_into_sentinel(cache_engine, tokens, mask_from(3, 30))
    assert ret_mask.tolist() == [False] * 3 + [True] * 21 + [False] * 6
    assert_only_written(target, target_slots, torch.arange(3, 24), token_rows(source, source_slots[3:24]))
    cache_engine.tiers.close()


def test_store_with_mask_stores_only_chunks_overlapping_the_true_region(cache_engine):
    tokens = list(range(32))
    source = new_kv_cache()
    cache_engine.store(tokens, mask_from(17, 32), kv_caches=source, slot_mapping=random_slots(32))
    keys = [span.key for span in cache_engine.token_db.chunk_spans(tokens)]
    assert cache_engine.lookup(tokens) == 0  # chunks 0 and 1 were not stored
    assert cache_engine.tiers.contains_prefix(keys[2:]) == 2


def test_missing_middle_chunk_ends_the_run_before_it(cache_engine):
    tokens = list(range(100, 132))  # four full chunks
    source, source_slots = stored(cache_engine, tokens)
    keys = [span.key for span in cache_engine.token_db.chunk_spans(tokens)]
    assert cache_engine.tiers.cpu.delete(keys[2])
    assert cache_engine.lookup(tokens) == 16
    target, target_slots, ret_mask = retrieve_into_sentinel(cache_engine, tokens, mask_from(5, 32))
    assert ret_mask.tolist() == [False] * 5 + [True] * 11 + [False] * 16
    # chunk 3 is present but comes after the gap: nothing of it is written
    assert_only_written(target, target_slots, torch.arange(5, 16), token_rows(source, source_slots[5:16]))


def test_corrupt_chunk_on_disk_is_a_miss_that_ends_the_run(tmp_path):
    writer = make_cache_engine(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=1 << 20)
    tokens = list(range(100, 132))
    source, source_slots = stored(writer, tokens)
    writer.tiers.close()  # finishes the write-through
    key = writer.token_db.chunk_spans(tokens)[1].key
    path = tmp_path / key_to_filename(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    reader = make_cache_engine(cpu_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 20)
    assert reader.lookup(tokens) == 32  # presence is cheap; the checksum is verified on read
    target, target_slots, ret_mask = retrieve_into_sentinel(reader, tokens, None)
    assert ret_mask.tolist() == [True] * 8 + [False] * 24
    assert_only_written(target, target_slots, torch.arange(8), token_rows(source, source_slots[:8]))
    assert reader.tiers.stats()["tiers"]["disk"]["corrupt"] >= 1
    reader.tiers.close()


def test_corrupt_chunk_in_redis_is_a_miss_that_ends_the_run(redis_url):
    import redis

    engine = make_cache_engine(cpu_bytes=0, remote_url=redis_url)
    tokens = list(range(100, 132))
    source, source_slots = stored(engine, tokens)
    engine.tiers.flush()
    key = engine.token_db.chunk_spans(tokens)[2].key
    client = redis.Redis.from_url(redis_url)
    (redis_key,) = [k for k in client.keys("*") if k.decode().endswith(key)]
    value = bytearray(client.get(redis_key))
    value[-3] ^= 0xFF
    client.set(redis_key, bytes(value))

    target, target_slots, ret_mask = retrieve_into_sentinel(engine, tokens, mask_from(4, 32))
    assert ret_mask.tolist() == [False] * 4 + [True] * 12 + [False] * 16
    assert_only_written(target, target_slots, torch.arange(4, 16), token_rows(source, source_slots[4:16]))
    engine.tiers.close()


def test_lookup_counts_chunks_spread_over_tiers(tmp_path):
    """Chunk 0 only on disk, chunk 1 in the CPU tier: both count (a contiguous prefix over tiers)."""
    engine = make_cache_engine(cpu_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 20)
    tokens = list(range(16))
    stored(engine, tokens)
    engine.tiers.flush()
    keys = [span.key for span in engine.token_db.chunk_spans(tokens)]
    engine.tiers.cpu.delete(keys[0])
    engine.tiers.lower[0].delete(keys[1])
    assert engine.lookup(tokens) == 16
    _, _, ret_mask = retrieve_into_sentinel(engine, tokens, None)
    assert bool(ret_mask.all())
    engine.tiers.close()


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    chunk_size=st.integers(1, 9),
    save_partial_chunks=st.booleans(),
    data=st.data(),
)
def test_retrieve_restores_exactly_the_true_tokens(num_tokens, chunk_size, save_partial_chunks, data):
    start = data.draw(st.integers(0, num_tokens), label="mask start")
    seed = data.draw(st.integers(0, 1000), label="seed")
    engine = make_cache_engine(chunk_size=chunk_size, save_partial_chunks=save_partial_chunks)
    tokens = data.draw(st.lists(st.integers(0, 50_000), min_size=num_tokens, max_size=num_tokens))
    source, source_slots = stored(engine, tokens, seed)
    target, target_slots, ret_mask = retrieve_into_sentinel(
        engine, tokens, mask_from(start, num_tokens), seed + 1
    )

    num_keyed = num_tokens if save_partial_chunks else num_tokens - num_tokens % chunk_size
    end = max(start, num_keyed)
    assert ret_mask.tolist() == [False] * start + [True] * (end - start) + [False] * (num_tokens - end)
    assert_only_written(
        target, target_slots, torch.arange(start, end), token_rows(source, source_slots[start:end])
    )
    engine.tiers.close()
