"""Pipelined loads (issue #16 item 3): a request waiting for a lower-tier fetch loads the
chunks that arrived while the rest is still read, so the host→device copy of chunk i
overlaps the read of chunk i+1. Tokens never change (tiny float32 model, greedy, CPU, KV
moves on the CPU mover's worker thread so the asynchronous paths run).

The remote is a real redis-server behind a real throttled TCP proxy, read one chunk at a
time, so chunks arrive one after another. Assertions count loads, steps and tokens,
never wall-clock time."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from benchmarks.support.delay_proxy import DelayProxy
from connector import OffloadConfig
from connector.request_transfer import TransferPhase
from engine import SamplingParams
from engine.request import RequestStatus
from engine.step_time import StepTimeModel
from tests.connector.test_async_loads import close, connector_of, fetcher_of, make_prompt, new_llm, write_to

CHUNK_SIZE = 32
PROMPT_LEN = 256  # 8 chunks of 16 KiB of KV each for the tiny model
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
#: per connection: a chunk takes ~0.15 s, so they land one by one, many steps apart
SLOW_BYTES_PER_S = 110_000


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def remote_config(url: str, **fields) -> OffloadConfig:
    return OffloadConfig(
        chunk_size=CHUNK_SIZE,
        cpu_bytes=32 << 20,
        remote_url=url,
        load_policy="always",
        remote_reads_in_flight=1,
        cpu_async_moves=True,
        **fields,
    )


class SlowRemote:
    """The prompt's KV in a real Redis, reached through a throttled proxy."""

    def __init__(self, model_dir, redis_server, prompts) -> None:
        redis_server.flushall()
        self.redis = redis_server
        self.proxy = DelayProxy(redis_server.port).start()
        self.url = f"redis://127.0.0.1:{self.proxy.port}"
        write_to(model_dir, remote_config(self.url), prompts)
        self.proxy.rate_bytes_per_s = SLOW_BYTES_PER_S

    def close(self) -> None:
        self.proxy.close()


def step_until_loaded(engine, request_id: str, max_steps: int = 200_000) -> list[int]:
    """Step until ``request_id`` has its first output token; returns each distinct
    ``num_computed_tokens`` it showed after a step before that (how far its loads had
    come: the step that computes loads the rest and produces the token)."""
    request = engine.requests[request_id]
    seen: list[int] = []
    for _ in range(max_steps):
        engine.step()
        if request.output_token_ids:
            return seen
        if request.num_computed_tokens and (not seen or seen[-1] != request.num_computed_tokens):
            seen.append(request.num_computed_tokens)
    raise AssertionError(f"{request_id} got no token in {max_steps} steps")


def run_to_end(engine, request_id: str, max_steps: int = 200_000):
    for _ in range(max_steps):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def step_until_partly_loaded(engine, connector, request_id: str, max_steps: int = 200_000):
    """Step until the request runs with part of its fetch loaded and the rest still coming."""
    request = engine.requests[request_id]
    for _ in range(max_steps):
        engine.step()
        transfer = connector.registry.get(request_id)
        if (
            request.status is RequestStatus.RUNNING
            and request.num_computed_tokens > 0
            and transfer.phase is TransferPhase.TAIL
            and not transfer.fetch.done
        ):
            return request, transfer
    raise AssertionError(f"{request_id} never ran partly loaded in {max_steps} steps")


@dataclass
class PartlyLoadedHit:
    """A request ("hit") of a fresh prompt whose KV is in the slow remote, running with part
    of its fetch loaded and the rest still coming."""

    prompt: list[int]
    #: its tokens recomputed without offload
    baseline: list[int]
    remote: SlowRemote
    llm: object
    connector: object
    engine: object
    request: object
    transfer: object


