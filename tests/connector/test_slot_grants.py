"""connector.slot_grants: the scheduler side grants the CPU-tier slots of saves, fetches and
loads and their pins; the worker side only fills and reads the slots it is given and reports
each copy, read and load (its fetcher holds no index, and its saves, fetches and loads
change none)."""

from __future__ import annotations

import torch

from connector import OffloadConfig
from connector.base import (
    FETCH_IN_CPU,
    FETCH_MISS,
    FETCH_SHARED,
    LOAD_NOT_IN_CPU,
    SAVE_NO_CPU,
    SAVE_NO_ROOM,
    SAVE_SKIP,
    ConnectorMetadata,
    FetchSpec,
    Grant,
)
from connector.fetcher import ChunkFetcher, FetchJob
from connector.scheduler_side import slot_mapping_for
from connector.slot_grants import SlotGrants
from connector.slot_index import PinKind, SlotIndex
from connector.token_db import KV_LAYOUT
from storage_backends.chunk import KVChunk
from tests.connector.kv_helpers import (
    ANSWERED_LOOKUP_WAIT_S,
    BLOCK_SIZE,
    make_connector_pair,
    new_kv_cache,
    token_rows,
)
from tests.connector.test_connector_roles import FakeRequest, scheduled

SHAPE = (2, 2, 8, 1, 4)


def fetch_spec(fetch_id: int, keys: tuple[str, ...], tiers: tuple[str, ...] | None = None) -> FetchSpec:
    return FetchSpec(
        fetch_id, f"r{fetch_id}", keys, (SHAPE,) * len(keys), tiers or ("disk",) * len(keys), 60.0
    )


def published_index(*keys: str, num_slots: int = 4) -> SlotIndex:
    index = SlotIndex(num_slots)
    for key in keys:
        index.publish(index.reserve(key, SHAPE))
    return index


def test_a_fetch_pins_what_is_there_reserves_what_it_reads_and_shares_a_read_in_flight():
    index = published_index("a")
    grants = SlotGrants(index)
    first = grants.grant_fetch(fetch_spec(1, ("a", "b", "c"), ("cpu", "disk", "disk")))
    assert first.slot_ids[0] == FETCH_IN_CPU and min(first.slot_ids[1:]) >= 0
    assert len(set(first.slot_ids[1:])) == 2
    assert index.pin_counts() == {"fetch": 1} and grants.num_pending_fills() == 2
    # a second request waiting on the same chunks shares the reads under way
    second = grants.grant_fetch(fetch_spec(2, ("a", "b")))
    assert second.slot_ids == (FETCH_IN_CPU, FETCH_SHARED)
    # b arrived, c did not: b is published with one pin per fetch waiting, c's slot is free again
    grants.apply_fills([("b", first.slot_ids[1], True), ("c", first.slot_ids[2], False)])
    assert index.present(["a", "b", "c"]) == [True, True, False]
    assert grants.fetch_pinned_keys(1) == {"a", "b"} and grants.fetch_pinned_keys(2) == {"a", "b"}
    assert index.pin_counts() == {"fetch": 4} and grants.num_pending_fills() == 0
    grants.release_fetch(1)
    grants.release_fetch(2)
    assert index.pin_counts() == {}


def test_an_ended_fetch_keeps_its_ready_prefix_and_a_late_read_fills_the_tier_for_others():
    index = published_index("a", "c")
    grants = SlotGrants(index)
    spec = grants.grant_fetch(fetch_spec(1, ("a", "b", "c")))
    assert spec.slot_ids[0] == FETCH_IN_CPU and spec.slot_ids[2] == FETCH_IN_CPU
    grants.fetch_ended(1, 1)  # its deadline cut it while b was read: a alone is usable
    assert grants.fetch_pinned_keys(1) == {"a"} and index.pin_counts() == {"fetch": 1}
    grants.apply_fills([("b", spec.slot_ids[1], True)])  # published, pinned for nobody
    assert index.present(["b"]) == [True] and index.pin_counts() == {"fetch": 1}
    grants.release_fetch(1)
    assert index.pin_counts() == {}


