"""The role-split connector without an engine: what the scheduler side promises and
emits per step, and what the worker side does with it on a synthetic KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.base import Grant, ScheduledRequest
from connector.request_transfer import TransferRegistry
from connector.scheduler_side import OffloadScheduler, slot_mapping_for
from connector.worker_side import OffloadWorker
from tests.connector.kv_helpers import BLOCK_SIZE, make_cache_engine, new_kv_cache, token_rows

CHUNK = 8


@dataclass
class FakeRequest:
    """What the engine's Request exposes to the scheduler side (ConnectorRequest)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None


def roles(layerwise=False):
    engine = make_cache_engine(chunk_size=CHUNK)
    scheduler = OffloadScheduler(engine.scheduler_index(), TransferRegistry(), block_size=BLOCK_SIZE)
    worker = OffloadWorker(engine, layerwise=layerwise)
    return engine, scheduler, worker


def scheduled(request, block_ids, num_computed, num_scheduled):
    return ScheduledRequest(
        request.request_id,
        request.all_token_ids,
        block_ids,
        num_computed,
        num_scheduled,
        request.num_prompt_tokens,
    )


def run_step(worker, kv_cache, metadata, scheduler=None, num_layers=2):
    """One step of the worker side; with ``scheduler``, its report is applied there (as the
    engine core does at the end of a step)."""
    worker.bind_connector_metadata(metadata)
    worker.start_load_kv()
    for layer in range(num_layers):
        worker.wait_for_layer_load(layer)
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    if scheduler is not None:
        scheduler.update_connector_output(worker.take_report())


def test_saves_follow_chunked_prefill_and_never_include_output_tokens():
    engine, scheduler, worker = roles()
    kv_cache = new_kv_cache(1)
    worker.register_kv_caches(kv_cache)
    prompt = list(range(50, 80))  # 30 tokens: chunks end at 8, 16, 24 and the partial 30
    request = FakeRequest("r1", prompt + [5, 6, 7], num_prompt_tokens=30)
    block_ids = list(range(20, 40))
    assert scheduler.grant(request, 0, None) == Grant(0)
    scheduler.update_state_after_alloc(request, block_ids, Grant(0))

    saves_per_step = []
    for num_computed, num_scheduled in ((0, 12), (12, 12), (24, 6), (30, 1), (31, 3)):
        metadata = scheduler.build_connector_meta(
            [scheduled(request, block_ids, num_computed, num_scheduled)]
        )
        assert metadata.loads == []
        saves_per_step.append([(s.num_save_start, s.num_save_end) for s in metadata.saves])
        run_step(worker, kv_cache, metadata, scheduler)
    assert saves_per_step == [[(0, 8)], [(8, 24)], [(24, 30)], [], []]
    assert engine.lookup(prompt) == 30
    assert engine.lookup(prompt + [5]) == 24  # output tokens were never stored
    assert scheduler.request_finished(request, block_ids) is False
    assert scheduler.request_stats("r1").num_saved_tokens == 30


def test_matching_is_side_effect_free_and_leaves_the_last_token():
    engine, scheduler, worker = roles()
    source = new_kv_cache(2)
    prompt = list(range(100, 124))  # three full chunks
    engine.store(prompt, kv_caches=source, slot_mapping=slot_mapping_for(range(6), BLOCK_SIZE, 24))
    request = FakeRequest("r2", prompt, num_prompt_tokens=24)
    for num_gpu_hit in (0, 4, 12):
        assert scheduler.grant(request, num_gpu_hit, None) == Grant(num_gpu_hit, 23 - num_gpu_hit)
    assert engine.tiers.num_pinned() == 0
    assert scheduler.grant(FakeRequest("r3", [1, 2, 3], 3), 0, None) == Grant(0)


def test_load_of_a_non_aligned_range_writes_exactly_those_tokens():
    engine, scheduler, worker = roles(layerwise=True)
    prompt = list(range(100, 130))
    source = new_kv_cache(3)
    engine.store(prompt, kv_caches=source, slot_mapping=slot_mapping_for(range(8), BLOCK_SIZE, 30))
    kv_cache = new_kv_cache(fill=0.0)
    worker.register_kv_caches(kv_cache)
    request = FakeRequest("r4", prompt, num_prompt_tokens=30)
    block_ids = list(range(40, 48))
    grant = scheduler.grant(request, 12, None)  # 12 tokens on the "GPU"
    assert grant.num_load_tokens == 17
    scheduler.update_state_after_alloc(request, block_ids, grant)
    assert engine.tiers.num_pinned() > 0  # pinned until the load
    metadata = scheduler.build_connector_meta([scheduled(request, block_ids, 29, 1)])
    (load,) = metadata.loads
    assert (load.num_load_start, load.num_load_end) == (12, 29)
    run_step(worker, kv_cache, metadata, scheduler)
    assert worker.load_failures() == {}
    assert engine.tiers.num_pinned() == 0
    target_slots = slot_mapping_for(block_ids, BLOCK_SIZE, 30)
    source_rows = token_rows(source, slot_mapping_for(range(8), BLOCK_SIZE, 30))
    assert torch.equal(token_rows(kv_cache, target_slots[12:29]), source_rows[:, :, 12:29])
    assert bool((token_rows(kv_cache, target_slots[:12]) == 0).all())
    assert bool((token_rows(kv_cache, target_slots[29:]) == 0).all())
    scheduler.request_finished(request, block_ids)
    stats = scheduler.request_stats("r4")
    assert (stats.num_gpu_hit_tokens, stats.num_external_hit_tokens, stats.num_loaded_tokens) == (12, 17, 17)
    assert stats.num_loaded_bytes == 17 * engine.bytes_per_token