@contextlib.contextmanager
def partly_loaded_hit(model_dir, redis_server, seed: int) -> Iterator[PartlyLoadedHit]:
    """Store a prompt's KV in the slow remote, submit it to a fresh engine and step until
    it runs partly loaded; closes the engine's tiers and the proxy afterwards."""
    prompt = make_prompt(PROMPT_LEN, seed)
    baseline = new_llm(model_dir, None).generate([prompt], PARAMS)[0].token_ids
    remote = SlowRemote(model_dir, redis_server, [prompt])
    try:
        llm = new_llm(model_dir, remote_config(remote.url))
        try:
            connector = connector_of(llm)
            engine = llm.engine
            engine.add_request("hit", prompt, PARAMS)
            request, transfer = step_until_partly_loaded(engine, connector, "hit")
            yield PartlyLoadedHit(prompt, baseline, remote, llm, connector, engine, request, transfer)
        finally:
            close(llm)
    finally:
        remote.close()


def wait_for_reads(fetcher) -> None:
    for _ in range(100_000):  # reads in flight finish for the tier alone
        fetcher.wait_for_progress(0.01)
        if not fetcher._key_to_read:
            return
    raise AssertionError("reads still in flight")


def test_a_hit_loads_in_pieces_as_chunks_arrive_with_identical_tokens(model_dir, redis_server):
    prompt = make_prompt(PROMPT_LEN, 51)
    baseline = new_llm(model_dir, None).generate([prompt], PARAMS)[0].token_ids
    remote = SlowRemote(model_dir, redis_server, [prompt])
    try:
        pieces = {}
        for pipelined in (True, False):
            llm = new_llm(model_dir, remote_config(remote.url, pipelined_loads=pipelined))
            engine = llm.engine
            engine.add_request("hit", prompt, PARAMS)
            pieces[pipelined] = step_until_loaded(engine, "hit")
            output = run_to_end(engine, "hit")
            assert output.token_ids == baseline
            assert output.metrics.tier_to_loaded_tokens == {"redis": PROMPT_LEN - 1}
            assert output.metrics.num_external_cached_tokens == PROMPT_LEN - 1
            stats = connector_of(llm).request_stats("hit")
            assert stats.num_loaded_tokens == PROMPT_LEN - 1
            assert llm.engine.offload_cache_engine.tiers.cpu.pin_counts() == {}
            close(llm)
        # Pipelined: several loads of whole chunks while the fetch ran, each in a step that
        # computed nothing; the last piece loads in the step that computes the last token.
        assert len(pieces[True]) >= 2, pieces
        assert all(n % CHUNK_SIZE == 0 for n in pieces[True])
        assert pieces[True] == sorted(pieces[True]) and pieces[True][-1] < PROMPT_LEN - 1
        # Not pipelined: the old behaviour, the whole hit loaded in the step that computes.
        assert pieces[False] == []
    finally:
        remote.close()


def test_a_read_failing_midway_after_partial_loads_recomputes_the_rest(model_dir, redis_server):
    import redis

    with partly_loaded_hit(model_dir, redis_server, 52) as hit:
        connector = hit.connector
        spans = connector.index.token_db.chunk_spans(hit.prompt)
        assert hit.transfer.fetch.num_ready_chunks < 6  # chunks are read in order, one at a time
        # Chunk 6 vanishes after the lookup found it: its read misses, the fetch stops there.
        redis_tier = hit.engine.offload_cache_engine.tiers.lower[0]
        with redis.Redis(port=redis_server.port) as direct:
            assert direct.delete(redis_tier.key_prefix + spans[6].key) == 1
        pieces = [hit.request.num_computed_tokens, *step_until_loaded(hit.engine, "hit")]
        output = run_to_end(hit.engine, "hit")
        assert output.token_ids == hit.baseline
        assert len(set(pieces)) >= 2 and all(n % CHUNK_SIZE == 0 for n in pieces)
        assert max(pieces) <= 6 * CHUNK_SIZE
        assert output.metrics.tier_to_loaded_tokens == {"redis": 6 * CHUNK_SIZE}
        assert output.metrics.num_external_cached_tokens == 6 * CHUNK_SIZE
        wait_for_reads(fetcher_of(hit.llm))
        assert hit.engine.offload_cache_engine.tiers.cpu.pin_counts() == {}


