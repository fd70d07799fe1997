"""Worker-side connector: moves KV between the engine's paged cache and the tiers.

Per step (called from the model runner's thread): ``start_load_kv`` starts the
metadata's background fetches (lower-tier chunks read into CPU-tier slots on the
fetcher's threads; ``take_report`` reports their progress), then
reads the chunks of every load from the CPU tier (misses and corrupt chunks are
found here; without a CPU tier, from the lower tiers, blocking) and queues their moves; ``wait_for_layer_load(l)`` makes layer l's KV ready —
with ``layerwise`` on CUDA every layer's moves are queued at once on the
mover's stream with one event per layer, so loading layer l+1 overlaps
computing layer l; without it, the moves go in LOAD_LAYER_PIECES pieces of
layers (each piece's chunks together, one event per piece), so a pass that waits
per layer starts on the first layers while the later ones load. ``wait_for_save`` queues this step's saves from the paged
cache into CPU-tier slots (one pack + one device→host copy per chunk, on the
mover's store streams, ordered after the step's compute) and returns without
waiting for them: the cache engine publishes each store once its copies are
done (polled every step and by every lookup), so a miss costs the step loop no
PCIe time. Blocks a save still reads stay allocated: a finished request is
reported as sending until its saves are published, and a step that freed
blocks by preemption first waits for the saves in flight (``finish_saves``).
Lower-tier writes then happen on the tier manager's thread.

It holds no state of the scheduler side: what it did (saves, loads and their figures,
load failures, fetch progress, the CPU tier's rate) goes into a
:class:`~connector.base.WorkerReport` that ``take_report`` hands out once per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch

from connector.base import (
    ConnectorMetadata,
    FetchProgress,
    KVConnectorWorker,
    LoadReport,
    LoadSpec,
    SaveSpec,
    WorkerReport,
)
from connector.cache_engine import CacheEngine, LoadPlan, PendingStore
from connector.fetcher import ChunkFetcher, FetchJob
from connector.tiers import LOAD_WRITE_HOLD_S

log = logging.getLogger(__name__)

#: pieces of layers a load's moves are queued in without ``layerwise`` (one event each).
#: A pass that waits per piece computes the earlier pieces while the later ones load; for a
#: hit the compute of a layer is shorter than its copy, so the compute keeps up and what
#: is left after the last copy is the last piece's compute. So the pieces shrink towards
#: the end (`load_layer_pieces`). Since a piece of every chunk goes in a few grouped copies
#: and one unpack launch (`connector.staged_loads`), a piece costs little host time. On the
#: H100 (8k-token hit, 8B shape, `.gpu/tail.py`, 9 hits each, same run) pieces of 10, 9,
#: 7, 4, 2 layers gave a median of 29.5 ms where 4 equal pieces gave 31.3 ms and 8 equal
#: pieces 31.2 ms (earlier: 4 equal pieces 25.9 ms where 2 gave 28.7, `hit_profile.py`).
LOAD_LAYER_PIECES = 5


def load_layer_pieces(num_layers: int, num_pieces: int = LOAD_LAYER_PIECES) -> list[tuple[int, int]]:
    """[first, last) layer ranges, in order, covering every layer, at most ``num_pieces``,
    each at least one layer, their sizes falling linearly towards the last piece (weights
    ``num_pieces, ..., 2, 1``): the layers computed after the last copy are few."""
    num_pieces = max(1, min(num_pieces, num_layers))
    total_weight = num_pieces * (num_pieces + 1) // 2
    ends, weight = [], 0
    for piece in range(num_pieces):
        weight += num_pieces - piece
        # round to nearest, then keep every piece at least one layer and room for the rest
        end = (2 * weight * num_layers + total_weight) // (2 * total_weight)
        low = (ends[-1] if ends else 0) + 1
        high = num_layers - (num_pieces - piece - 1)
        ends.append(min(max(end, low), high))
    return [(first, last) for first, last in zip([0, *ends[:-1]], ends, strict=True)]


def _given_back(
    engine: CacheEngine, token_ids, cache_salt, num_start: int, slot_ids
) -> list[tuple[str, int, bool]]:
    """The slots granted to the chunks of ``token_ids`` that end after ``num_start`` (one
    slot id each, negative: none granted), reported unfilled: their copy never ran. The
    keys are the engine's cut of the same chunks the scheduler side granted."""
    spans = [span for span in engine.token_db.chunk_spans(token_ids, cache_salt) if span.end > num_start]
    return [(span.key, slot_id, False) for span, slot_id in zip(spans, slot_ids, strict=True) if slot_id >= 0]


