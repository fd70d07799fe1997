"""One object per request for everything the connector does for it, with one
lifecycle (docs/architecture.md, Connector): its chunk keys (cut once), its lookup,
its load plan, its background fetch and the CPU-tier pins that fetch holds, its loads,
its saves and whether it is still sending. Only :class:`RequestTransfer`'s own methods
change its fields; the scheduler side calls them, and :class:`TransferRegistry` calls
them under its lock for what the worker side reports.

Phases (one state machine, no flags beside it)::

    NEW ──(lower-tier hit worth fetching)──> FETCHING ──(fetch ended)──> FETCHED
     │                                          │                          │
     │                          (part of it arrived: pipelined loads)      │
     │                                          v                          │
     ├──────────(admitted)──> RUNNING <──(all loaded)── TAIL <─────────────┤
     │                           ^                       ^                 │
     └──(admitted, a step's time └───(rest loaded)── DEFERRED <──(cut)─────┘
         held part of a CPU hit)─────────────────────────┘
    RUNNING, TAIL, DEFERRED ──(preempted, or its step raised)──> NEW
    any ──(finished or aborted)──> SENDING (saves still read its blocks) ──> FINISHED

RUNNING: admitted, holds nothing for loads to come; it computes freely and saves.
TAIL: admitted while ``fetch`` still brings (or holds) chunks: it computes up to
``compute_limit`` (a head recomputed while the tail is fetched), then loads the fetch's
chunks from there as they arrive, computing nothing until its fetch ended and what it
brought is loaded. A request admitted from FETCHING (pipelined loads), or from FETCHED
with only part of its fetch loaded (a step's time cap), is in TAIL at its limit.
DEFERRED: a step's time (the scheduler's prefill cap) held only part of its admission's
CPU-tier load: tokens [compute_limit, num_deferred_end) stay pinned for it
(``deferred_keys``) and load in the next steps; with a fetch (the head-and-tail plan) it
goes on in TAIL once they are in.

The scheduler side never touches tensors: a fetch is described as a
:class:`~connector.base.FetchSpec` (keys, shapes, tiers) and run by the worker side's
fetcher; a request keeps only its :class:`FetchState`, replaced as the worker side's
reports (``WorkerReport.fetches``) come in through :class:`TransferRegistry`.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from connector.base import FetchProgress, KVTransferParams, RequestTransferStats
from connector.lookup import PendingLookup
from connector.planner import LoadDecision
from connector.token_db import ChunkSpan

log = logging.getLogger(__name__)

#: finished requests whose figures stay available to ``stats``
MAX_FINISHED_STATS = 10_000


class TransferPhase(enum.Enum):
    NEW = "new"  # not admitted; its lookup may be in flight
    FETCHING = "fetching"  # waits (not admitted, no blocks) for chunks coming into the CPU tier
    FETCHED = "fetched"  # its fetch ended; admitted next, loading what arrived
    RUNNING = "running"  # admitted, holds nothing for loads to come
    TAIL = "tail"  # admitted; its fetch brings the rest, loaded at its compute limit
    DEFERRED = "deferred"  # admitted; the rest of its CPU-tier load is pinned for the next steps
    SENDING = "sending"  # finished; saves still read its blocks
    FINISHED = "finished"  # finished; nothing of it is in flight


#: phases of a request that holds blocks
ADMITTED_PHASES = frozenset({TransferPhase.RUNNING, TransferPhase.TAIL, TransferPhase.DEFERRED})
#: phases of a request that ended
ENDED_PHASES = frozenset({TransferPhase.SENDING, TransferPhase.FINISHED})


class FetchState(NamedTuple):
    """A request's fetch as the worker side last reported it (immutable: a report replaces it)."""

    fetch_id: int
    #: chunk index in the prompt of its first chunk
    first_chunk: int
    #: the tier each of its chunks is read from
    tier_names: tuple[str, ...]
    #: leading chunks in the CPU tier, pinned for it
    num_ready_chunks: int = 0
    #: it ended: ``num_ready_chunks`` grows no more
    done: bool = False

    def advanced(self, progress: FetchProgress) -> FetchState:
        """This fetch after ``progress`` (reports may come late: it never goes back)."""
        return self._replace(
            num_ready_chunks=max(self.num_ready_chunks, progress.num_ready_chunks),
            done=self.done or progress.done,
        )