def test_no_room_and_a_chunk_gone_from_the_cpu_tier_are_misses():
    index = published_index("x")
    index.pin(["x"], PinKind.READ)
    grants = SlotGrants(index)
    full = SlotIndex(1)
    full.publish(full.reserve("x", SHAPE))
    full.pin(["x"], PinKind.READ)
    assert SlotGrants(full).grant_fetch(fetch_spec(1, ("b",))).slot_ids == (FETCH_MISS,)
    assert grants.grant_fetch(fetch_spec(2, ("gone",), ("cpu",))).slot_ids == (FETCH_MISS,)
    # a fill that matches no reservation (a report seen twice) changes nothing
    grants.apply_fills([("gone", 0, True)])
    assert index.present(["gone"]) == [False]


class _CountingIndex(SlotIndex):
    """A SlotIndex that records every call that changes it."""

    CHANGES = ("reserve", "publish", "cancel", "pin", "pin_each", "unpin", "pin_and_find", "delete")

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.changes: list[str] = []
        for name in self.CHANGES:
            method = getattr(self, name)
            setattr(self, name, self._counted(name, method))

    def _counted(self, name, method):
        def counted(*args, **kwargs):
            self.changes.append(name)
            return method(*args, **kwargs)

        return counted


class _MemoryTier:
    name = "disk"

    def __init__(self, chunks: dict[str, torch.Tensor]) -> None:
        self.chunks = chunks

    def get_into(self, key: str, out: torch.Tensor):
        tensor = self.chunks.get(key)
        if tensor is None:
            return None
        out.copy_(tensor)
        return KVChunk(out, KV_LAYOUT)


def test_the_fetcher_holds_no_index_and_changes_none_while_it_reads():
    index = _CountingIndex(4)
    slab = torch.zeros(4, *SHAPE)
    stored = {"a": torch.full(SHAPE, 1.0), "b": torch.full(SHAPE, 2.0)}
    fetcher = ChunkFetcher(
        lambda slot_id, shape: slab[slot_id],
        {"disk": _MemoryTier(stored)},
        {},
        tier_to_reads_in_flight={"disk": 1},
        dtype=torch.float32,
        layout=KV_LAYOUT,
    )
    assert not any(isinstance(value, SlotIndex) for value in vars(fetcher).values())
    grants = SlotGrants(index)
    spec = grants.grant_fetch(fetch_spec(1, ("a", "b", "missing")))
    index.changes.clear()
    job = FetchJob.from_spec(spec)
    fetcher.start(job)
    while not job.done:
        fetcher.wait_for_progress(0.05)
    fills = fetcher.take_fills(1)
    assert index.changes == []  # the worker side read into its slots and changed nothing
    assert sorted(ok for _, _, ok in fills) == [False, True, True]
    assert torch.equal(slab[spec.slot_ids[1]], stored["b"])
    grants.apply_fills(fills)  # the scheduler side publishes them
    assert index.present(["a", "b", "missing"]) == [True, True, False]
    assert grants.fetch_pinned_keys(1) == {"a", "b"}
    fetcher.close()


def test_a_shared_chunk_whose_read_ended_before_its_fetch_started_is_ready_from_the_unapplied_fill():
    slab = torch.zeros(4, *SHAPE)
    fetcher = ChunkFetcher(
        lambda slot_id, shape: slab[slot_id],
        {"disk": _MemoryTier({"a": torch.ones(SHAPE)})},
        {},
        tier_to_reads_in_flight={"disk": 1},
        dtype=torch.float32,
        layout=KV_LAYOUT,
    )
    grants = SlotGrants(SlotIndex(4))
    first = FetchJob.from_spec(grants.grant_fetch(fetch_spec(1, ("a",))))
    second = FetchJob.from_spec(grants.grant_fetch(fetch_spec(2, ("a",))))
    assert second.slot_ids == [FETCH_SHARED]
    fetcher.start(first)
    while not first.done:
        fetcher.wait_for_progress(0.05)
    fills = fetcher.take_fills(1)  # report 1 is not applied yet when the second starts
    fetcher.start(second)
    assert second.done and second.num_ready_chunks == 1
    grants.apply_fills(fills)
    assert grants.fetch_pinned_keys(2) == {"a"}
    fetcher.forget_fills(ConnectorMetadata(num_reports_applied=1).num_reports_applied)
    assert fetcher._key_to_recent_fill == {}
    fetcher.close()


