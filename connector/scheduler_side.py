"""Scheduler-side connector: decides what each step loads, fetches and saves (no
tensors other than slot maps). Called only from the engine's scheduler thread.

Per request it keeps one :class:`~connector.request_transfer.RequestTransfer`:
its lookup (asked once, lower tiers in the background, see ``connector.lookup``),
the planner's decision, the fetch that brings lower-tier chunks into the CPU
tier while the request waits unadmitted, and its saves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from connector.base import (
    ConnectorMetadata,
    ConnectorRequest,
    KVConnectorScheduler,
    LoadSpec,
    RequestTransferStats,
    SaveSpec,
    ScheduledRequest,
    TailLoad,
)
from connector.cache_engine import CacheEngine
from connector.cpu_tier import PinKind
from connector.fetcher import ChunkFetcher, FetchJob
from connector.lookup import TierLookups
from connector.planner import TIER_PROBE_DEADLINE_S, LoadPlanner
from connector.request_transfer import RequestTransfer, TransferPhase, TransferRegistry
from connector.tiers import LOAD_WRITE_HOLD_S

log = logging.getLogger(__name__)

#: request ids of the planner's probe fetches (never an engine request's: no registry entry)
PROBE_ID_PREFIX = "kvstash-tier-probe-"


def slot_mapping_for(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """int64 [num_tokens]: slot of token i = block_ids[i // block_size] * block_size + i % block_size.

    Called for every load and save spec, on the path of a hit's first copy: numpy over
    the blocks (one broadcast add) rather than torch indexing over the tokens, which
    cost ~0.2 ms per 8k tokens on an H100's host and several ms on a busy CPU."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    blocks = np.asarray(block_ids[: (num_tokens + block_size - 1) // block_size], dtype=np.int64)
    slots = (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)
    return torch.from_numpy(slots[:num_tokens])


class OffloadScheduler(KVConnectorScheduler):
    """Looks up prompts in the tiers, plans load-or-recompute, records loads at
    admission and fetches for requests that wait, and emits saves of prompt chunks
    as they are computed (plus the trailing partial chunk at the end of the prompt
    when ``save_partial_chunks``). Output tokens are never saved, so uncomputed or
    rejected speculative tokens cannot reach the store."""

    def __init__(
        self,
        cache_engine: CacheEngine,
        registry: TransferRegistry,
        *,
        block_size: int,
        lookups: TierLookups | None = None,
        planner: LoadPlanner | None = None,
        fetcher: ChunkFetcher | None = None,
        pipelined_loads: bool = True,
    ) -> None:
        self.cache_engine = cache_engine
        self.registry = registry
        self.block_size = block_size
        self.chunk_size = cache_engine.token_db.chunk_size
        self.save_partial_chunks = cache_engine.token_db.save_partial_chunks
        self.lookups = lookups
        self.planner = planner
        #: None without a CPU tier: lower-tier chunks are then read in the step (no fetch)
        self.fetcher = fetcher
        #: load a fetch's chunks as they arrive (see ``get_num_tail_tokens``); off: once it ended
        self.pipelined_loads = pipelined_loads
        self._pending_loads: list[LoadSpec] = []
        self._pending_fetches: list[FetchJob] = []
        self._num_probes = 0

    @staticmethod
    def _prompt(request: ConnectorRequest) -> tuple[int, ...]:
        return tuple(request.all_token_ids[: request.num_prompt_tokens])

    # ---- admission -----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = self._prompt(request)
        transfer = self.registry.get_or_create(request.request_id, prompt, request.cache_salt)
        if transfer.phase is TransferPhase.ADMITTED:
            self._release_held(transfer)  # a tail fetch or deferred load of the preempted admission
            self.registry.preempted(transfer)  # back in the queue: ask again
        num_loadable_end = request.num_prompt_tokens - 1
        if transfer.phase is TransferPhase.FETCHED:
            transfer.num_computed_at_plan = num_computed_tokens  # the GPU hit may have changed
            return self._fetched_tokens(transfer, num_computed_tokens), False
        if transfer.phase is TransferPhase.FETCHING:
            # Readmitted because part of its fetch arrived (pipelined loads): it is admitted
            # to load that part and compute nothing (its compute limit) while the rest comes.
            transfer.num_computed_at_plan = num_computed_tokens
            num_ready_end = self._ready_end(transfer, transfer.fetch)  # read once: it grows meanwhile
            if num_ready_end <= num_computed_tokens:
                transfer.compute_limit = None
                return num_loadable_end - num_computed_tokens, True  # nothing new: it waits on
            transfer.compute_limit = num_ready_end
            return num_ready_end - num_computed_tokens, False
        spans = self.cache_engine.token_db.chunk_spans(prompt, transfer.cache_salt)
        chunk_tiers = self._chunk_tiers(transfer, [span.key for span in spans], num_computed_tokens)
        if chunk_tiers is None:
            return None, False
        num_hit = spans[len(chunk_tiers) - 1].end if chunk_tiers else 0
        transfer.num_computed_at_plan = num_computed_tokens
        if num_computed_tokens >= num_loadable_end or num_hit <= num_computed_tokens:
            transfer.decision = None
            transfer.figures.num_planned_recompute_tokens = len(prompt) - min(
                num_computed_tokens, num_loadable_end
            )
            return 0, False
        if self.planner is None or self.fetcher is None:
            # Without a CPU tier every hit is read in the admitting step (the old, blocking path).
            return max(0, min(num_hit, num_loadable_end) - num_computed_tokens), False
        decision = self.planner.plan(
            chunk_tiers,
            [span.end for span in spans[: len(chunk_tiers)]],
            num_computed=num_computed_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
        )
        transfer.decision = decision
        transfer.num_computed_at_plan = num_computed_tokens
        transfer.figures.num_planned_recompute_tokens = decision.num_planned_recompute_tokens
        transfer.figures.plan = decision.describe()
        if decision.num_fetch_chunks and decision.num_head_end == decision.num_cpu_end:
            return decision.num_fetch_end - num_computed_tokens, True
        transfer.token_origins = [(num_computed_tokens, decision.num_cpu_end, "cpu")]
        return max(0, decision.num_cpu_end - num_computed_tokens), False

    def _chunk_tiers(
        self, transfer: RequestTransfer, keys: list[str], num_computed_tokens: int
    ) -> list[str] | None:
        """The tier of each chunk of the hit prefix (asked once per admission; the CPU
        tier's part refreshed at each call), or None while the lower tiers have not answered."""
        if transfer.chunk_tiers is None:
            num_loadable_end = len(transfer.prompt) - 1
            if self.lookups is None:
                tiers = self.cache_engine.tiers
                names = [tier.name for tier in tiers.tiers]
                transfer.chunk_tiers = [names[0] if len(names) == 1 else "lower"] * tiers.contains_prefix(
                    keys
                )
            elif num_computed_tokens >= num_loadable_end:
                # A full GPU hit loads nothing: the CPU tier's answer is enough (for saves).
                cpu = self.cache_engine.tiers.cpu
                transfer.chunk_tiers = ["cpu"] * (cpu.contains(keys) if cpu is not None else 0)
            else:
                if transfer.lookup is None:
                    transfer.lookup = self.lookups.start(keys)
                found = self.lookups.result(transfer.lookup)
                if found is None:
                    return None
                transfer.chunk_tiers = list(found)
            return transfer.chunk_tiers
        cpu = self.cache_engine.tiers.cpu
        if cpu is None or self.lookups is None:
            return transfer.chunk_tiers
        num_cpu = cpu.contains(keys)
        cached = transfer.chunk_tiers
        merged = ["cpu"] * num_cpu
        for index in range(num_cpu, len(cached)):
            if cached[index] == "cpu":
                break  # evicted since the lookup: where it is now is unknown
            merged.append(cached[index])
        transfer.chunk_tiers = merged
        return merged

    def _fetched_tokens(self, transfer: RequestTransfer, num_computed_tokens: int) -> int:
        """Tokens now loadable from the CPU tier after the request's fetch ended: the
        leading run of its chunks that arrived (the rest is recomputed)."""
        return max(0, self._ready_end(transfer, transfer.fetch) - num_computed_tokens)

    def _ready_end(self, transfer: RequestTransfer, job: FetchJob) -> int:
        """The prompt position up to which ``job``'s chunks are in the CPU tier (pinned for
        it), at most the prompt's last token (which is always computed); 0 when none are."""
        num_ready = job.num_ready_chunks
        if not num_ready:
            return 0
        spans = self.cache_engine.token_db.chunk_spans(transfer.prompt, transfer.cache_salt)
        return min(spans[job.first_chunk + num_ready - 1].end, len(transfer.prompt) - 1)

    def _fetch_origins(self, transfer: RequestTransfer, job: FetchJob, num_start: int, num_end: int) -> list:
        """(start, end, tier) of ``job``'s chunks within tokens [num_start, num_end) (a load
        of them): where the tokens it loads came from (the request's figures). Loads of one
        request never overlap, so neither do the origins recorded for them."""
        spans = self.cache_engine.token_db.chunk_spans(transfer.prompt, transfer.cache_salt)
        origins = []
        for index, tier in enumerate(job.tier_names[: job.num_ready_chunks]):
            span = spans[job.first_chunk + index]
            if span.end > num_start and span.start < num_end:
                origins.append((max(span.start, num_start), min(span.end, num_end), tier))
        return origins

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        prompt = self._prompt(request)
        transfer = self.registry.get_or_create(request.request_id, prompt, request.cache_salt)
        num_gpu_hit = transfer.num_computed_at_plan
        num_load_end = num_gpu_hit + num_external_tokens
        decision = transfer.decision
        phase = transfer.phase
        if transfer.phase is TransferPhase.FETCHING and not block_ids:
            return  # nothing new arrived beyond its GPU hit: back to waiting for its fetch
        if transfer.phase is TransferPhase.NEW and decision is not None and self.planner is not None:
            self.planner.record(decision, transfer.num_computed_at_plan)
            probe_chunk = self.planner.claim_probe(decision, transfer.chunk_tiers or [])
            if probe_chunk is not None:
                self._start_probe(transfer, probe_chunk)
        splits = (
            decision is not None
            and decision.num_fetch_chunks
            and decision.num_head_end > decision.num_cpu_end
        )
        if (
            transfer.phase is TransferPhase.NEW
            and decision is not None
            and decision.num_fetch_chunks
            and not splits
        ):
            if block_ids:
                raise ValueError(f"request {request.request_id!r} must wait for its fetch without blocks")
            self._start_fetch(transfer)
            return
        spans = self.cache_engine.token_db.chunk_spans(prompt, transfer.cache_salt)
        # Admitted with part of its fetch in (pipelined loads): it loads that part now and
        # keeps its fetch for the rest, computing nothing until it ended.
        partial = transfer.phase is TransferPhase.FETCHING
        if transfer.phase is TransferPhase.FETCHED or partial:
            transfer.token_origins = self._fetch_origins(
                transfer, transfer.fetch, num_gpu_hit, num_gpu_hit + num_external_tokens
            )
        chunk_tiers = transfer.chunk_tiers or []
        num_hit = spans[len(chunk_tiers) - 1].end if chunk_tiers else 0
        tail = None
        if splits and transfer.phase is TransferPhase.NEW:
            # The head is recomputed from now on while the tail comes into the CPU tier.
            tail = self._start_fetch(transfer, first_chunk=decision.first_fetch_chunk)
        self.registry.admitted(transfer, num_gpu_hit, num_external_tokens)
        if tail is not None:
            transfer.fetch = tail
            transfer.tail_pending = True
            transfer.compute_limit = decision.num_head_end
        elif partial:
            transfer.tail_pending = True
            transfer.compute_limit = num_load_end  # what arrived, or the part of it the step's time held
        elif (
            phase is TransferPhase.FETCHED
            and num_external_tokens > 0
            and num_load_end < self._ready_end(transfer, transfer.fetch)
        ):
            # The step's time held only part of what its fetch brought: the fetch keeps the
            # rest pinned and the request loads it at its compute limit in the next steps.
            transfer.tail_pending = True
            transfer.compute_limit = num_load_end
        # what get_num_new_matched_tokens offered from the CPU tier (without a planner: the
        # CPU tier is the only one)
        num_cpu_end = decision.num_cpu_end if decision is not None else min(num_hit, len(prompt) - 1)
        if phase is TransferPhase.NEW and num_external_tokens > 0 and num_load_end < num_cpu_end:
            # The same for a hit in the CPU tier: its rest is pinned for the next steps.
            self._defer_cpu_load(transfer, spans, num_load_end, num_cpu_end)
        if transfer.num_expected_computed is None:
            # Chunks wholly present need no save; a present trailing partial chunk counts
            # only when the whole prompt is present.
            transfer.num_saved = num_hit if num_hit == len(prompt) else num_hit - num_hit % self.chunk_size
        if num_external_tokens > 0:
            # From here until the load's copies are queued and done, the step thread needs
            # the host: the disk tier's background writes wait (the worker releases them).
            self.cache_engine.tiers.write_gate.hold(LOAD_WRITE_HOLD_S)
            # Lookup pins: released by the load's plan (or the pin timeout).
            self.cache_engine.tiers.pin([span.key for span in spans if span.start < num_load_end])
            self._pending_loads.append(
                LoadSpec(
                    request.request_id,
                    prompt,
                    slot_mapping_for(block_ids, self.block_size, num_load_end),
                    num_gpu_hit,
                    num_load_end,
                    transfer.cache_salt,
                )
            )
        if transfer.fetch is not None and self.fetcher is not None and not transfer.tail_pending:
            self.fetcher.release(transfer.fetch)  # the lookup pins above hold the chunks now
            transfer.fetch = None

    # ---- a head recomputed while the tail is fetched -------------------------------
    def get_compute_limit(self, request: ConnectorRequest) -> int | None:
        transfer = self.registry.get(request.request_id)
        if transfer is None:
            return None
        decision = transfer.decision
        admitting_split = (
            transfer.phase is TransferPhase.NEW
            and decision is not None
            and decision.num_fetch_chunks
            and decision.num_head_end > decision.num_cpu_end
        )
        if (
            transfer.tail_pending
            or transfer.num_deferred_end is not None
            or transfer.phase is TransferPhase.FETCHING
        ):
            return transfer.compute_limit
        return decision.num_head_end if admitting_split else None

    def estimate_load_seconds(self, num_tokens: int) -> float:
        # The CPU tier's rate is measured from the loads' whole span: the host's read of
        # the slots, then the host->device copies and the unpacks (CUDA events around them).
        if self.planner is None or num_tokens <= 0:
            return 0.0
        return num_tokens * self.cache_engine.bytes_per_token / self.planner.tier_rate("cpu")

    def fit_load_tokens(self, num_start: int, num_tokens: int, seconds_left: float | None) -> int:
        if seconds_left is None or self.planner is None or num_tokens <= 0:
            return num_tokens
        num_end = num_start + num_tokens
        chunk = self.chunk_size
        num_first_end = (num_start // chunk + 1) * chunk  # the first chunk always loads
        if num_first_end >= num_end or self.estimate_load_seconds(num_tokens) <= seconds_left:
            return num_tokens
        seconds_per_token = self.estimate_load_seconds(num_tokens) / num_tokens
        num_fit_end = (num_start + int(seconds_left / seconds_per_token)) // chunk * chunk
        return max(num_first_end, min(num_fit_end, num_end)) - num_start

    def get_num_tail_tokens(self, request: ConnectorRequest) -> TailLoad | None:
        transfer = self.registry.get(request.request_id)
        if transfer is not None and transfer.num_deferred_end is not None:
            # The rest of its admission's CPU-tier load; a fetched tail may come after its head.
            num_deferred = max(0, transfer.num_deferred_end - request.num_computed_tokens)
            return TailLoad(num_deferred, not transfer.tail_pending)
        if transfer is None or not transfer.tail_pending:
            return TailLoad(0, True)
        job = transfer.fetch
        done = job.done  # read before the ready chunks: a job that ended grows no more
        num_tail = max(0, self._ready_end(transfer, job) - request.num_computed_tokens)
        if done:
            return TailLoad(num_tail, True)
        if not self.pipelined_loads or num_tail == 0:
            return None
        return TailLoad(num_tail, False)

    def update_state_after_tail_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], tail: TailLoad
    ) -> None:
        transfer = self.registry.get(request.request_id)
        if transfer is not None and transfer.num_deferred_end is not None:
            self._load_deferred_piece(transfer, block_ids, request.num_computed_tokens, tail.num_tokens)
            return
        if transfer is None or not transfer.tail_pending:
            return
        job = transfer.fetch
        num_start = request.num_computed_tokens
        num_end = num_start + tail.num_tokens
        if tail.final:
            transfer.tail_pending = False
            transfer.fetch = None
            transfer.compute_limit = None
        else:
            transfer.compute_limit = num_end  # it computes nothing until the rest is in
        if tail.num_tokens > 0:
            transfer.token_origins += self._fetch_origins(transfer, job, num_start, num_end)
            self._add_tail_load(transfer, block_ids, num_start, num_end)
        if tail.final and self.fetcher is not None:
            self.fetcher.release(job)  # the lookup pins above hold the chunks it loads

    def _add_tail_load(
        self, transfer: RequestTransfer, block_ids: Sequence[int], num_start: int, num_end: int
    ) -> list:
        """Record the load of prompt tokens [num_start, num_end) at a request's compute limit
        for the next metadata, its chunks lookup-pinned until the load's plan; returns the
        prompt's chunk spans."""
        spans = self.cache_engine.token_db.chunk_spans(transfer.prompt, transfer.cache_salt)
        # As at admission: every chunk up to the load's end (the plan releases them all).
        self.cache_engine.tiers.pin([span.key for span in spans if span.start < num_end])
        self.registry.admitted(transfer, transfer.figures.num_gpu_hit_tokens, num_end - num_start)
        self._pending_loads.append(
            LoadSpec(
                transfer.request_id,
                transfer.prompt,
                slot_mapping_for(block_ids, self.block_size, num_end),
                num_start,
                num_end,
                transfer.cache_salt,
            )
        )
        return spans

    # ---- an admission's CPU-tier load cut short by the step's time --------------------
    def _defer_cpu_load(self, transfer: RequestTransfer, spans: list, num_start: int, num_end: int) -> None:
        """The admitting step loads the CPU tier's tokens up to ``num_start`` only: pin the
        chunks of [num_start, num_end) for the request (those still there; the rest of the
        hit after a missing one is recomputed) and stop its compute at ``num_start`` until
        they are loaded."""
        cpu = self.cache_engine.tiers.cpu
        keys = [span.key for span in spans if span.end > num_start and span.start < num_end]
        num_pinned = cpu.pin(keys, PinKind.DEFERRED) if cpu is not None else 0
        if num_pinned == 0:
            return
        last = next(span for span in spans if span.key == keys[num_pinned - 1])
        transfer.deferred_keys = keys[:num_pinned]
        transfer.num_deferred_end = min(num_end, last.end)
        transfer.compute_limit = num_start

    def _load_deferred_piece(
        self, transfer: RequestTransfer, block_ids: Sequence[int], num_start: int, num_tokens: int
    ) -> None:
        """Load the next ``num_tokens`` of the deferred rest from ``num_start`` (the request's
        compute limit); the lookup pins of the load take over its chunks' deferred pins."""
        num_end = num_start + num_tokens
        if num_tokens > 0:
            spans = self._add_tail_load(transfer, block_ids, num_start, num_end)
            taken = {span.key for span in spans if span.start < num_end}
            self._unpin_deferred(transfer, [key for key in transfer.deferred_keys if key in taken])
        if num_end >= transfer.num_deferred_end:
            self._unpin_deferred(transfer, list(transfer.deferred_keys))
            transfer.num_deferred_end = None
            # next: the head recomputed while its tail is fetched, or everything after it
            transfer.compute_limit = transfer.decision.num_head_end if transfer.tail_pending else None
        else:
            transfer.compute_limit = num_end

    def _unpin_deferred(self, transfer: RequestTransfer, keys: list[str]) -> None:
        if not keys:
            return
        self.cache_engine.tiers.cpu.unpin(keys, PinKind.DEFERRED)
        dropped = set(keys)
        transfer.deferred_keys = [key for key in transfer.deferred_keys if key not in dropped]

    def _release_held(self, transfer: RequestTransfer) -> None:
        """Drop what the request holds for loads still to come (an abort, a preemption, a
        roll-back): its fetch and its pins, and the deferred rest of its CPU-tier load."""
        if transfer.fetch is not None and self.fetcher is not None:
            self.fetcher.release(transfer.fetch)
        self._unpin_deferred(transfer, list(transfer.deferred_keys))
        transfer.num_deferred_end = None

    def _start_fetch(self, transfer: RequestTransfer, first_chunk: int | None = None) -> FetchJob:
        """The chunks from the first one not on the GPU (or ``first_chunk``: a tail) to the
        planned fetch end: the CPU tier's are pinned while the request waits, the others
        are read into it."""
        decision = transfer.decision
        spans = self.cache_engine.token_db.chunk_spans(transfer.prompt, transfer.cache_salt)
        first = first_chunk
        if first is None:
            first = next(i for i, span in enumerate(spans) if span.end > transfer.num_computed_at_plan)
        spans = spans[first : decision.first_fetch_chunk + decision.num_fetch_chunks]
        engine = self.cache_engine
        job = FetchJob(
            transfer.request_id,
            [span.key for span in spans],
            [
                (engine.num_layers, 2, span.end - span.start, engine.num_kv_heads, engine.head_dim)
                for span in spans
            ],
            list(transfer.chunk_tiers[first : first + len(spans)]),
            deadline_s=decision.fetch_deadline_s,
            first_chunk=first,
        )
        self.registry.fetch_started(transfer, job)
        self._pending_fetches.append(job)
        return job

    def _start_probe(self, transfer: RequestTransfer, chunk: int) -> None:
        """Read chunk ``chunk`` of the request's hit into the CPU tier in the background,
        only to measure its tier (the planner's probe; the request does not wait for it).
        The worker reports its rate to the planner and releases it when it ends."""
        span = self.cache_engine.token_db.chunk_spans(transfer.prompt, transfer.cache_salt)[chunk]
        engine = self.cache_engine
        self._num_probes += 1
        self._pending_fetches.append(
            FetchJob(
                f"{PROBE_ID_PREFIX}{self._num_probes}",
                [span.key],
                [(engine.num_layers, 2, span.end - span.start, engine.num_kv_heads, engine.head_dim)],
                [transfer.chunk_tiers[chunk]],
                deadline_s=TIER_PROBE_DEADLINE_S,
                first_chunk=chunk,
                probe=True,
            )
        )

    # ---- per step ------------------------------------------------------------------
    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        metadata = ConnectorMetadata(loads=self._pending_loads, fetches=self._pending_fetches)
        self._pending_loads = []
        self._pending_fetches = []
        for entry in scheduled:
            transfer = self.registry.get(entry.request_id)
            if transfer is None or transfer.finished:
                continue
            num_prompt = len(transfer.prompt)
            num_computed = entry.num_computed_tokens
            expected = transfer.num_expected_computed
            if expected is not None and num_computed < expected and num_computed < transfer.num_saved:
                # A load failure or preemption moved the request back: its KV past that point
                # is recomputed, so save again from there (chunks still in the CPU tier are skipped).
                transfer.num_saved = num_computed - num_computed % self.chunk_size
            num_computed_after = min(entry.num_computed_tokens + entry.num_scheduled_tokens, num_prompt)
            transfer.num_expected_computed = entry.num_computed_tokens + entry.num_scheduled_tokens
            num_save_end = num_computed_after - num_computed_after % self.chunk_size
            if num_computed_after == num_prompt and self.save_partial_chunks:
                num_save_end = num_prompt
            if num_save_end <= transfer.num_saved:
                continue
            metadata.saves.append(
                SaveSpec(
                    entry.request_id,
                    transfer.prompt,
                    slot_mapping_for(entry.block_ids, self.block_size, num_save_end),
                    transfer.num_saved,
                    num_save_end,
                    transfer.cache_salt,
                )
            )
            self.registry.save_issued(transfer)
            transfer.num_saved = num_save_end
        return metadata

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        # Ended by a step that raised while scheduling: its load must never reach freed blocks.
        self._pending_loads = [spec for spec in self._pending_loads if spec.request_id != request.request_id]
        self._pending_fetches = [job for job in self._pending_fetches if job.request_id != request.request_id]
        transfer, sending = self.registry.finish(request.request_id)
        if transfer is not None:
            self._release_held(transfer)  # an abort while waiting or partly loaded: its pins go now
        # The engine writes the request's one log line with these figures (request_stats).
        return sending

    def request_rolled_back(self, request: ConnectorRequest) -> None:
        self._pending_loads = [spec for spec in self._pending_loads if spec.request_id != request.request_id]
        self._pending_fetches = [job for job in self._pending_fetches if job.request_id != request.request_id]
        transfer = self.registry.get(request.request_id)
        if transfer is not None:
            self._release_held(transfer)
            self.registry.preempted(transfer)  # looked up and planned again when readmitted

    def wait_for_transfers(self, timeout_s: float) -> None:
        if self.fetcher is not None:
            self.fetcher.wait_for_progress(timeout_s)

    def flush(self) -> None:
        self.cache_engine.publish_finished_stores(wait=True)
        self.cache_engine.tiers.flush()

    def request_stats(self, request_id: str) -> RequestTransferStats | None:
        return self.registry.stats(request_id)