def _unfilled_promotions(engine: CacheEngine, spec: LoadSpec) -> list[tuple[str, int, bool]]:
    """The promotion slots granted to a load that never ran, reported unfilled."""
    if not spec.promotion_slot_ids:
        return []
    # the chunks up to the one holding the load's end (a chunk is read whole)
    chunk_size = engine.token_db.chunk_size
    num_chunks_end = -(-spec.num_load_end // chunk_size) * chunk_size
    return _given_back(
        engine, spec.token_ids[:num_chunks_end], spec.cache_salt, spec.num_load_start, spec.promotion_slot_ids
    )


class _Load(NamedTuple):
    spec: LoadSpec
    plan: LoadPlan
    read_seconds: float  # host time reading the tiers


class OffloadWorker(KVConnectorWorker):
    """Owns the transfers of one engine's KV tensor."""

    def __init__(
        self,
        cache_engine: CacheEngine,
        *,
        layerwise: bool,
        fetcher: ChunkFetcher | None = None,
        pipelined_loads: bool = True,
        grants_own_slots: bool = False,
    ) -> None:
        self.cache_engine = cache_engine
        #: a worker side alone (a later pipeline stage or tensor-parallel rank): its CPU tier's
        #: index is its own, so its cache engine grants the saves' slots and publishes them;
        #: otherwise the metadata's slot ids are the scheduler side's and fills are reported
        self.grants_own_slots = grants_own_slots
        #: runs the metadata's background fetches; with it a step loads from the CPU tier only
        self.fetcher = fetcher
        #: fetch id -> its running (or ended, not yet released) job
        self._fetch_jobs: dict[int, FetchJob] = {}
        #: report fetches whose ready prefix grew, so their requests load it already
        self.pipelined_loads = pipelined_loads
        self.layerwise = layerwise
        self.kv_cache: torch.Tensor | None = None
        self._metadata = ConnectorMetadata()
        self._num_steps_bound = 0  # the highest ConnectorMetadata.step_number bound so far
        self._loads: list[_Load] = []
        self._layer_to_event: dict[int, torch.cuda.Event] = {}
        self._num_layers_moved = 0  # CPU layerwise: layers moved so far this step
        self._move_seconds = 0.0  # CPU: host time spent moving this step's loads
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        #: this step's loads that stopped early: request id -> leading tokens truly in the cache
        self._request_id_to_num_valid: dict[str, int] = {}
        self._num_saves_queued = 0  # saves of the bound metadata queued so far
        self._num_saves_started = 0  # saves of the bound metadata whose slots were handed to a store
        self._loads_ended = True  # the bound metadata's loads are in a report's ended_loads
        self._releases_applied = True  # the bound metadata's released fetches were released
        #: what goes into the next report; saves finish on whichever thread publishes them
        self._report_lock = threading.Lock()
        self._report = WorkerReport()
        self._failures_reported = True  # the bound metadata's load failures are in a report
        self._num_reports = 0  # reports handed out so far (``WorkerReport.report_number``)

    @property
    def needs_layer_hooks(self) -> bool:
        # Without layerwise, every layer's load ends at one event: one wait before the pass suffices.
        return self.layerwise

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        engine = self.cache_engine
        expected = (engine.num_layers, 2, engine.num_kv_heads, engine.head_dim)
        if kv_cache.dim() != 6 or (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[4:]) != expected:
            raise ValueError(
                f"KV tensor of shape {list(kv_cache.shape)} does not match the connector's "
                f"[{engine.num_layers}, 2, num_blocks, block_size, {engine.num_kv_heads}, {engine.head_dim}]"
            )
        if kv_cache.dtype != engine.dtype:
            raise ValueError(
                f"KV tensor dtype {kv_cache.dtype} does not match the connector's {engine.dtype}"
            )
        self.kv_cache = kv_cache

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._metadata = metadata
        self._num_steps_bound = max(self._num_steps_bound, metadata.step_number)
        self._clear_failed_loads()
        self._num_saves_queued = 0
        self._num_saves_started = 0
        self._loads_ended = not metadata.loads
        self._releases_applied = not metadata.released_fetch_ids
        self._failures_reported = False
        if self.fetcher is not None:
            self.fetcher.forget_fills(metadata.num_reports_applied)
        if metadata.loads:
            # From here until the loads' copies are queued and done, the step thread needs
            # the host: the lower tiers' background writes wait (released in _finish_loads).
            self.cache_engine.tiers.write_gate.hold(LOAD_WRITE_HOLD_S)

    # ---- loads ---------------------------------------------------------------
    def start_load_kv(self) -> None:
        self._loads = []
        self._layer_to_event = {}
        self._num_layers_moved = 0
        self._move_seconds = 0.0
        self._timing = None
        self._start_fetches()
        if not self._metadata.loads:
            self._apply_releases()
            return
        if self.kv_cache is None:
            raise RuntimeError("start_load_kv before register_kv_caches")
        engine = self.cache_engine
        for spec in self._metadata.loads:
            began = time.perf_counter()
            plan = engine.plan_load(
                spec.token_ids,
                spec.num_load_start,
                spec.num_load_end,
                kv_caches=self.kv_cache,
                slot_mapping=spec.slot_mapping,
                cache_salt=spec.cache_salt,
                cpu_only=self.fetcher is not None,
                slot_ids=None if self.grants_own_slots else spec.slot_ids,
                promotion_slot_ids=None if self.grants_own_slots else spec.promotion_slot_ids,
            )
            if plan.fills:
                with self._report_lock:
                    self._report.fills += plan.fills
            self._loads.append(_Load(spec, plan, time.perf_counter() - began))
            if plan.num_loaded_end < spec.num_load_end:
                self._request_id_to_num_valid[spec.request_id] = plan.num_loaded_end
        # The loads' plans hold what they read now: the fetches they came from may go.
        self._apply_releases()
        mover = engine.mover(self.kv_cache)
        if not mover.on_cuda:
            if not self.layerwise:
                self._move_on_cpu(None)
            return
        # Blocks being loaded may have been read by kernels still queued on the compute stream.
        mover.wait_for_compute()
        plans = [load.plan for load in self._loads]
        direct = mover.loads_directly([chunk for plan in plans for chunk in plan.chunks])
        start_event = mover.record_start(direct)
        # Layer by layer (layerwise, or direct loads: one launch per layer for every chunk),
        # else piece by piece of layers: a pass that waits per layer (the eager hooks, a
        # mixed graph's per-layer event waits) computes the first layers while the later
        # ones still load.
        if self.layerwise or direct:
            layer_ranges = [(layer, layer + 1) for layer in range(engine.num_layers)]
        else:
            layer_ranges = load_layer_pieces(engine.num_layers)
        events = engine.move_loads(plans, self.kv_cache, layer_ranges)
        for (first, last), event in zip(layer_ranges, events, strict=True):
            for layer in range(first, last):
                self._layer_to_event[layer] = event
        self._timing = (start_event, mover.record(timing=True))

    def _move_on_cpu(self, layer: int | None) -> None:
        """Move layer ``layer`` (None: every layer) of the step's loads on the CPU."""
        began = time.perf_counter()
        engine = self.cache_engine
        layers = (0, engine.num_layers) if layer is None else (layer, layer + 1)
        engine.move_loads([load.plan for load in self._loads], self.kv_cache, [layers])
        self._move_seconds += time.perf_counter() - began

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if not self._loads:
            return
        event = self._layer_to_event.get(layer_idx)
        mover = self.cache_engine.mover(self.kv_cache)
        if event is not None:
            torch.cuda.current_stream(self.kv_cache.device).wait_event(event)
        elif self.layerwise and not mover.on_cuda:
            while self._num_layers_moved <= layer_idx:
                self._move_on_cpu(self._num_layers_moved)
                self._num_layers_moved += 1
            if mover.threaded:
                mover.synchronize_loads()
        elif mover.threaded:
            mover.synchronize_loads()  # the loads queued on the CPU mover's thread

    def _finish_loads(self) -> None:
        """Wait for every load of the step, release its pins, record its figures."""
        if not self._loads:
            return
        engine = self.cache_engine
        if self.layerwise and not engine.mover(self.kv_cache).on_cuda:
            self.wait_for_layer_load(engine.num_layers - 1)
        for load in self._loads:
            engine.finish_load(load.plan)
        self._end_loads(len(self._loads))
        engine.tiers.write_gate.release()
        move_seconds = self._move_seconds
        if self._timing is not None:
            move_seconds = self._timing[0].elapsed_time(self._timing[1]) / 1e3
        num_step_tokens = sum(load.plan.num_loaded_end - load.spec.num_load_start for load in self._loads)
        reports = []
        for load in self._loads:
            num_tokens = load.plan.num_loaded_end - load.spec.num_load_start
            # The step's moves share one stream: each request gets its share of the move time.
            share = num_tokens / num_step_tokens if num_step_tokens else 0.0
            reports.append(
                LoadReport(
                    load.spec.request_id,
                    load.spec.num_load_start,
                    num_tokens,
                    load.spec.num_load_end - load.spec.num_load_start,
                    num_tokens * engine.bytes_per_token,
                    load.read_seconds + move_seconds * share,
                    # With a fetcher every load reads the CPU tier: where its tokens came from
                    # is the request's record of its fetch; without one, the tiers it read.
                    None if self.fetcher is not None else load.plan.tier_to_num_tokens,
                )
            )
        with self._report_lock:
            self._report.loads += reports
            if num_step_tokens:
                # the CPU tier's rate (when it is what the loads read): the host's read plus the moves
                self._report.cpu_reads.append(
                    (
                        num_step_tokens * engine.bytes_per_token,
                        sum(load.read_seconds for load in self._loads) + move_seconds,
                    )
                )
        self._loads = []

    # ---- saves ---------------------------------------------------------------
    def save_kv_layer(self, layer_idx: int) -> None:
        """Nothing per layer: ``wait_for_save`` packs all layers of a chunk in one kernel,
        which moves the same bytes with far fewer launches."""

    def wait_for_save(self) -> None:
        self._finish_loads()
        engine = self.cache_engine
        for spec in self._metadata.saves:
            self._num_saves_started += 1
            if spec.request_id in self._request_id_to_num_valid:
                # Its load failed: KV past the valid length is not in the cache, save nothing.
                self._saved(spec.request_id, 0, self._unfilled(spec))
                self._num_saves_queued += 1
                continue
            store = engine.begin_store(
                spec.token_ids[: spec.num_save_end],
                spec.num_save_start,
                kv_caches=self.kv_cache,
                slot_mapping=spec.slot_mapping,
                cache_salt=spec.cache_salt,
                slot_ids=None if self.grants_own_slots else spec.slot_ids,
            )
            engine.finish_store_later(store, self._on_saved(spec.request_id, store))
            self._num_saves_queued += 1
        engine.publish_finished_stores()
        if self.grants_own_slots:
            engine.settle_write_throughs()

    def _start_fetches(self) -> None:
        for spec in self._metadata.fetches:
            # Never blocks: reads run on the fetcher's threads, their progress goes in the report.
            job = FetchJob.from_spec(spec)
            self._fetch_jobs[spec.fetch_id] = job
            self.fetcher.start(job)

    def abort_step(self, metadata: ConnectorMetadata | None = None) -> None:
        self._abort_bound_step()
        if metadata is not None and metadata.step_number > self._num_steps_bound:
            # The step raised before the runner bound its metadata: bound now, it ends as a
            # step failing at once (its saves skipped, its loads ended; its fetches are for
            # requests still waiting, so they run).
            self.bind_connector_metadata(metadata)
            self._start_fetches()
            self._abort_bound_step()

    def _abort_bound_step(self) -> None:
        loads, self._loads = self._loads, []
        for load in loads:
            self.cache_engine.finish_load(load.plan)  # waits for queued moves, drops read pins
        self._end_loads(len(loads))
        self.cache_engine.tiers.write_gate.release()
        for index, spec in enumerate(self._metadata.saves[self._num_saves_queued :], self._num_saves_queued):
            # a store that raised may have queued copies into its slots: those stay reserved
            self._saved(spec.request_id, 0, self._unfilled(spec) if index >= self._num_saves_started else [])
        self._apply_releases()  # the step's loads are over: no pin of them is needed
        self._metadata = ConnectorMetadata()
        self._clear_failed_loads()
        self._num_saves_queued = 0
        self._num_saves_started = 0

    def _end_loads(self, num_planned: int) -> None:
        """Every load of the bound metadata is over (moved, stopped or dropped): the next
        report lists them, so the scheduler side drops the pins it holds for them (once),
        and gives back the promotion slots of those never planned (the first ``num_planned``
        reported theirs)."""
        if not self._loads_ended:
            self._loads_ended = True
            with self._report_lock:
                self._report.ended_loads += [
                    (spec.request_id, spec.num_load_start) for spec in self._metadata.loads
                ]
                if not self.grants_own_slots:
                    for spec in self._metadata.loads[num_planned:]:
                        self._report.fills += _unfilled_promotions(self.cache_engine, spec)

    def _clear_failed_loads(self) -> None:
        self._request_id_to_num_valid = {}

    def _on_saved(self, request_id: str, store: PendingStore):
        fills = [] if store.granted_here else store.fills
        return lambda num_saved_tokens: self._saved(request_id, num_saved_tokens, fills)

    def _unfilled(self, spec: SaveSpec) -> list[tuple[str, int, bool]]:
        """A save skipped before any copy: each slot the scheduler side granted it is given
        back (reported unfilled). The keys are the engine's cut of the same chunks."""
        if self.grants_own_slots or not spec.slot_ids:
            return []
        return _given_back(
            self.cache_engine,
            spec.token_ids[: spec.num_save_end],
            spec.cache_salt,
            spec.num_save_start,
            spec.slot_ids,
        )

    def _saved(self, request_id: str, num_saved_tokens: int, fills: list[tuple[str, int, bool]]) -> None:
        """A save read its blocks (or was skipped): the next report says it, with the
        granted slots it filled (or gave back)."""
        with self._report_lock:
            self._report.saves.append((request_id, num_saved_tokens))
            self._report.fills += fills

    # ---- fetches -------------------------------------------------------------
    def _apply_releases(self) -> None:
        """Release the bound metadata's released fetches (once)."""
        if not self._releases_applied:
            self._releases_applied = True
            self.release_fetches(self._metadata.released_fetch_ids)

    def release_fetches(self, fetch_ids: Sequence[int]) -> None:
        for fetch_id in fetch_ids:
            job = self._fetch_jobs.pop(fetch_id, None)
            if job is not None:
                self.fetcher.release(job)

    def wait_for_transfers(self, timeout_s: float) -> None:
        if self.fetcher is not None:
            self.fetcher.wait_for_progress(timeout_s)

    def _fetch_progress(self) -> list[FetchProgress]:
        """Fetches that ended since the last call (their figures counted), and with
        ``pipelined_loads`` running ones whose ready prefix grew."""
        fetcher = self.fetcher
        progress = []
        for job in fetcher.poll():
            tier_to_chunks = Counter(job.tier_names[: job.num_ready_chunks])
            self.cache_engine.tiers.count_hits({t: n for t, n in tier_to_chunks.items() if t != "cpu"})
            tier_to_transfer = {}
            for tier_name, (num_bytes, seconds) in job.tier_to_transfer.items():
                # its reads of that tier ran that tier's reads in flight at a time
                num_reads = sum(1 for name in job.tier_names if name == tier_name)
                connections = min(num_reads, fetcher.tier_to_reads_in_flight[tier_name])
                tier_to_transfer[tier_name] = (num_bytes, seconds, connections)
            progress.append(
                FetchProgress(
                    job.fetch_id, job.request_id, job.num_ready_chunks, True, job.cut, tier_to_transfer
                )
            )
        if self.pipelined_loads:
            for job in fetcher.poll_progress():
                progress.append(FetchProgress(job.fetch_id, job.request_id, job.num_reported_ready, False))
        return progress

    def finish_saves(self) -> None:
        """Block until every save issued so far has read its blocks and is published."""
        self.cache_engine.publish_finished_stores(wait=True)

    def attach_kv_events(self, record) -> None:
        self.cache_engine.tiers.attach_kv_events(record)

    def start_background_allocation(self) -> None:
        self.cache_engine.tiers.start_background_allocation()

    def flush(self) -> None:
        self.finish_saves()
        self.cache_engine.tiers.flush()

    def take_report(self) -> WorkerReport:
        """What this side did since the last report: saves that read their blocks, finished
        loads, the bound step's load failures (once), the fetches' reads that ended (fills:
        the scheduler side publishes them), fetches that ended and, with
        ``pipelined_loads``, running fetches whose ready prefix grew (their requests load
        it while the rest is read: partial receives), and the CPU tier's read rate."""
        self.cache_engine.publish_finished_stores()
        self._num_reports += 1
        fetches = self._fetch_progress() if self.fetcher is not None else []
        # after the progress: every chunk it counts as ready has its fill in this report or an earlier one
        fills = self.fetcher.take_fills(self._num_reports) if self.fetcher is not None else []
        if self.grants_own_slots:
            self.cache_engine.settle_write_throughs()
            written_through = []
        else:
            written_through = self.cache_engine.tiers.take_written_through()
        with self._report_lock:
            report, self._report = self._report, WorkerReport()
        report.fetches = fetches
        report.fills += fills
        report.written_through = written_through
        report.report_number = self._num_reports
        if not self._failures_reported:
            self._failures_reported = True
            report.load_failures = dict(self._request_id_to_num_valid)
        return report

    # ---- pipeline stages after the first (their scheduler side runs in another process) ----
    def add_load_failures(self, request_id_to_num_valid: dict[str, int]) -> None:
        """An earlier pipeline stage's loads of these requests stopped early (request id →
        leading tokens truly in its cache): this stage's KV of the tokens after that was
        computed from wrong inputs. Called after ``start_load_kv``, before ``wait_for_save``:
        such a request saves nothing this step and is reported by ``load_failures`` with
        the smaller of both lengths (one consistent mask over every stage)."""
        metadata = self._metadata
        here = {spec.request_id for spec in (*metadata.loads, *metadata.saves)}
        for request_id, num_valid in request_id_to_num_valid.items():
            if request_id not in here:
                continue  # neither loads nor saves here this step: nothing of it to drop
            own = self._request_id_to_num_valid.get(request_id)
            self._request_id_to_num_valid[request_id] = num_valid if own is None else min(own, num_valid)

    def load_failures(self) -> dict[str, int]:
        """Request id → leading tokens truly in the paged cache, for loads that stopped
        at a missing or corrupt chunk this step."""
        return dict(self._request_id_to_num_valid)

    def close(self) -> None:
        """Finish saves in flight and queued lower-tier writes, close the tiers (idempotent)."""
        self.finish_saves()
        if self.fetcher is not None:
            self.fetcher.close()
        self.cache_engine.tiers.close()