def test_missing_chunk_is_reported_with_the_valid_length_and_skips_the_save():
    engine, scheduler, worker = roles()
    stored_prompt = list(range(100, 132))
    engine.store(
        stored_prompt, kv_caches=new_kv_cache(4), slot_mapping=slot_mapping_for(range(8), BLOCK_SIZE, 32)
    )
    kv_cache = new_kv_cache(fill=0.0)
    worker.register_kv_caches(kv_cache)
    prompt = stored_prompt + list(range(8))
    request = FakeRequest("r5", prompt, num_prompt_tokens=40)
    block_ids = list(range(40, 50))
    grant = scheduler.grant(request, 0, None)
    assert grant.num_load_tokens == 32
    scheduler.update_state_after_alloc(request, block_ids, grant)
    spans = engine.token_db.chunk_spans(prompt)
    engine.tiers.unpin([span.key for span in spans])
    assert engine.tiers.cpu.delete(spans[2].key)  # vanishes before the load
    metadata = scheduler.build_connector_meta([scheduled(request, block_ids, 32, 8)])
    assert [(s.num_save_start, s.num_save_end) for s in metadata.saves] == [(32, 40)]
    run_step(worker, kv_cache, metadata, scheduler)
    assert worker.load_failures() == {"r5": 16}
    # The step's new KV attended over missing tokens: its save was skipped.
    assert engine.lookup(prompt) == 16
    # The engine recomputes from 16; the next step saves from chunk 2 on.
    metadata = scheduler.build_connector_meta([scheduled(request, block_ids, 16, 24)])
    assert [(s.num_save_start, s.num_save_end) for s in metadata.saves] == [(16, 40)]
    scheduler.request_finished(request, block_ids)
    stats = scheduler.request_stats("r5")
    assert (stats.num_external_hit_tokens, stats.num_loaded_tokens) == (16, 16)


def test_request_finished_waits_for_a_save_that_has_not_read_its_blocks():
    engine, scheduler, worker = roles()
    kv_cache = new_kv_cache(5)
    worker.register_kv_caches(kv_cache)
    request = FakeRequest("r6", list(range(16)), num_prompt_tokens=16)
    block_ids = list(range(4))
    scheduler.update_state_after_alloc(request, block_ids, scheduler.grant(request, 0, None))
    metadata = scheduler.build_connector_meta([scheduled(request, block_ids, 0, 16)])
    assert scheduler.request_finished(request, block_ids) is True  # aborted before the step ran
    assert scheduler.update_connector_output(worker.take_report()) == (set(), set())
    run_step(worker, kv_cache, metadata)
    assert scheduler.update_connector_output(worker.take_report()) == ({"r6"}, set())
    assert scheduler.update_connector_output(worker.take_report()) == (set(), set())


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 16),
    block_ids=st.lists(st.integers(0, 10_000), max_size=12),
    data=st.data(),
)
def test_slot_mapping_is_block_id_times_block_size_plus_offset(block_size, block_ids, data):
    num_tokens = data.draw(st.integers(0, len(block_ids) * block_size))
    slots = slot_mapping_for(block_ids, block_size, num_tokens)
    assert slots.dtype == torch.int64 and slots.shape == (num_tokens,)
    assert slots.tolist() == [
        block_ids[i // block_size] * block_size + i % block_size for i in range(num_tokens)
    ]


def test_slot_mapping_refuses_more_tokens_than_the_blocks_hold():
    with pytest.raises(ValueError, match="cannot hold"):
        slot_mapping_for([3, 4], 4, 9)


def test_background_writes_wait_from_a_steps_loads_until_they_are_done():
    """The worker side holds the write gate (the disk writers are its threads) from the
    metadata that carries loads until they are done; the scheduler side never touches it."""
    engine, scheduler, worker = roles(layerwise=True)
    gate = engine.tiers.write_gate
    prompt = list(range(200, 230))
    engine.store(prompt, kv_caches=new_kv_cache(3), slot_mapping=slot_mapping_for(range(8), BLOCK_SIZE, 30))
    kv_cache = new_kv_cache(fill=0.0)
    worker.register_kv_caches(kv_cache)
    request = FakeRequest("r9", prompt, num_prompt_tokens=30)
    block_ids = list(range(40, 48))
    grant = scheduler.grant(request, 0, None)
    num_external = grant.num_load_tokens
    assert num_external > 0 and not gate.is_held
    scheduler.update_state_after_alloc(request, block_ids, grant)
    metadata = scheduler.build_connector_meta(
        [scheduled(request, block_ids, num_external, 30 - num_external)]
    )
    assert not gate.is_held  # nothing held by the scheduler side
    worker.bind_connector_metadata(metadata)
    assert gate.is_held  # from the step's metadata with loads on
    worker.start_load_kv()
    assert gate.is_held  # while the loads are queued and copied
    for layer in range(2):
        worker.wait_for_layer_load(layer)
    worker.wait_for_save()
    assert not gate.is_held  # the loads are done: the writes go on
