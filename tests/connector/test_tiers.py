"""Tier manager behaviour through the cache engine: pins, pin timeouts, promotion,
write-through, a full write queue and failing tiers."""

from __future__ import annotations

import logging
import os
import signal

import torch

from tests.connector.kv_helpers import make_cache_engine, new_kv_cache, random_slots, token_rows
from tests.waiting import wait_until

CHUNK_BYTES = 2 * 2 * 8 * 2 * 4 * 4  # [layers, K/V, chunk_size, heads, head_dim] float32


def seq(first: int, num_tokens: int = 8) -> list[int]:
    return list(range(first, first + num_tokens))


def store(engine, tokens, seed=0):
    engine.store(tokens, kv_caches=new_kv_cache(seed), slot_mapping=random_slots(len(tokens), seed))


def retrieve(engine, tokens):
    return engine.retrieve(
        tokens, kv_caches=new_kv_cache(fill=0.0), slot_mapping=random_slots(len(tokens), 9)
    )


def test_pinned_chunk_survives_eviction_pressure_until_retrieved():
    engine = make_cache_engine(cpu_bytes=2 * CHUNK_BYTES)
    store(engine, seq(0))
    assert engine.lookup(seq(0), pin=True) == 8
    for first in (100, 200, 300, 400):
        store(engine, seq(first))
    assert engine.lookup(seq(0)) == 8  # survived four stores into a two-slot tier
    assert engine.lookup(seq(300)) == 0 and engine.lookup(seq(400)) == 8
    assert bool(retrieve(engine, seq(0)).all())  # the retrieve releases the pin
    store(engine, seq(500))
    store(engine, seq(600))
    assert engine.lookup(seq(0)) == 0
    engine.tiers.close()


def test_pins_expire_after_the_timeout():
    clock = [0.0]
    engine = make_cache_engine(cpu_bytes=2 * CHUNK_BYTES, pin_timeout_s=5.0)
    engine.tiers._clock = lambda: clock[0]
    store(engine, seq(0))
    engine.lookup(seq(0), pin=True)
    clock[0] = 4.0
    store(engine, seq(100))
    store(engine, seq(200))
    assert engine.lookup(seq(0)) == 8 and engine.tiers.num_pinned() == 1
    clock[0] = 5.5
    store(engine, seq(300))
    store(engine, seq(400))
    assert engine.lookup(seq(0)) == 0
    assert engine.tiers.num_pinned() == 0 and engine.tiers.stats()["expired_pins"] == 1
    engine.tiers.close()


def test_store_into_a_fully_pinned_cpu_tier_is_dropped_and_counted():
    engine = make_cache_engine(cpu_bytes=CHUNK_BYTES)
    store(engine, seq(0))
    engine.lookup(seq(0), pin=True)
    store(engine, seq(100))  # no room: dropped, no exception
    assert engine.lookup(seq(100)) == 0 and engine.lookup(seq(0)) == 8
    assert engine.tiers.stats()["dropped_writes_cpu"] == 1
    engine.tiers.close()


def test_lower_tier_hit_is_promoted_to_cpu(tmp_path):
    engine = make_cache_engine(cpu_bytes=2 * CHUNK_BYTES, disk_path=str(tmp_path), disk_bytes=1 << 20)
    for first in (0, 100, 200):
        store(engine, seq(first))
        engine.tiers.flush()  # chunks being written through stay pinned until written
    key = engine.token_db.chunk_spans(seq(0))[0].key
    assert engine.tiers.cpu.contains([key]) == 0  # evicted from CPU, still on disk
    assert engine.lookup(seq(0)) == 8
    assert bool(retrieve(engine, seq(0)).all())
    assert engine.tiers.cpu.contains([key]) == 1
    assert engine.tiers.stats()["promotions"] == 1 and engine.tiers.stats()["hits_disk"] == 1
    engine.tiers.close()


def test_write_through_reaches_every_lower_tier(tmp_path, redis_url):
    engine = make_cache_engine(disk_path=str(tmp_path), disk_bytes=1 << 20, remote_url=redis_url, codec="lz4")
    tokens = seq(0, 30)
    source = new_kv_cache(3)
    engine.store(tokens, kv_caches=source, slot_mapping=random_slots(30, 3))
    engine.tiers.flush()
    keys = [span.key for span in engine.token_db.chunk_spans(tokens)]
    disk, redis_tier = engine.tiers.lower
    assert disk.contains(keys) == 4 and redis_tier.contains(keys) == 4
    engine.tiers.close()

    # A new engine that only has the remote tier gets every token back, byte-exact.
    remote_only = make_cache_engine(cpu_bytes=0, remote_url=redis_url, codec="lz4")
    target = new_kv_cache(fill=0.0)
    slots = random_slots(30, 4)
    assert bool(remote_only.retrieve(tokens, kv_caches=target, slot_mapping=slots).all())
    expected = source.flatten(2, 3)[:, :, random_slots(30, 3)]
    assert torch.equal(target.flatten(2, 3)[:, :, slots], expected)
    remote_only.tiers.close()