@dataclass
class RequestFigures:
    """Figures of one request, filled in by both roles."""

    num_prompt_tokens: int
    num_gpu_hit_tokens: int = 0
    num_external_hit_tokens: int = 0
    num_loaded_tokens: int = 0
    num_loaded_bytes: int = 0
    load_seconds: float = 0.0
    num_saved_tokens: int = 0
    tier_to_loaded_tokens: Counter = field(default_factory=Counter)
    num_planned_recompute_tokens: int = 0
    plan: str = ""
    #: a consumer's request recomputed part of its producer's hand-over: why ("" otherwise)
    pd_fallback: str = ""
    #: a consumer's request: the path of its hand-over ("direct", "shared"; "" for none)
    pd_path: str = ""

    def to_stats(self) -> RequestTransferStats:
        return RequestTransferStats(
            self.num_prompt_tokens,
            self.num_gpu_hit_tokens,
            self.num_external_hit_tokens,
            self.num_loaded_tokens,
            self.num_loaded_bytes,
            self.load_seconds,
            self.num_saved_tokens,
            dict(self.tier_to_loaded_tokens),
            self.num_planned_recompute_tokens,
            self.plan,
            self.pd_fallback,
            self.pd_path,
        )


@dataclass(eq=False)
class RequestTransfer:
    """The connector's state of one request (see the module docstring). Fields are
    read by anyone and written by these methods only."""

    request_id: str
    prompt: tuple[int, ...]
    figures: RequestFigures
    #: the request's salt: its chunk keys are those of this salted chain
    cache_salt: str | None = None
    #: the prompt's keyed chunks (``TokenDatabase.chunk_spans``), cut once when it is created
    spans: tuple[ChunkSpan, ...] = ()
    phase: TransferPhase = TransferPhase.NEW
    #: the lookup of this admission attempt (kept across steps: never asked twice)
    lookup: PendingLookup | None = None
    #: tier name of each chunk of the hit prefix, once the lookup answered
    chunk_tiers: list[str] | None = None
    #: tokens on the GPU when the lookup was planned
    num_computed_at_plan: int = 0
    decision: LoadDecision | None = None
    fetch: FetchState | None = None
    #: (start, end, tier name) of the prompt tokens the next loads bring, by origin tier
    token_origins: list[tuple[int, int, str]] = field(default_factory=list)
    #: leading prompt tokens already stored (or being stored)
    num_saved: int = 0
    #: num_computed_tokens the request should show next step (None before its first step)
    num_expected_computed: int | None = None
    num_pending_saves: int = 0
    #: TAIL and DEFERRED: the prompt position it computes no further than for now
    compute_limit: int | None = None
    #: DEFERRED: the end of the rest of its CPU-tier load
    num_deferred_end: int | None = None
    #: DEFERRED: chunks of that rest pinned for it in the CPU tier (``PinKind.DEFERRED``),
    #: released as each piece's load takes them over, or at an abort or a preemption
    deferred_keys: tuple[str, ...] = ()
    #: a consumer's request: what its producer made durable in the shared tier (connector.handoff)
    handoff: KVTransferParams | None = None
    #: the first thing that went wrong with the hand-over (a reason of
    #: ``connector.handoff.FALLBACK_REASONS``); it counts only if tokens were recomputed
    handoff_problem: str = ""

    # ---- the hand-over of disaggregated prefill/decode ----------------------------------
    def handed_off(self, params: KVTransferParams, key_head: str, chunk_size: int) -> None:
        """Its prompt was computed by a producer, which made ``params`` durable. KV of
        another namespace (``key_head``: the key prefix and namespace of this engine's
        chunks) or chunk size is never looked for: the request recomputes it."""
        if params.namespace != key_head or params.chunk_size != chunk_size:
            self.handoff_problem = "namespace"
            self.figures.pd_fallback = "namespace"
            log.warning(
                "P/D: request %s: the producer's KV is of namespace %s (chunks of %d), this engine's "
                "%s (chunks of %d); recomputing its prompt",
                self.request_id,
                params.namespace,
                params.chunk_size,
                key_head,
                chunk_size,
            )
            return
        self.handoff = params

    def took_over_by(self, path: str) -> None:
        """A consumer's hand-over takes ``path`` ("direct": read from the producer through
        NIXL; "shared": from the shared tier); its figures say so."""
        self.figures.pd_path = path

    def _handoff_went_wrong(self, reason: str) -> None:
        if self.handoff is not None and not self.handoff_problem:
            self.handoff_problem = reason

    def _check_handoff(self) -> None:
        """At its end: fewer prompt tokens hit or loaded than the producer handed over means
        they were recomputed; record why (the engine's metrics count it) and say so."""
        params = self.handoff
        if params is None or self.figures.pd_fallback or self.num_expected_computed is None:
            return  # no hand-over, told already, or never computed (aborted while waiting)
        figures = self.figures
        num_expected = min(params.num_tokens, len(self.prompt) - 1)
        num_had = figures.num_gpu_hit_tokens + figures.num_external_hit_tokens
        if num_had >= num_expected:
            return
        figures.pd_fallback = self.handoff_problem or "short"
        log.warning(
            "P/D: request %s: %d of the %d prompt tokens the producer handed over were hit or loaded; "
            "the rest was recomputed (%s)",
            self.request_id,
            num_had,
            num_expected,
            figures.pd_fallback,
        )

    # ---- planning (scheduler side, while it waits) ------------------------------------
    def lookup_started(self, lookup: PendingLookup) -> None:
        self.lookup = lookup

    def looked_up(self, chunk_tiers: list[str]) -> None:
        """The tier of each chunk of its hit prefix (refreshed from the CPU tier per ask)."""
        self.chunk_tiers = chunk_tiers
        if self.handoff is not None and len(chunk_tiers) < self.handoff.num_chunks:
            self._handoff_went_wrong("missing")

    def planned(
        self,
        num_gpu_hit: int,
        decision: LoadDecision | None,
        num_planned_recompute_tokens: int,
        origins: list[tuple[int, int, str]] | None = None,
    ) -> None:
        """The load-or-recompute plan of this admission attempt (None: nothing to load)."""
        self.num_computed_at_plan = num_gpu_hit
        self.decision = decision
        self.figures.num_planned_recompute_tokens = num_planned_recompute_tokens
        if decision is not None:
            self.figures.plan = decision.describe()
        if origins is not None:
            self.token_origins = origins

    def fetch_started(self, fetch: FetchState) -> None:
        """It waits unadmitted for ``fetch`` (NEW -> FETCHING)."""
        self._expect(TransferPhase.NEW)
        self.fetch = fetch
        self.phase = TransferPhase.FETCHING

    def fetch_reported(self, progress: FetchProgress) -> None:
        """The worker side reported its fetch's progress; one that ended while it waits
        unadmitted makes it FETCHED."""
        self.fetch = self.fetch.advanced(progress)
        if self.fetch.done and self.fetch.num_ready_chunks < len(self.fetch.tier_names):
            self._handoff_went_wrong("timeout" if progress.cut else "fetch")
        if self.fetch.done and self.phase is TransferPhase.FETCHING:
            self.phase = TransferPhase.FETCHED

    # ---- admission and loads at its compute limit -------------------------------------
    def admitted(
        self,
        num_gpu_hit: int,
        num_external: int,
        origins: list[tuple[int, int, str]] | None = None,
        *,
        tail: FetchState | None = None,
        compute_limit: int | None = None,
    ) -> None:
        """Blocks were allocated (again after a preemption) for a load of ``num_external``
        tokens after its GPU hit (RUNNING; TAIL with ``compute_limit`` when ``tail``, its
        fetch, still brings chunks). The GPU hit of the first admission is kept, external
        hits add up like the loads that follow them."""
        if self.phase not in (TransferPhase.NEW, TransferPhase.FETCHING, TransferPhase.FETCHED):
            raise ValueError(f"request {self.request_id!r} admitted twice (phase {self.phase.value})")
        figures = self.figures
        if figures.num_gpu_hit_tokens == 0 and figures.num_external_hit_tokens == 0:
            figures.num_gpu_hit_tokens = num_gpu_hit
        figures.num_external_hit_tokens += num_external
        if origins is not None:
            self.token_origins = origins
        self.lookup = None
        self.chunk_tiers = None
        self.fetch = tail
        self.compute_limit = compute_limit if tail is not None else None
        self.phase = TransferPhase.TAIL if tail is not None else TransferPhase.RUNNING

    def deferred(self, keys: list[str], num_deferred_end: int, num_start: int) -> None:
        """Its admission loads up to ``num_start`` only: tokens [num_start,
        num_deferred_end) of its CPU-tier hit, whose chunks ``keys`` are pinned for it,
        load in the next steps (-> DEFERRED; a fetch it holds goes on afterwards)."""
        self._expect(TransferPhase.RUNNING, TransferPhase.TAIL)
        self.deferred_keys = tuple(keys)
        self.num_deferred_end = num_deferred_end
        self.compute_limit = num_start
        self.phase = TransferPhase.DEFERRED

    def tail_loaded(
        self, num_start: int, num_end: int, final: bool, origins: list[tuple[int, int, str]]
    ) -> None:
        """A load of [num_start, num_end) at its compute limit from its fetch (TAIL): with
        ``final`` its fetch is done with (-> RUNNING); else it computes nothing until more
        of it is loaded."""
        self._expect(TransferPhase.TAIL)
        self._external_load(num_end - num_start, origins)
        if final:
            self.fetch = None
            self.compute_limit = None
            self.phase = TransferPhase.RUNNING
        else:
            self.compute_limit = num_end

    def deferred_piece_loaded(self, num_start: int, num_end: int, unpinned_keys: set[str]) -> None:
        """A load of [num_start, num_end) of its deferred rest (DEFERRED): ``unpinned_keys``
        lost their deferred pins; once it is all in, on in TAIL (the head recomputed while
        its fetch brings the tail) or RUNNING."""
        self._expect(TransferPhase.DEFERRED)
        self._external_load(num_end - num_start, None)
        self.deferred_keys = tuple(key for key in self.deferred_keys if key not in unpinned_keys)
        if num_end < self.num_deferred_end:
            self.compute_limit = num_end
            return
        self.num_deferred_end = None
        if self.fetch is not None:
            self.compute_limit = self.decision.num_head_end
            self.phase = TransferPhase.TAIL
        else:
            self.compute_limit = None
            self.phase = TransferPhase.RUNNING

    def _external_load(self, num_tokens: int, origins: list[tuple[int, int, str]] | None) -> None:
        self.figures.num_external_hit_tokens += num_tokens
        if origins:
            self.token_origins = self.token_origins + origins

    def preempted(self) -> None:
        """Its blocks were freed: it is asked again from scratch (a new lookup and plan)."""
        self.phase = TransferPhase.NEW
        self.lookup = None
        self.chunk_tiers = None
        self.decision = None
        self.fetch = None
        self.compute_limit = None
        self.num_deferred_end = None
        self.deferred_keys = ()

    # ---- saves -------------------------------------------------------------------------
    def saved_from(self, num_saved: int) -> None:
        """At its first admission: its leading ``num_saved`` tokens are stored already."""
        if self.num_expected_computed is None:
            self.num_saved = num_saved

    def step_scheduled(self, num_computed: int, num_scheduled: int, chunk_size: int) -> None:
        """A step computes ``num_scheduled`` tokens from ``num_computed`` on. A load failure
        or preemption moved it back: its KV past that point is recomputed, so it saves again
        from there (chunks still in the CPU tier are skipped)."""
        expected = self.num_expected_computed
        if expected is not None and num_computed < expected and num_computed < self.num_saved:
            self.num_saved = num_computed - num_computed % chunk_size
        self.num_expected_computed = num_computed + num_scheduled

    def save_issued(self, num_save_end: int) -> None:
        self.num_pending_saves += 1
        self.num_saved = num_save_end

    def save_done(self, num_saved_tokens: int) -> None:
        self.figures.num_saved_tokens += num_saved_tokens
        self.num_pending_saves -= 1

    # ---- what the worker side reports ----------------------------------------------------
    def loaded(
        self,
        num_load_start: int,
        num_loaded: int,
        num_promised: int,
        num_bytes: int,
        seconds: float,
        tier_to_num_tokens: dict[str, int] | None,
    ) -> None:
        """A load finished with ``num_loaded`` of ``num_promised`` tokens in the paged
        cache from ``num_load_start`` on; the tokens it could not load are no external hit.
        ``tier_to_num_tokens`` says which tier each came from; None: its recorded origins
        (its fetch) say it."""
        figures = self.figures
        if num_loaded < num_promised:
            self._handoff_went_wrong("load")
        figures.num_loaded_tokens += num_loaded
        figures.num_external_hit_tokens -= num_promised - num_loaded
        figures.num_loaded_bytes += num_bytes
        figures.load_seconds += seconds
        if tier_to_num_tokens is not None:
            figures.tier_to_loaded_tokens.update(tier_to_num_tokens)
            return
        end = num_load_start + num_loaded
        for origin_start, origin_end, tier_name in self.token_origins:
            overlap = min(end, origin_end) - max(num_load_start, origin_start)
            if overlap > 0:
                figures.tier_to_loaded_tokens[tier_name] += overlap

    def ended(self) -> bool:
        """It finished or was aborted: SENDING while saves still read its blocks (returns
        True), else FINISHED."""
        self._check_handoff()
        sending = self.num_pending_saves > 0
        self.phase = TransferPhase.SENDING if sending else TransferPhase.FINISHED
        return sending

    def _expect(self, *phases: TransferPhase) -> None:
        if self.phase not in phases:
            wanted = " or ".join(phase.value for phase in phases)
            raise ValueError(f"request {self.request_id!r} is {self.phase.value}, not {wanted}")


