"""The connector's roles in two processes (docs/architecture.md, The connector contract):
the scheduler side here, the worker side in a spawned child, both built from one
``OffloadConfig`` with only a Redis tier (no CPU tier, so they share nothing), or with a
staging area whose slots the scheduler side grants to the child's fetches. Only the
per-step ``ConnectorMetadata`` (pickled to the child) and the child's ``WorkerReport``
(pickled back) go between them."""

from __future__ import annotations

import contextlib
import multiprocessing

import torch

from connector import OffloadConfig
from connector.base import ConnectorMetadata, FetchSpec, Grant, WorkerReport
from connector.request_transfer import FetchState
from connector.scheduler_side import slot_mapping_for
from storage_backends import create_backend
from storage_backends.chunk import KVChunk
from tests.connector.kv_helpers import (
    BLOCK_SIZE,
    NUM_LAYERS,
    make_connector_pair,
    new_kv_cache,
    token_rows,
)
from tests.connector.test_connector_roles import FakeRequest, scheduled

CHUNK = 16
PROMPT = list(range(1000, 1040))  # 40 tokens: chunks end at 16, 32 and the partial 40
A_BLOCKS = list(range(0, 10))
B_BLOCKS = list(range(20, 32))


def connector_pair(redis_url: str):
    """Both roles as the engine builds them; each process uses one of them."""
    config = OffloadConfig(chunk_size=CHUNK, cpu_bytes=0, staging_bytes=0, remote_url=redis_url)
    return make_connector_pair(config, "worker-in-another-process")


def serve_worker_side(conn, redis_url: str) -> None:
    """The child: a worker side over its own KV tensor (random, seed 7). Per message: run one
    step of the metadata and answer with its report and the KV rows of ``slots``."""
    _, worker = connector_pair(redis_url)
    kv_cache = new_kv_cache(7)
    worker.register_kv_caches(kv_cache)
    try:
        while (message := conn.recv()) is not None:
            metadata, slots = message
            worker.bind_connector_metadata(metadata)
            worker.start_load_kv()
            for layer in range(NUM_LAYERS):
                worker.wait_for_layer_load(layer)
                worker.save_kv_layer(layer)
            worker.wait_for_save()
            # every save of the step read its blocks and reached Redis (the scheduler side
            # looks there next; without it a lookup can race the write-through)
            worker.flush()
            conn.send((worker.take_report(), token_rows(kv_cache, slots).clone()))
    finally:
        worker.close()


@contextlib.contextmanager
def child_serving(serve, redis_url: str):
    """A spawned child running ``serve(conn, redis_url)``; yields the parent's end of the
    pipe. On leaving, the child is told to stop and must exit cleanly (killed if it hangs)."""
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    child = context.Process(target=serve, args=(child_conn, redis_url), daemon=True)
    child.start()
    try:
        yield parent_conn
        parent_conn.send(None)
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


def test_the_worker_side_runs_in_another_process_from_metadata_and_reports_alone(redis_url):
    scheduler, unused_worker = connector_pair(redis_url)  # the child's worker side does the work
    try:
        with child_serving(serve_worker_side, redis_url) as parent_conn:

            def step(metadata, slots) -> tuple[WorkerReport, torch.Tensor]:
                parent_conn.send((metadata, slots))  # pickled: plain data only
                assert parent_conn.poll(60), "the worker process did not answer"
                return parent_conn.recv()

            # A computes its whole prompt in the child, which saves it to Redis.
            a = FakeRequest("a", PROMPT, len(PROMPT))
            assert scheduler.grant(a, 0, None) == Grant(0)
            scheduler.update_state_after_alloc(a, A_BLOCKS, Grant(0))
            metadata = scheduler.build_connector_meta([scheduled(a, A_BLOCKS, 0, len(PROMPT))])
            assert [(s.num_save_start, s.num_save_end) for s in metadata.saves] == [(0, 40)]
            # it ends with its step: its blocks stay until the report says its save read them
            assert scheduler.request_finished(a, A_BLOCKS) is True
            a_slots = slot_mapping_for(A_BLOCKS, BLOCK_SIZE, len(PROMPT))
            report, a_rows = step(metadata, a_slots)
            assert report.saves == [("a", 40)] and report.loads == [] and report.load_failures == {}
            assert scheduler.update_connector_output(report) == ({"a"}, set())
            assert scheduler.request_stats("a").num_saved_tokens == 40

            # B shares A's first two chunks: the scheduler side's lookup finds them in Redis.
            b = FakeRequest("b", PROMPT + list(range(8)), len(PROMPT) + 8)
            grant = scheduler.grant(b, 0, None)
            assert (grant.num_computed_tokens, grant.num_load_tokens) == (0, 32)
            scheduler.update_state_after_alloc(b, B_BLOCKS, grant)
            metadata = scheduler.build_connector_meta([scheduled(b, B_BLOCKS, 32, 16)])
            assert [(s.num_load_start, s.num_load_end) for s in metadata.loads] == [(0, 32)]
            assert scheduler.request_finished(b, B_BLOCKS) is True  # its step saves chunk 3
            b_slots = slot_mapping_for(B_BLOCKS, BLOCK_SIZE, 48)
            report, b_rows = step(metadata, b_slots)
            assert report.load_failures == {}
            (load,) = report.loads
            assert (load.request_id, load.num_load_start, load.num_loaded) == ("b", 0, 32)
            # the child loaded into its KV tensor exactly what A's step saved
            assert torch.equal(b_rows[:, :, :32], a_rows[:, :, :32])
            assert not torch.equal(b_rows[:, :, 32:40], a_rows[:, :, 32:40])  # computed, not loaded
            assert scheduler.update_connector_output(report) == ({"b"}, set())
            stats = scheduler.request_stats("b")
            assert (stats.num_external_hit_tokens, stats.num_loaded_tokens) == (32, 32)
            assert stats.num_loaded_bytes == 32 * scheduler.index.geometry.bytes_per_token
            assert stats.tier_to_loaded_tokens == {"redis": 32}
            assert stats.num_saved_tokens == 16
    finally:
        unused_worker.close()