def test_a_save_reserves_a_slot_per_chunk_it_copies_and_is_published_with_a_write_through_pin():
    index = published_index("held")
    grants = SlotGrants(index, write_through=True)
    slot_ids = grants.grant_save(["held", "new"], [SHAPE, SHAPE])
    assert slot_ids[0] == SAVE_SKIP and slot_ids[1] >= 0
    assert grants.grant_save(["new"], [SHAPE]) == (SAVE_SKIP,)  # being filled already
    assert index.present(["new"]) == [False]  # invisible until its fill is reported
    grants.apply_fills([("new", slot_ids[1], True)])
    assert index.present(["new"]) == [True] and index.pin_counts() == {"write_through": 1}
    grants.write_through_done(["new"])
    assert index.pin_counts() == {}
    # a staging area keeps no stores; a tier full of pins has no room for one
    assert SlotGrants(SlotIndex(2), stores_in_cpu=False).grant_save(["x"], [SHAPE]) == (SAVE_NO_CPU,)
    full = published_index("a", num_slots=1)
    full.pin(["a"], PinKind.READ)
    assert SlotGrants(full).grant_save(["b"], [SHAPE]) == (SAVE_NO_ROOM,)


def count_changes(index: SlotIndex) -> list[str]:
    """Record the name of every call that changes ``index`` from now on."""
    changes: list[str] = []
    for name in _CountingIndex.CHANGES:
        method = getattr(index, name)

        def counted(*args, _name=name, _method=method, **kwargs):
            changes.append(_name)
            return _method(*args, **kwargs)

        setattr(index, name, counted)
    return changes


def test_the_worker_side_saves_into_granted_slots_and_the_report_publishes_them(tmp_path):
    config = OffloadConfig(  # the disk's lookup answers in the grant that asks
        chunk_size=16,
        cpu_bytes=1 << 20,
        disk_path=str(tmp_path),
        disk_bytes=1 << 24,
        lookup_wait_s=ANSWERED_LOOKUP_WAIT_S,
    )
    scheduler, worker = make_connector_pair(config, "saves-by-slot")
    kv_cache = new_kv_cache(5)
    worker.register_kv_caches(kv_cache)
    index = scheduler.cpu_index
    prompt = list(range(500, 540))  # chunks end at 16, 32 and the partial 40
    blocks = list(range(10))
    request = FakeRequest("a", prompt, len(prompt))
    scheduler.grant(request, 0, None)
    scheduler.update_state_after_alloc(request, blocks, Grant(0))
    metadata = scheduler.build_connector_meta([scheduled(request, blocks, 0, len(prompt))])
    (save,) = metadata.saves
    assert len(save.slot_ids) == 3 and min(save.slot_ids) >= 0
    keys = [span.key for span in scheduler.index.token_db.chunk_spans(prompt)]
    changes = count_changes(index)
    worker.bind_connector_metadata(metadata)
    worker.start_load_kv()
    worker.wait_for_save()
    worker.flush()  # the copies and the write-through to disk are done
    report = worker.take_report()
    assert changes == []  # the worker side copied into its slots and changed no index state
    assert index.present(keys) == [False] * 3  # visible from the step's report on
    assert sorted(report.fills) == sorted(zip(keys, save.slot_ids, [True] * 3, strict=True))
    assert sorted(report.written_through) == sorted(keys)
    scheduler.update_connector_output(report)
    assert index.present(keys) == [True] * 3 and index.pin_counts() == {}
    slab = worker.cache_engine.tiers.cpu
    rows = token_rows(kv_cache, slot_mapping_for(blocks, BLOCK_SIZE, 16))
    assert torch.equal(slab.view(save.slot_ids[0], slab.chunk_shape), rows)
    assert set(changes) <= {"reserve", "publish", "pin", "unpin", "pin_each"}  # the scheduler side's

    # a second request loads those chunks: the scheduler side pins their slots, the worker reads them
    b_blocks = list(range(20, 32))
    b = FakeRequest("b", prompt + [7] * 8, len(prompt) + 8)
    grant = scheduler.grant(b, 0, None)
    assert (grant.num_computed_tokens, grant.num_load_tokens) == (0, 32)  # A's partial chunk is not B's
    scheduler.update_state_after_alloc(b, b_blocks, grant)
    metadata = scheduler.build_connector_meta([scheduled(b, b_blocks, 32, 16)])
    (load,) = metadata.loads
    assert load.slot_ids == save.slot_ids[:2] and index.pin_counts()["read"] == 2
    changes.clear()
    worker.bind_connector_metadata(metadata)
    worker.start_load_kv()
    worker.wait_for_save()
    report = worker.take_report()
    assert changes == [] and report.ended_loads == [("b", 0)] and report.load_failures == {}
    b_slots = slot_mapping_for(b_blocks, BLOCK_SIZE, 32)
    assert torch.equal(
        token_rows(kv_cache, b_slots), token_rows(kv_cache, slot_mapping_for(blocks, BLOCK_SIZE, 32))
    )
    scheduler.update_connector_output(report)
    assert index.pin_counts() == {"write_through": 1}  # B's own chunk 3, saved this step
    worker.close()