class TransferRegistry:
    """One per connector pair, made by ``create_kv_connector``: request id → state. The
    scheduler side creates and plans requests; what the worker side reports (fetches,
    loads, saves) comes in through the methods here, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._request_id_to_transfer: dict[str, RequestTransfer] = {}
        self._finished_figures: OrderedDict[str, RequestFigures] = OrderedDict()
        self._finished_sending_ids: set[str] = set()
        self._finished_recving_ids: set[str] = set()

    # ---- lifecycle -----------------------------------------------------------
    def get_or_create(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        cache_salt: str | None = None,
        cut_spans: Callable[[], Sequence[ChunkSpan]] | None = None,
    ) -> RequestTransfer:
        """The request's state; a new one's chunk keys are cut once by ``cut_spans``."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            if transfer is not None:
                return transfer
        spans = tuple(cut_spans()) if cut_spans is not None else ()
        with self._lock:
            return self._request_id_to_transfer.setdefault(
                request_id,
                RequestTransfer(
                    request_id, prompt, RequestFigures(len(prompt)), cache_salt=cache_salt, spans=spans
                ),
            )

    def get(self, request_id: str) -> RequestTransfer | None:
        with self._lock:
            return self._request_id_to_transfer.get(request_id)

    def transfers(self) -> list[RequestTransfer]:
        with self._lock:
            return list(self._request_id_to_transfer.values())

    def fetch_started(self, transfer: RequestTransfer, fetch: FetchState) -> None:
        with self._lock:
            transfer.fetch_started(fetch)

    def fetch_reported(self, progress: FetchProgress) -> bool:
        """The worker side reported a fetch that ended or (pipelined loads) brought more:
        a request waiting for it unadmitted is reported by :meth:`take_finished_recving`
        (to load what arrived); an admitted one takes the new chunks at its compute limit.
        False: nobody loads the fetch's chunks (its request ended or dropped it): the
        caller releases it."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(progress.request_id)
            if (
                transfer is None
                or transfer.fetch is None
                or transfer.fetch.fetch_id != progress.fetch_id
                or transfer.phase in ENDED_PHASES
            ):
                return False
            waiting = transfer.phase is TransferPhase.FETCHING
            transfer.fetch_reported(progress)
            if waiting:
                self._finished_recving_ids.add(progress.request_id)
            return True

    def finish(self, request_id: str) -> tuple[RequestTransfer | None, bool]:
        """A request finished or was aborted: returns its state (the caller releases
        its fetch) and whether saves still read its blocks (then its id is reported
        by :meth:`take_finished_sending` once they are done)."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            if transfer is None:
                return None, False
            self._finished_recving_ids.discard(request_id)
            self._finished_figures[request_id] = transfer.figures
            while len(self._finished_figures) > MAX_FINISHED_STATS:
                self._finished_figures.popitem(last=False)
            sending = transfer.ended()
            if sending:
                self._finished_sending_ids.add(request_id)
            else:
                del self._request_id_to_transfer[request_id]
            return transfer, sending

    # ---- saves ---------------------------------------------------------------
    def save_issued(self, transfer: RequestTransfer, num_save_end: int) -> None:
        with self._lock:
            transfer.save_issued(num_save_end)

    def save_done(self, request_id: str, num_saved_tokens: int) -> None:
        """A save issued by the scheduler side has read its blocks (or was skipped)."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            if transfer is None:
                return
            transfer.save_done(num_saved_tokens)
            if transfer.phase in ENDED_PHASES and transfer.num_pending_saves <= 0:
                del self._request_id_to_transfer[request_id]

    def take_finished_sending(self) -> set[str]:
        """Finished requests whose saves all completed since the last call."""
        with self._lock:
            done = {rid for rid in self._finished_sending_ids if rid not in self._request_id_to_transfer}
            self._finished_sending_ids -= done
            return done

    def take_finished_recving(self) -> set[str]:
        """Requests whose fetch ended, or (pipelined loads) whose fetch brought more chunks,
        since the last call (they may be admitted now)."""
        with self._lock:
            done, self._finished_recving_ids = self._finished_recving_ids, set()
            return done

    # ---- loads ---------------------------------------------------------------
    def loaded(
        self,
        request_id: str,
        num_load_start: int,
        num_loaded: int,
        num_promised: int,
        num_bytes: int,
        seconds: float,
        tier_to_num_tokens: dict[str, int] | None = None,
    ) -> None:
        """A load finished (see :meth:`RequestTransfer.loaded`)."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            if transfer is not None:
                transfer.loaded(
                    num_load_start, num_loaded, num_promised, num_bytes, seconds, tier_to_num_tokens
                )

    def stats(self, request_id: str) -> RequestTransferStats | None:
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            figures = transfer.figures if transfer is not None else self._finished_figures.get(request_id)
            return None if figures is None else figures.to_stats()

    def num_in_phase(self) -> Counter:
        """Requests per phase (``/metrics``, tests)."""
        with self._lock:
            return Counter(t.phase.value for t in self._request_id_to_transfer.values())