def test_full_write_queue_drops_lower_tier_writes_instead_of_stalling(restartable_redis):
    engine = make_cache_engine(
        cpu_bytes=64 * CHUNK_BYTES, remote_url=restartable_redis.url + "?timeout=10", save_queue_size=2
    )
    os.kill(restartable_redis.process.pid, signal.SIGSTOP)  # Redis hangs: writes block in the writer thread
    try:
        for index in range(10):
            store(engine, seq(1000 * index))  # returns at once although Redis does not answer
        # The blocked writer holds one batch (at most 1 + queue size items), the queue two more.
        assert engine.tiers.counters()["dropped_writes"] >= 10 - (1 + 2) - 2
        assert all(engine.lookup(seq(1000 * index)) == 8 for index in range(10))  # the CPU tier has all
    finally:
        os.kill(restartable_redis.process.pid, signal.SIGCONT)
    engine.tiers.close()


def test_failing_tier_is_a_miss_counted_and_logged_once(caplog):
    engine = make_cache_engine(remote_url="redis://127.0.0.1:1/0?timeout=0.5")
    with caplog.at_level(logging.WARNING, logger="connector.tiers"):
        store(engine, seq(0))
        engine.tiers.flush()
        for _ in range(3):
            assert engine.lookup(seq(500)) == 0
        assert engine.lookup(seq(0)) == 8  # the CPU tier still serves
        assert bool(retrieve(engine, seq(0)).all())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "tier redis" in r.getMessage()]
    assert len(warnings) == 1
    stats = engine.tiers.stats()
    assert stats["dropped_writes_redis"] == 1
    assert stats["tiers"]["redis"]["connector_errors"] >= 4
    engine.tiers.close()


def test_a_store_with_a_private_buffer_never_publishes_another_stores_slot(tmp_path):
    """Issue #17 item 1: store A of key K gets a private buffer (the CPU tier is full of
    pins); a pin is released; store B of K reserves the slot; A finishes first. A must not
    publish B's slot, whose copy has not landed: K stays invisible until B finishes."""
    engine = make_cache_engine(cpu_bytes=CHUNK_BYTES, disk_path=str(tmp_path), disk_bytes=1 << 20)
    store(engine, seq(100))  # the slot's previous occupant
    engine.tiers.flush()
    engine.lookup(seq(100), pin=True)
    kv, slots = new_kv_cache(3), random_slots(8, 3)
    store_a = engine.begin_store(seq(0), 0, kv_caches=kv, slot_mapping=slots)  # private buffer
    assert engine.tiers.stats()["dropped_writes_cpu"] == 1
    engine.tiers.unpin([span.key for span in engine.token_db.chunk_spans(seq(100))])
    store_b = engine.begin_store(seq(0), 0, kv_caches=kv, slot_mapping=slots)  # reserves the slot
    assert store_a.num_stored_tokens == store_b.num_stored_tokens == 8
    key = engine.token_db.chunk_spans(seq(0))[0].key
    engine.finish_store(store_a)
    # On CUDA B's device->host copy may still be running: its slot must not be readable yet.
    assert engine.tiers.cpu.contains([key]) == 0
    engine.finish_store(store_b)
    assert engine.tiers.cpu.contains([key]) == 1
    engine.tiers.flush()
    out = new_kv_cache(fill=0.0)
    read_slots = random_slots(8, 9)
    assert bool(engine.retrieve(seq(0), kv_caches=out, slot_mapping=read_slots).all())
    assert torch.equal(token_rows(out, read_slots), token_rows(kv, slots))
    assert engine.tiers.num_pinned() == 0 and engine.tiers.cpu.stats()["num_pinned"] == 0
    engine.tiers.close()


def test_private_write_buffers_stay_within_their_byte_budget_while_a_tier_stalls(restartable_redis):
    """Without a CPU-tier slot (here: no CPU tier) a stored chunk waits for the lower tiers in
    a private buffer (pinned on CUDA, where torch keeps pinned memory once used). While Redis
    hangs, at most save_buffer_bytes of them live; the stores past it are dropped and
    counted; once Redis answers and the writes drain, every buffer is freed."""
    engine = make_cache_engine(
        cpu_bytes=0, remote_url=restartable_redis.url + "?timeout=10", save_buffer_bytes=3 * CHUNK_BYTES
    )
    buffers = engine.tiers.write_buffers
    os.kill(restartable_redis.process.pid, signal.SIGSTOP)
    try:
        for index in range(10):
            store(engine, seq(1000 * index))  # returns at once although Redis does not answer
            assert buffers.num_bytes <= 3 * CHUNK_BYTES
        assert engine.tiers.counters()["dropped_writes_no_buffer"] == 10 - 3
        assert buffers.peak_bytes == 3 * CHUNK_BYTES and buffers.num_refused == 7
    finally:
        os.kill(restartable_redis.process.pid, signal.SIGCONT)
    engine.tiers.flush()
    assert wait_until(lambda: buffers.num_bytes == 0, 10)
    assert engine.tiers.stats()["write_buffer_bytes"] == 0
    # the three that had buffers were written; the budget is free for the next stores
    assert sum(engine.lookup(seq(1000 * index)) == 8 for index in range(10)) == 3
    store(engine, seq(50_000))
    engine.tiers.flush()
    assert engine.lookup(seq(50_000)) == 8
    engine.tiers.close()