def test_a_lower_tier_hit_read_in_the_step_is_promoted_into_a_slot_the_scheduler_side_granted(tmp_path):
    """Synchronous loads (no fetcher): the step reads the disk tier; the chunks land in the
    slots the metadata names for promotion, published when the report says so."""
    config = OffloadConfig(
        chunk_size=16, cpu_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 24, async_loads=False
    )
    scheduler, worker = make_connector_pair(config, "promotions-by-slot")
    kv_cache = new_kv_cache(6)
    worker.register_kv_caches(kv_cache)
    index = scheduler.cpu_index
    prompt = list(range(700, 740))
    a, blocks = FakeRequest("a", prompt, len(prompt)), list(range(10))
    scheduler.grant(a, 0, None)
    scheduler.update_state_after_alloc(a, blocks, Grant(0))
    metadata = scheduler.build_connector_meta([scheduled(a, blocks, 0, len(prompt))])
    scheduler.request_finished(a, blocks)
    worker.bind_connector_metadata(metadata)
    worker.start_load_kv()
    worker.wait_for_save()
    worker.flush()
    scheduler.update_connector_output(worker.take_report())
    keys = [span.key for span in scheduler.index.token_db.chunk_spans(prompt)][:2]
    assert all(index.delete(key) for key in keys)  # on disk only now
    b, b_blocks = FakeRequest("b", prompt[:32] + [9] * 16, 48), list(range(20, 32))
    grant = scheduler.grant(b, 0, None)
    assert (grant.num_computed_tokens, grant.num_load_tokens) == (0, 32)
    scheduler.update_state_after_alloc(b, b_blocks, grant)
    metadata = scheduler.build_connector_meta([scheduled(b, b_blocks, 32, 16)])
    (load,) = metadata.loads
    assert load.slot_ids == (LOAD_NOT_IN_CPU,) * 2 and min(load.promotion_slot_ids) >= 0
    changes = count_changes(index)
    worker.bind_connector_metadata(metadata)
    worker.start_load_kv()
    worker.wait_for_save()
    report = worker.take_report()
    assert changes == [] and report.load_failures == {}
    assert sorted(report.fills[:2]) == sorted(zip(keys, load.promotion_slot_ids, [True] * 2, strict=True))
    assert torch.equal(
        token_rows(kv_cache, slot_mapping_for(b_blocks, BLOCK_SIZE, 32)),
        token_rows(kv_cache, slot_mapping_for(blocks, BLOCK_SIZE, 32)),
    )
    scheduler.update_connector_output(report)
    assert index.present(keys) == [True, True]
    worker.close()
