"""Scheduler-side connector: decides what each step loads, fetches and saves (no
tensors other than slot maps). Called only from the engine's scheduler thread.

Per request it keeps one :class:`~connector.request_transfer.RequestTransfer`:
its lookup (asked once, lower tiers in the background, see ``connector.lookup``),
the planner's decision, the fetch that brings lower-tier chunks into the CPU
tier while the request waits unadmitted, and its saves.

It talks to the worker side through plain data only: the step's
:class:`~connector.base.ConnectorMetadata` (loads, saves, fetches to start, fetches to
release) and the worker's :class:`~connector.base.WorkerReport`, applied by
:meth:`OffloadScheduler.update_connector_output`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from connector.base import (
    SAVE_NO_CPU,
    ConnectorMetadata,
    ConnectorRequest,
    FetchSpec,
    Grant,
    GrantWait,
    KVConnectorScheduler,
    LoadSpec,
    RequestTransferStats,
    SaveSpec,
    ScheduledRequest,
    WorkerReport,
    slot_mapping_for,
)
from connector.lookup import TierLookups
from connector.planner import LoadDecision, LoadPlanner
from connector.request_transfer import (
    ADMITTED_PHASES,
    ENDED_PHASES,
    FetchState,
    RequestTransfer,
    TransferPhase,
    TransferRegistry,
)
from connector.scheduler_index import SchedulerIndex
from connector.slot_grants import SlotGrants
from connector.slot_index import PinKind, SlotIndex
from connector.tier_probe import TierProber

log = logging.getLogger(__name__)


class OffloadScheduler(KVConnectorScheduler):
    """Looks up prompts in the tiers, plans load-or-recompute, records loads at
    admission and fetches for requests that wait, and emits saves of prompt chunks
    as they are computed (plus the trailing partial chunk at the end of the prompt
    when ``save_partial_chunks``). Output tokens are never saved, so uncomputed or
    rejected speculative tokens cannot reach the store."""

    def __init__(
        self,
        index: SchedulerIndex,
        registry: TransferRegistry,
        *,
        block_size: int,
        lookups: TierLookups | None = None,
        planner: LoadPlanner | None = None,
        fetches: bool = False,
        pipelined_loads: bool = True,
        prober: TierProber | None = None,
    ) -> None:
        #: what this side reads and pins of the tiers: keys, shapes, membership (no bytes)
        self.index = index
        #: the CPU tier's index (which chunk each slot holds, pins; no memory): the only
        #: part of the CPU tier this side reads or pins (None: no CPU tier)
        self.cpu_index: SlotIndex | None = index.cpu_index
        #: the saves' and fetches' slots and pins in that index (the worker only fills slots)
        self.grants: SlotGrants | None = index.grants
        #: the highest report number applied (``ConnectorMetadata.num_reports_applied``)
        self._num_reports_applied = 0
        #: the CPU tier is a staging area (fetched chunks only: stores skip it)
        self.cpu_staging = index.cpu_staging
        self.registry = registry
        self.block_size = block_size
        self.chunk_size = index.token_db.chunk_size
        self.save_partial_chunks = index.token_db.save_partial_chunks
        self.lookups = lookups
        self.planner = planner
        #: measures the lower tiers in the background for the planner (the tiers close it first)
        self.prober = prober
        #: whether the worker side fetches in the background (False without a CPU tier:
        #: lower-tier chunks are then read in the step)
        self.fetches = fetches
        #: load a fetch's chunks as they arrive (at the compute limit); off: once it ended
        self.pipelined_loads = pipelined_loads
        self._pending_loads: list[LoadSpec] = []
        self._pending_fetches: list[FetchSpec] = []
        #: fetches released since the last metadata (``ConnectorMetadata.released_fetch_ids``)
        self._released_fetch_ids: list[int] = []
        self._num_fetches = self._num_steps = 0  # fetch ids, metadata numbers handed out so far

    def _transfer_of(self, request: ConnectorRequest) -> RequestTransfer:
        transfer = self.registry.get(request.request_id)
        if transfer is not None:
            return transfer
        prompt = tuple(request.all_token_ids[: request.num_prompt_tokens])
        token_db = self.index.token_db
        return self.registry.get_or_create(
            request.request_id,
            prompt,
            request.cache_salt,
            cut_spans=lambda: token_db.chunk_spans(prompt, request.cache_salt),
        )

    # ---- the step's question -------------------------------------------------------
    def grant(self, request: ConnectorRequest, num_computed_tokens: int, seconds_left: float | None) -> Grant:
        transfer = self._transfer_of(request)
        if transfer.phase in ADMITTED_PHASES:
            return self._grant_running(transfer, num_computed_tokens, seconds_left)
        return self._grant_admission(transfer, num_computed_tokens, seconds_left)

    def _grant_admission(
        self, transfer: RequestTransfer, num_gpu_hit: int, seconds_left: float | None
    ) -> Grant:
        """A waiting request: what it loads from the tiers after its GPU hit, whether it
        first waits for a lookup or a fetch, and where its compute stops (a head recomputed
        while the tail is fetched; nothing while a fetch's first part loads)."""
        num_loadable_end = len(transfer.prompt) - 1
        if transfer.phase is TransferPhase.FETCHED:
            num_ready = max(0, self._ready_end(transfer, transfer.fetch) - num_gpu_hit)
            return self._fitted(num_gpu_hit, num_ready, None, seconds_left)
        if transfer.phase is TransferPhase.FETCHING:
            # Readmitted because part of its fetch arrived (pipelined loads): it is admitted
            # to load that part and compute nothing (its compute limit) while the rest comes.
            num_ready_end = self._ready_end(transfer, transfer.fetch)  # read once: it grows meanwhile
            if num_ready_end <= num_gpu_hit:
                return Grant(num_gpu_hit, wait=GrantWait.FETCH)  # nothing new: it waits on
            return self._fitted(num_gpu_hit, num_ready_end - num_gpu_hit, 0, seconds_left)
        chunk_tiers = self._chunk_tiers(transfer, num_gpu_hit)
        if chunk_tiers is None:
            return Grant(num_gpu_hit, wait=GrantWait.LOOKUP)
        spans = transfer.spans
        num_hit = spans[len(chunk_tiers) - 1].end if chunk_tiers else 0
        if num_gpu_hit >= num_loadable_end or num_hit <= num_gpu_hit:
            transfer.planned(num_gpu_hit, None, len(transfer.prompt) - min(num_gpu_hit, num_loadable_end))
            return Grant(num_gpu_hit)
        if self.planner is None or not self.fetches:
            # Without a CPU tier every hit is read in the admitting step (the old, blocking path).
            transfer.planned(num_gpu_hit, None, transfer.figures.num_planned_recompute_tokens)
            return self._fitted(num_gpu_hit, min(num_hit, num_loadable_end) - num_gpu_hit, None, seconds_left)
        decision = self.planner.plan(
            chunk_tiers,
            [span.end for span in spans[: len(chunk_tiers)]],
            num_computed=num_gpu_hit,
            num_prompt_tokens=len(transfer.prompt),
        )
        if decision.num_fetch_chunks and decision.num_head_end == decision.num_cpu_end:
            transfer.planned(num_gpu_hit, decision, decision.num_planned_recompute_tokens)
            return Grant(num_gpu_hit, wait=GrantWait.FETCH)
        transfer.planned(
            num_gpu_hit,
            decision,
            decision.num_planned_recompute_tokens,
            [(num_gpu_hit, decision.num_cpu_end, "cpu")],
        )
        num_load = max(0, decision.num_cpu_end - num_gpu_hit)
        # A head recomputed while the tail is fetched stops where the tail starts.
        max_compute = decision.num_head_end - (num_gpu_hit + num_load) if _splits(decision) else None
        return self._fitted(num_gpu_hit, num_load, max_compute, seconds_left)

    def _grant_running(
        self, transfer: RequestTransfer, num_computed: int, seconds_left: float | None
    ) -> Grant:
        """A running request in its prompt: below its compute limit it computes up to it; at
        it, it loads what is there for it (the deferred rest of its CPU-tier load, or what its
        fetch brought), computing nothing while more is to come."""
        limit = transfer.compute_limit
        if limit is None:
            return Grant(num_computed)
        if num_computed < limit:
            return Grant(num_computed, 0, limit - num_computed)
        if transfer.phase is TransferPhase.DEFERRED:
            # The rest of its admission's CPU-tier load; a fetched tail may come after its head.
            num_load = max(0, transfer.num_deferred_end - num_computed)
            final = transfer.fetch is None
        else:
            fetch = transfer.fetch
            final = fetch.done
            num_load = max(0, self._ready_end(transfer, fetch) - num_computed)
            if not final and (not self.pipelined_loads or num_load == 0):
                return Grant(num_computed, wait=GrantWait.TAIL)
        return self._fitted(num_computed, num_load, None if final else 0, seconds_left)

    def _fitted(
        self, num_start: int, num_load: int, max_compute: int | None, seconds_left: float | None
    ) -> Grant:
        """A grant of ``num_load`` tokens from ``num_start`` on, cut to what the step's time
        left holds (then it computes nothing this step: the rest loads in the next steps)."""
        num_fit = self.fit_load_tokens(num_start, num_load, seconds_left)
        if num_fit < num_load:
            max_compute = 0
        return Grant(num_start, num_fit, max_compute, self.estimate_load_seconds(num_fit))

    def _chunk_tiers(self, transfer: RequestTransfer, num_computed_tokens: int) -> list[str] | None:
        """The tier of each chunk of the hit prefix (asked once per admission; the CPU
        tier's part refreshed at each call), or None while the lower tiers have not answered."""
        keys = [span.key for span in transfer.spans]
        if transfer.chunk_tiers is None:
            num_loadable_end = len(transfer.prompt) - 1
            if self.lookups is None:
                names = self.index.tiers.names
                name = names[0] if len(names) == 1 else "lower"
                transfer.looked_up([name] * self.index.tiers.contains_prefix(keys))
            elif num_computed_tokens >= num_loadable_end and not self.cpu_staging:
                # A full GPU hit loads nothing: the CPU tier's answer is enough (for saves;
                # a staging area holds no stores, so there the lower tiers are asked).
                index = self.cpu_index
                transfer.looked_up(["cpu"] * (index.contains(keys) if index is not None else 0))
            else:
                if transfer.lookup is None:
                    transfer.lookup_started(self.lookups.start(keys))
                found = self.lookups.result(transfer.lookup)
                if found is None:
                    return None
                transfer.looked_up(list(found))
            return transfer.chunk_tiers
        if self.cpu_index is None or self.lookups is None:
            return transfer.chunk_tiers
        num_cpu = self.cpu_index.contains(keys)
        cached = transfer.chunk_tiers
        merged = ["cpu"] * num_cpu
        for index in range(num_cpu, len(cached)):
            if cached[index] == "cpu":
                break  # evicted since the lookup: where it is now is unknown
            merged.append(cached[index])
        transfer.looked_up(merged)
        return merged

    def _ready_end(self, transfer: RequestTransfer, fetch: FetchState) -> int:
        """The prompt position up to which ``fetch``'s chunks are in the CPU tier (pinned for
        it, as last reported), at most the prompt's last token (which is always computed);
        0 when none are."""
        num_ready = fetch.num_ready_chunks
        if not num_ready:
            return 0
        return min(transfer.spans[fetch.first_chunk + num_ready - 1].end, len(transfer.prompt) - 1)

    def _fetch_origins(
        self, transfer: RequestTransfer, fetch: FetchState, num_start: int, num_end: int
    ) -> list:
        """(start, end, tier) of ``fetch``'s chunks within tokens [num_start, num_end) (a load
        of them): where the tokens it loads came from (the request's figures). Loads of one
        request never overlap, so neither do the origins recorded for them."""
        origins = []
        for index, tier in enumerate(fetch.tier_names[: fetch.num_ready_chunks]):
            span = transfer.spans[fetch.first_chunk + index]
            if span.end > num_start and span.start < num_end:
                origins.append((max(span.start, num_start), min(span.end, num_end), tier))
        return origins

    def estimate_load_seconds(self, num_tokens: int) -> float:
        """How long loading ``num_tokens`` tokens from the CPU tier into the paged cache is
        expected to take within a step (a grant's ``load_seconds``); 0.0 when unknown.
        The CPU tier's rate is measured from the loads' whole span: the host's read of the
        slots, then the host->device copies and the unpacks (CUDA events around them)."""
        if self.planner is None or num_tokens <= 0:
            return 0.0
        return num_tokens * self.index.geometry.bytes_per_token / self.planner.tier_rate("cpu")

    def fit_load_tokens(self, num_start: int, num_tokens: int, seconds_left: float | None) -> int:
        """How many of ``num_tokens`` tokens loadable from the CPU tier from prompt position
        ``num_start`` on one step loads when it may still grow by ``seconds_left`` (None: no
        time cap, all of them): the whole chunks whose load ``estimate_load_seconds`` expects
        to fit, and at least the first chunk (or all of them when fewer), so that a load
        always progresses."""
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

    # ---- what the scheduler did with a grant ---------------------------------------
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], grant: Grant
    ) -> None:
        transfer = self.registry.get(request.request_id)
        if transfer is None or transfer.phase in ENDED_PHASES:
            return
        if transfer.phase not in ADMITTED_PHASES:
            self._admit(transfer, block_ids, grant)
        elif transfer.compute_limit is not None and grant.num_computed_tokens >= transfer.compute_limit:
            self._load_at_limit(transfer, block_ids, grant)

    def _admit(self, transfer: RequestTransfer, block_ids: Sequence[int], grant: Grant) -> None:
        """Blocks were allocated for a waiting request's grant (or none: it waits for its fetch)."""
        num_gpu_hit, num_load_end = grant.num_computed_tokens, grant.num_load_end
        decision = transfer.decision
        phase = transfer.phase
        if grant.wait is GrantWait.FETCH:
            if block_ids:
                raise ValueError(f"request {transfer.request_id!r} must wait for its fetch without blocks")
            if phase is TransferPhase.NEW:
                self._record_plan(transfer)
                self._start_fetch(transfer)
            return  # FETCHING: nothing new arrived beyond its GPU hit, it waits on
        if phase is TransferPhase.NEW:
            self._record_plan(transfer)
        spans = transfer.spans
        origins = None
        if phase in (TransferPhase.FETCHED, TransferPhase.FETCHING):
            origins = self._fetch_origins(transfer, transfer.fetch, num_gpu_hit, num_load_end)
        chunk_tiers = transfer.chunk_tiers or []
        num_hit = spans[len(chunk_tiers) - 1].end if chunk_tiers else 0
        tail, compute_limit = None, None
        if phase is TransferPhase.NEW and decision is not None and _splits(decision):
            # The head is recomputed from now on while the tail comes into the CPU tier.
            tail = self._start_fetch(transfer, first_chunk=decision.first_fetch_chunk)
            compute_limit = decision.num_head_end
        elif phase is TransferPhase.FETCHING or (
            # The step's time held only part of what its fetch brought: the fetch keeps the
            # rest pinned and the request loads it at its compute limit in the next steps.
            phase is TransferPhase.FETCHED
            and grant.num_load_tokens > 0
            and num_load_end < self._ready_end(transfer, transfer.fetch)
        ):
            # Admitted with part of its fetch in (pipelined loads): it loads that part now and
            # keeps its fetch for the rest, computing nothing until it ended.
            tail, compute_limit = transfer.fetch, num_load_end
        done_fetch = transfer.fetch if tail is None else None
        transfer.admitted(num_gpu_hit, grant.num_load_tokens, origins, tail=tail, compute_limit=compute_limit)
        # what the grant offered from the CPU tier (without a planner: the only tier)
        num_cpu_end = decision.num_cpu_end if decision is not None else min(num_hit, len(transfer.prompt) - 1)
        if phase is TransferPhase.NEW and grant.num_load_tokens > 0 and num_load_end < num_cpu_end:
            # The step's time held only part of its CPU-tier hit: the rest is pinned for the next steps.
            self._defer_cpu_load(transfer, num_load_end, num_cpu_end)
        # Chunks wholly present need no save; a present trailing partial chunk counts
        # only when the whole prompt is present.
        transfer.saved_from(
            num_hit if num_hit == len(transfer.prompt) else num_hit - num_hit % self.chunk_size
        )
        if grant.num_load_tokens > 0:
            self._add_load(transfer, block_ids, num_gpu_hit, num_load_end)
        if done_fetch is not None:
            self._release_fetch(done_fetch.fetch_id)  # the load's lookup pins hold its chunks now

    def _record_plan(self, transfer: RequestTransfer) -> None:
        """The planner learns the plan admitted (the tiers it skipped are measured again)."""
        if transfer.decision is not None and self.planner is not None:
            self.planner.record(transfer.decision, transfer.num_computed_at_plan)

    def _load_at_limit(self, transfer: RequestTransfer, block_ids: Sequence[int], grant: Grant) -> None:
        """A running request at its compute limit loads what its grant gave: a piece of the
        deferred rest of its CPU-tier load, or what its fetch brought."""
        num_start, num_end = grant.num_computed_tokens, grant.num_load_end
        if transfer.phase is TransferPhase.DEFERRED:
            taken = set()
            if num_end > num_start:
                self._add_load(transfer, block_ids, num_start, num_end)
                # the lookup pins of the load take over its chunks' deferred pins
                taken = {span.key for span in transfer.spans if span.start < num_end}
            if num_end >= transfer.num_deferred_end:
                taken = set(transfer.deferred_keys)
            unpinned = [key for key in transfer.deferred_keys if key in taken]
            if unpinned:
                self.cpu_index.unpin(unpinned, PinKind.DEFERRED)
            transfer.deferred_piece_loaded(num_start, num_end, set(unpinned))
            return
        fetch = transfer.fetch
        final = grant.max_compute_tokens != 0
        origins = self._fetch_origins(transfer, fetch, num_start, num_end) if num_end > num_start else []
        transfer.tail_loaded(num_start, num_end, final, origins)
        if num_end > num_start:
            self._add_load(transfer, block_ids, num_start, num_end)
        if final:
            self._release_fetch(fetch.fetch_id)  # the lookup pins of the load hold the chunks it loads

    def _add_load(
        self, transfer: RequestTransfer, block_ids: Sequence[int], num_start: int, num_end: int
    ) -> None:
        """Record the load of prompt tokens [num_start, num_end) for the next metadata, every
        chunk up to its end lookup-pinned until the load's plan (which releases them all)."""
        self.index.tiers.pin([span.key for span in transfer.spans if span.start < num_end])
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

    def _defer_cpu_load(self, transfer: RequestTransfer, num_start: int, num_end: int) -> None:
        """The admitting step loads the CPU tier's tokens up to ``num_start`` only: pin the
        chunks of [num_start, num_end) for the request (those still there; the rest of the
        hit after a missing one is recomputed) and stop its compute at ``num_start`` until
        they are loaded."""
        spans = transfer.spans
        keys = [span.key for span in spans if span.end > num_start and span.start < num_end]
        num_pinned = self.cpu_index.pin(keys, PinKind.DEFERRED) if self.cpu_index is not None else 0
        if num_pinned == 0:
            return
        last = next(span for span in spans if span.key == keys[num_pinned - 1])
        transfer.deferred(keys[:num_pinned], min(num_end, last.end), num_start)

    def _release_held(self, transfer: RequestTransfer) -> None:
        """Drop what the request holds for loads still to come (an abort, a preemption, a
        roll-back): its fetch and its pins, and the deferred rest of its CPU-tier load."""
        if transfer.fetch is not None:
            self._release_fetch(transfer.fetch.fetch_id)
        if transfer.deferred_keys:
            self.cpu_index.unpin(list(transfer.deferred_keys), PinKind.DEFERRED)

    def _release_fetch(self, fetch_id: int) -> None:
        """Nobody loads the fetch's chunks any more: its pins go now (a load recorded from it
        holds its own lookup pins), and the worker side stops it with the next metadata or
        when the engine hands it the releases made with no step to follow
        (:meth:`take_released_fetch_ids`)."""
        if self.grants is not None:
            self.grants.release_fetch(fetch_id)
        self._released_fetch_ids.append(fetch_id)

    def _start_fetch(self, transfer: RequestTransfer, first_chunk: int | None = None) -> FetchState:
        """The chunks from the first one not on the GPU (or ``first_chunk``: a tail) to the
        planned fetch end: the CPU tier's are pinned while the request waits, the others
        are read into it. A whole fetch makes the request wait for it (FETCHING); a tail's
        belongs to the admission that starts it."""
        decision = transfer.decision
        spans = transfer.spans
        first = first_chunk
        if first is None:
            first = next(i for i, span in enumerate(spans) if span.end > transfer.num_computed_at_plan)
        spans = spans[first : decision.first_fetch_chunk + decision.num_fetch_chunks]
        self._num_fetches += 1
        spec = FetchSpec(
            self._num_fetches,
            transfer.request_id,
            tuple(span.key for span in spans),
            tuple(self.index.geometry.shape_of(span) for span in spans),
            tuple(transfer.chunk_tiers[first : first + len(spans)]),
            deadline_s=decision.fetch_deadline_s,
            first_chunk=first,
        )
        fetch = FetchState(spec.fetch_id, first, spec.tier_names)
        if first_chunk is None:
            self.registry.fetch_started(transfer, fetch)
        self._pending_fetches.append(spec)
        return fetch

    # ---- per step ------------------------------------------------------------------
    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        metadata = ConnectorMetadata(
            loads=[self._granted_load(spec) for spec in self._pending_loads],
            # each fetch's slots: reserved to fill, or pinned for it where the chunk is in already
            fetches=[self.grants.grant_fetch(spec) for spec in self._pending_fetches],
            released_fetch_ids=self.take_released_fetch_ids(),
            num_reports_applied=self._num_reports_applied,
            step_number=self._num_steps + 1,
        )
        self._num_steps, self._pending_loads, self._pending_fetches = metadata.step_number, [], []
        for entry in scheduled:
            transfer = self.registry.get(entry.request_id)
            if transfer is None or transfer.phase in ENDED_PHASES:
                continue
            num_prompt = len(transfer.prompt)
            transfer.step_scheduled(entry.num_computed_tokens, entry.num_scheduled_tokens, self.chunk_size)
            num_computed_after = min(entry.num_computed_tokens + entry.num_scheduled_tokens, num_prompt)
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
                    self._grant_save(transfer, transfer.num_saved, num_save_end),
                )
            )
            self.registry.save_issued(transfer, num_save_end)
        return metadata

    def _granted_load(self, spec: LoadSpec) -> LoadSpec:
        """``spec`` with the slots of its chunks the CPU tier holds, READ-pinned until a report
        says it ended (its lookup pins go then too; without a CPU tier the worker drops them),
        and, when the step reads the lower tiers (no fetcher), slots to promote the others into."""
        transfer = self.registry.get(spec.request_id)
        if self.grants is None or transfer is None:
            return spec
        covering = [span for span in transfer.spans if span.start < spec.num_load_end]
        spans = [span for span in covering if span.end > spec.num_load_start]
        keys = [span.key for span in spans]
        slot_ids = self.grants.grant_load(
            (spec.request_id, spec.num_load_start), keys, [s.key for s in covering]
        )
        shapes = [self.index.geometry.shape_of(span) for span in spans]
        promotions = None if self.fetches else self.grants.grant_promotions(keys, shapes, slot_ids)
        return spec._replace(slot_ids=slot_ids, promotion_slot_ids=promotions)

    def _grant_save(self, transfer: RequestTransfer, num_start: int, num_end: int) -> tuple[int, ...]:
        """The CPU-tier slot of each chunk a save of prompt tokens [num_start, num_end) copies."""
        spans = [span for span in transfer.spans if num_start < span.end <= num_end]
        if self.grants is None:
            return (SAVE_NO_CPU,) * len(spans)
        shape_of = self.index.geometry.shape_of
        return self.grants.grant_save([s.key for s in spans], [shape_of(s) for s in spans])

    def _forget_pending(self, request_id: str) -> None:
        """Drop the request's load and fetches not yet handed to the worker."""
        self._pending_loads = [spec for spec in self._pending_loads if spec.request_id != request_id]
        self._pending_fetches = [spec for spec in self._pending_fetches if spec.request_id != request_id]

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        # Ended by a step that raised while scheduling: its load must never reach freed blocks.
        self._forget_pending(request.request_id)
        transfer, sending = self.registry.finish(request.request_id)
        if transfer is not None:
            self._release_held(transfer)  # an abort while waiting or partly loaded: its pins go now
        # The engine writes the request's one log line with these figures (request_stats).
        return sending

    def request_preempted(self, request: ConnectorRequest) -> None:
        self._forget_pending(request.request_id)
        transfer = self.registry.get(request.request_id)
        if transfer is not None and transfer.phase not in ENDED_PHASES:
            self._release_held(transfer)
            transfer.preempted()  # looked up and planned again when next asked

    # ---- what the worker side did ---------------------------------------------------
    def update_connector_output(self, report: WorkerReport | None) -> tuple[set[str], set[str]]:
        registry = self.registry
        if report is not None:
            self._num_reports_applied = max(self._num_reports_applied, report.report_number)
            if self.grants is not None:
                # before the fetches' progress: the chunks it counts as ready are published
                self.grants.apply_fills(report.fills)
                self.grants.write_through_done(report.written_through)
                for load_id in report.ended_loads:
                    self.index.tiers.unpin(self.grants.release_load(load_id) or [])
            for load in report.loads:
                registry.loaded(
                    load.request_id,
                    load.num_load_start,
                    load.num_loaded,
                    load.num_promised,
                    load.num_bytes,
                    load.seconds,
                    load.tier_to_num_tokens,
                )
            # after the loads: a finished request's last save done forgets it
            for request_id, num_saved_tokens in report.saves:
                registry.save_done(request_id, num_saved_tokens)
            if self.planner is not None:
                # With a planner every load reads the CPU tier (a fetcher brought the lower
                # tiers' chunks into it, or it is the only tier): its rate is the host's read
                # of the slots plus the moves.
                for num_bytes, seconds in report.cpu_reads:
                    self.planner.observe_read("cpu", num_bytes, seconds)
            for progress in report.fetches:
                if progress.done:
                    self.grants.fetch_ended(progress.fetch_id, progress.num_ready_chunks)
                if progress.done and self.planner is not None:
                    for tier_name, (num_bytes, seconds, connections) in progress.tier_to_transfer.items():
                        self.planner.observe_read(
                            tier_name, num_bytes, seconds, connections, replace=progress.cut
                        )
                if not registry.fetch_reported(progress) and progress.done:
                    self._release_fetch(progress.fetch_id)  # nobody will load it
        return registry.take_finished_sending(), registry.take_finished_recving()

    def take_released_fetch_ids(self) -> list[int]:
        released, self._released_fetch_ids = self._released_fetch_ids, []
        return released

    def is_fetching_from(self, tier_name: str) -> bool:
        """Whether a fetch still reads ``tier_name``, as the worker last reported (the
        prober leaves such a tier alone: the fetch measures it). Any thread."""
        return any(
            transfer.fetch is not None and not transfer.fetch.done and tier_name in transfer.fetch.tier_names
            for transfer in self.registry.transfers()
        )

    def request_stats(self, request_id: str) -> RequestTransferStats | None:
        return self.registry.stats(request_id)


def _splits(decision: LoadDecision) -> bool:
    """Whether the plan recomputes a head while the tail is fetched (the request is
    admitted at once), rather than waiting unadmitted for the whole fetch."""
    return bool(decision.num_fetch_chunks) and decision.num_head_end > decision.num_cpu_end