def test_abort_while_partly_loaded_releases_everything(model_dir, redis_server):
    with partly_loaded_hit(model_dir, redis_server, 53) as hit:
        connector, engine = hit.connector, hit.engine
        assert hit.request.block_ids  # it holds blocks for what it loaded
        engine.abort_request("hit")
        assert connector.registry.get("hit") is None
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
        hit.remote.proxy.rate_bytes_per_s = None
        wait_for_reads(fetcher_of(hit.llm))
        assert hit.engine.offload_cache_engine.tiers.cpu.stats()["num_pinned"] == 0
        assert hit.engine.offload_cache_engine.tiers.num_pinned() == 0
        assert hit.llm.generate([hit.prompt], PARAMS)[0].token_ids == hit.baseline


def test_preempted_while_partly_loaded_the_request_starts_over_with_identical_tokens(model_dir, redis_server):
    with partly_loaded_hit(model_dir, redis_server, 54) as hit:
        old_fetch = hit.llm.engine.runner.connector._fetch_jobs[hit.transfer.fetch.fetch_id]
        hit.engine.scheduler.running.remove(hit.request)
        hit.engine.scheduler._preempt(hit.request)  # as when blocks run out
        output = run_to_end(hit.engine, "hit")
        assert old_fetch.done  # released at its readmission
        assert output.token_ids == hit.baseline
        assert hit.transfer.phase is not TransferPhase.FETCHING
        wait_for_reads(fetcher_of(hit.llm))
        assert hit.engine.offload_cache_engine.tiers.cpu.pin_counts() == {}


def test_the_registry_reports_a_partial_receive_once_per_growth_of_the_ready_prefix(redis_server):
    """Item (a) of pipelined loads, with the real fetcher, CPU tier and Redis: a running
    fetch whose first chunk is in the CPU tier is reported as received (its request may
    load it) once, and not again until more arrives; with pipelined loads off only a fetch
    that ended is."""
    import torch

    from connector import create_kv_connector
    from connector.base import ConnectorMetadata, FetchSpec
    from connector.request_transfer import FetchState
    from storage_backends.chunk import KVChunk

    shape = (2, 2, 16, 2, 8)
    with DelayProxy(redis_server.port) as proxy:
        config = OffloadConfig(
            chunk_size=16,
            cpu_bytes=8 << 20,
            remote_url=f"redis://127.0.0.1:{proxy.port}",
            remote_reads_in_flight=1,
        )
        scheduler, worker = create_kv_connector(
            config,
            model_id="partial-receives",
            dtype=torch.float32,
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            block_size=4,
            device=torch.device("cpu"),
            step_times=StepTimeModel(),
        )
        registry = scheduler.registry
        worker.cache_engine.tiers.cpu.put("k0", KVChunk(torch.ones(shape)))
        proxy.delay_s = 60.0  # the reads of k1 and k2 stay in flight
        jobs = {}
        for fetch_id, (request_id, pipelined) in enumerate((("on", True), ("off", False)), start=1):
            worker.pipelined_loads = pipelined
            transfer = registry.get_or_create(request_id, tuple(range(48)))
            # the scheduler side grants its slots (k0 pinned, k1 and k2 reserved or shared)
            spec = scheduler.grants.grant_fetch(
                FetchSpec(
                    fetch_id, request_id, ("k0", "k1", "k2"), (shape,) * 3, ("cpu", "redis", "redis"), 60.0
                )
            )
            registry.fetch_started(transfer, FetchState(fetch_id, 0, spec.tier_names))
            worker.bind_connector_metadata(ConnectorMetadata(fetches=[spec]))
            worker.start_load_kv()  # the worker's fetcher runs it
            jobs[request_id] = worker._fetch_jobs[fetch_id]
            assert jobs[request_id].num_ready_chunks == 1 and not jobs[request_id].done
            received = {"off": set(), "on": {"on"}}[request_id]
            assert scheduler.update_connector_output(worker.take_report()) == (set(), received)
            assert scheduler.update_connector_output(worker.take_report()) == (set(), set())  # nothing new
            assert transfer.phase is TransferPhase.FETCHING
        for job in jobs.values():
            scheduler.grants.release_fetch(job.fetch_id)  # their pins are the scheduler side's
        worker.bind_connector_metadata(
            ConnectorMetadata(released_fetch_ids=[job.fetch_id for job in jobs.values()])
        )
        worker.start_load_kv()
        assert worker.cache_engine.tiers.cpu.pin_counts() == {}
        proxy.close()  # the reads in flight fail at once
        worker.close()