F_BLOCKS = list(range(40, 50))
F_SLOTS = slot_mapping_for(F_BLOCKS, BLOCK_SIZE, len(PROMPT))


def staging_pair(redis_url: str):
    """Both roles over a staging area (no CPU tier) above Redis: lower-tier hits are fetched."""
    config = OffloadConfig(chunk_size=CHUNK, cpu_bytes=0, staging_bytes=1 << 20, remote_url=redis_url)
    return make_connector_pair(config, "fetch-in-another-process")


def serve_fetches(conn, redis_url: str) -> None:
    """The child: a worker side whose fetcher reads into, and whose loads read from, the
    slots the metadata names. Per message: run one step of the metadata (its fetches waited
    for until they ended), answer with the report, what its own staging area's index holds
    (nothing: the index is the scheduler side's), the memory of the slots read and the KV
    rows of ``slots``."""
    _, worker = staging_pair(redis_url)
    kv_cache = new_kv_cache(7)
    worker.register_kv_caches(kv_cache)
    staging = worker.cache_engine.tiers.cpu
    try:
        while (message := conn.recv()) is not None:
            metadata, slots = message
            worker.bind_connector_metadata(metadata)
            worker.start_load_kv()
            while any(not job.done for job in worker._fetch_jobs.values()):
                worker.wait_for_transfers(0.05)
            for layer in range(NUM_LAYERS):
                worker.wait_for_layer_load(layer)
                worker.save_kv_layer(layer)
            worker.wait_for_save()
            worker.flush()
            report = worker.take_report()
            filled = {
                slot_id: staging.view(slot_id, staging.chunk_shape).clone() for _, slot_id, _ in report.fills
            }
            rows = token_rows(kv_cache, slots).clone()
            conn.send((report, staging.keys(), staging.pin_counts(), filled, rows))
    finally:
        worker.close()


def test_a_fetch_runs_in_another_process_into_the_slots_the_scheduler_side_granted(redis_url):
    scheduler, unused_worker = staging_pair(redis_url)
    spans = scheduler.index.token_db.chunk_spans(PROMPT)[:2]  # two whole chunks of 16
    shape = scheduler.index.geometry.shape_of(spans[0])
    redis = create_backend(redis_url)
    chunks = [torch.full(shape, float(index + 1)) for index in range(len(spans))]
    for span, tensor in zip(spans, chunks, strict=True):
        redis.put(span.key, KVChunk(tensor))
    try:
        with child_serving(serve_fetches, redis_url) as parent_conn:
            f = FakeRequest("f", PROMPT, len(PROMPT))
            transfer = scheduler._transfer_of(f)  # its chunk keys cut as a grant does
            spec = FetchSpec(1, "f", tuple(s.key for s in spans), (shape,) * 2, ("redis", "redis"), 30.0)
            scheduler.registry.fetch_started(transfer, FetchState(1, 0, spec.tier_names))
            granted = scheduler.grants.grant_fetch(spec)  # as build_connector_meta does
            assert min(granted.slot_ids) >= 0

            def step(metadata, slots):
                parent_conn.send((metadata, slots))  # pickled: plain data only
                assert parent_conn.poll(60), "the worker process did not answer"
                return parent_conn.recv()

            report, child_keys, child_pins, slots, _ = step(ConnectorMetadata(fetches=[granted]), F_SLOTS[:0])
            # the child read into the granted slots and changed nothing of its own index
            assert child_keys == [] and child_pins == {}
            assert sorted(report.fills) == sorted(
                (span.key, slot_id, True) for span, slot_id in zip(spans, granted.slot_ids, strict=True)
            )
            for slot_id, tensor in zip(granted.slot_ids, chunks, strict=True):
                assert torch.equal(slots[slot_id], tensor)
            (progress,) = report.fetches
            assert (progress.num_ready_chunks, progress.done) == (2, True)
            # the scheduler side publishes the fills, pinned for the fetch that waits for them
            assert scheduler.update_connector_output(report) == (set(), {"f"})
            assert scheduler.cpu_index.present([s.key for s in spans]) == [True, True]
            assert scheduler.cpu_index.pin_counts() == {"fetch": 2}

            # admitted, it loads the fetched chunks in the child, by the slots the scheduler side pinned
            grant = scheduler.grant(f, 0, None)
            assert (grant.num_computed_tokens, grant.num_load_tokens) == (0, 32)
            scheduler.update_state_after_alloc(f, F_BLOCKS, grant)
            metadata = scheduler.build_connector_meta([scheduled(f, F_BLOCKS, 32, 8)])
            (load,) = metadata.loads
            assert load.slot_ids == granted.slot_ids
            # the fetch's pins went with its release; the lookup's and the reads' hold them until it ends
            assert scheduler.cpu_index.pin_counts() == {"lookup": 2, "read": 2}
            report, child_keys, child_pins, _, rows = step(metadata, F_SLOTS)
            assert child_keys == [] and child_pins == {}
            assert report.load_failures == {} and report.ended_loads == [("f", 0)]
            assert bool((rows[:, :, :16] == 1.0).all()) and bool((rows[:, :, 16:32] == 2.0).all())
            scheduler.update_connector_output(report)
            assert scheduler.cpu_index.pin_counts() == {}  # the load's pins went with its report
    finally:
        redis.close()
        unused_worker.close()
