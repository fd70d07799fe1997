"""The connector's roles in two processes (docs/architecture.md, The connector contract):
the scheduler side here, the worker side in a spawned child, both built from one
``OffloadConfig`` with only a Redis tier (no CPU tier, so they share nothing). Only the
per-step ``ConnectorMetadata`` (pickled to the child) and the child's ``WorkerReport``
(pickled back) go between them."""

from __future__ import annotations

import multiprocessing

import torch

from connector import OffloadConfig, create_kv_connector
from connector.base import Grant, WorkerReport
from connector.scheduler_side import slot_mapping_for
from engine.step_time import StepTimeModel
from tests.connector.kv_helpers import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
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
    return create_kv_connector(
        config,
        model_id="worker-in-another-process",
        dtype=torch.float32,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
        step_times=StepTimeModel(),
    )


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


def test_the_worker_side_runs_in_another_process_from_metadata_and_reports_alone(redis_url):
    scheduler, unused_worker = connector_pair(redis_url)  # the child's worker side does the work
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    child = context.Process(target=serve_worker_side, args=(child_conn, redis_url), daemon=True)
    child.start()
    try:

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
        assert stats.num_loaded_bytes == 32 * scheduler.cache_engine.bytes_per_token
        assert stats.tier_to_loaded_tokens == {"redis": 32}
        assert stats.num_saved_tokens == 16
        parent_conn.send(None)
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        unused_worker.close()
