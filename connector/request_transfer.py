"""One object per request for everything the connector does for it, with one
lifecycle (docs/architecture.md, Connector): its lookup, its load plan, its background fetch and the
CPU-tier pins that fetch holds, its loads, its saves and whether it is still
sending. Both connector roles read and change a request's transfer state only
here; each change of phase is a method of :class:`TransferRegistry`.

Phases::

    NEW ──(lower-tier hit worth fetching)──> FETCHING ──(fetch done)──> FETCHED
     │                                          │                          │
     │                            (part of it arrived: pipelined loads)    │
     │                                          │                          │
     └───────────────────────(admitted: blocks allocated)──────────────────┴──> ADMITTED
    ADMITTED ──(preempted: asked again)──> NEW

An ADMITTED request with ``tail_pending`` still owns its fetch: it computes up to
``compute_limit`` (a head recomputed while the tail is fetched), or nothing (admitted
from FETCHING: it loads its fetch's chunks as they arrive, and computes once the fetch
ended). A step whose time (the scheduler's prefill cap) holds only part of an
admission's load leaves the rest at ``compute_limit`` too: the CPU tier's chunks
(``num_deferred_end``, pinned for it) or its fetch's, loaded in the next steps.
    any ──(finished or aborted)──> SENDING (saves still read its blocks) ──> gone

The scheduler side never touches tensors: a fetch is described here (keys,
shapes, tiers) and run by the worker side's fetcher. Thread-safe: the worker
side may run on another thread.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from connector.base import RequestTransferStats
from connector.fetcher import FetchJob
from connector.lookup import PendingLookup
from connector.planner import LoadDecision

#: finished requests whose figures stay available to ``stats``
MAX_FINISHED_STATS = 10_000


class TransferPhase(enum.Enum):
    NEW = "new"  # not admitted; its lookup may be in flight
    FETCHING = "fetching"  # waits (not admitted, no blocks) for chunks coming into the CPU tier
    FETCHED = "fetched"  # its fetch ended; admitted next, loading what arrived
    ADMITTED = "admitted"  # has blocks; loads and saves go by step
    SENDING = "sending"  # finished; saves still read its blocks


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
        )


@dataclass(eq=False)
class RequestTransfer:
    """The connector's state of one request (see the module docstring)."""

    request_id: str
    prompt: tuple[int, ...]
    figures: RequestFigures
    #: the request's salt: its chunk keys are those of this salted chain
    cache_salt: str | None = None
    phase: TransferPhase = TransferPhase.NEW
    #: the lookup of this admission attempt (kept across steps: never asked twice)
    lookup: PendingLookup | None = None
    #: tier name of each chunk of the hit prefix, once the lookup answered
    chunk_tiers: list[str] | None = None
    #: tokens on the GPU when the lookup was planned
    num_computed_at_plan: int = 0
    decision: LoadDecision | None = None
    fetch: FetchJob | None = None
    #: (start, end, tier name) of the prompt tokens the next loads bring, by origin tier
    token_origins: list[tuple[int, int, str]] = field(default_factory=list)
    #: leading prompt tokens already stored (or being stored)
    num_saved: int = 0
    #: num_computed_tokens the request should show next step (None before its first step)
    num_expected_computed: int | None = None
    num_pending_saves: int = 0
    #: this step's load stopped early: leading tokens truly in the paged cache
    num_valid_after_load: int | None = None
    #: admitted while ``fetch`` still brings chunks: a head recomputing up to decision.num_head_end,
    #: or chunks loaded as they arrive (pipelined loads)
    tail_pending: bool = False
    #: the prompt position the request computes no further than while ``tail_pending`` (or
    #: while it is admitted from FETCHING): the head's end, or the end of what it loaded
    compute_limit: int | None = None
    #: the end of the CPU-tier load of its admission when a step's time cap cut that load
    #: short: tokens [compute_limit, num_deferred_end) are loaded in the next steps (None: none)
    num_deferred_end: int | None = None
    #: chunks of that rest pinned for it in the CPU tier (``PinKind.DEFERRED``), released as
    #: each piece's load takes them over, or at an abort or a preemption
    deferred_keys: list[str] = field(default_factory=list)
    finished: bool = False


class TransferRegistry:
    """One per connector pair, made by ``create_kv_connector``: request id → state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._request_id_to_transfer: dict[str, RequestTransfer] = {}
        self._finished_figures: OrderedDict[str, RequestFigures] = OrderedDict()
        self._finished_sending_ids: set[str] = set()
        self._finished_recving_ids: set[str] = set()

    # ---- lifecycle -----------------------------------------------------------
    def get_or_create(
        self, request_id: str, prompt: tuple[int, ...], cache_salt: str | None = None
    ) -> RequestTransfer:
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            if transfer is None:
                transfer = RequestTransfer(
                    request_id, prompt, RequestFigures(len(prompt)), cache_salt=cache_salt
                )
                self._request_id_to_transfer[request_id] = transfer
            return transfer

    def get(self, request_id: str) -> RequestTransfer | None:
        with self._lock:
            return self._request_id_to_transfer.get(request_id)

    def transfers(self) -> list[RequestTransfer]:
        with self._lock:
            return list(self._request_id_to_transfer.values())

    def fetch_started(self, transfer: RequestTransfer, job: FetchJob) -> None:
        with self._lock:
            transfer.fetch = job
            transfer.phase = TransferPhase.FETCHING

    def fetch_finished(self, job: FetchJob) -> RequestTransfer | None:
        """The worker's fetcher ended ``job``: its request is reported by
        :meth:`take_finished_recving` (unless it finished meanwhile)."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(job.request_id)
            if transfer is None or transfer.fetch is not job or transfer.finished:
                return None
            if transfer.tail_pending:
                return transfer  # a tail: the running request takes it at its compute limit
            transfer.phase = TransferPhase.FETCHED
            self._finished_recving_ids.add(job.request_id)
            return transfer

    def fetch_progressed(self, job: FetchJob) -> RequestTransfer | None:
        """More of a running ``job`` arrived (pipelined loads): a request still waiting for
        it unadmitted is reported by :meth:`take_finished_recving`, to load what arrived;
        one admitted already takes the new chunks at its compute limit."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(job.request_id)
            if (
                transfer is None
                or transfer.fetch is not job
                or transfer.finished
                or transfer.phase is not TransferPhase.FETCHING
            ):
                return None
            self._finished_recving_ids.add(job.request_id)
            return transfer

    def admitted(self, transfer: RequestTransfer, num_gpu_hit: int, num_external: int) -> None:
        """Blocks were allocated (again after a preemption): the GPU hit of the first
        admission is kept, external hits add up like the loads that follow them."""
        with self._lock:
            figures = transfer.figures
            if figures.num_gpu_hit_tokens == 0 and figures.num_external_hit_tokens == 0:
                figures.num_gpu_hit_tokens = num_gpu_hit
            figures.num_external_hit_tokens += num_external
            transfer.phase = TransferPhase.ADMITTED
            transfer.lookup = None
            transfer.chunk_tiers = None

    def preempted(self, transfer: RequestTransfer) -> None:
        """The request is asked again from scratch (a new lookup and plan)."""
        with self._lock:
            transfer.phase = TransferPhase.NEW
            transfer.lookup = None
            transfer.chunk_tiers = None
            transfer.decision = None
            transfer.fetch = None
            transfer.tail_pending = False
            transfer.compute_limit = None
            transfer.num_deferred_end = None
            transfer.deferred_keys = []

    def finish(self, request_id: str) -> tuple[RequestTransfer | None, bool]:
        """A request finished or was aborted: returns its state (the caller releases
        its fetch) and whether saves still read its blocks (then its id is reported
        by :meth:`take_finished_sending` once they are done)."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            if transfer is None:
                return None, False
            transfer.finished = True
            self._finished_recving_ids.discard(request_id)
            self._finished_figures[request_id] = transfer.figures
            while len(self._finished_figures) > MAX_FINISHED_STATS:
                self._finished_figures.popitem(last=False)
            sending = transfer.num_pending_saves > 0
            if sending:
                transfer.phase = TransferPhase.SENDING
                self._finished_sending_ids.add(request_id)
            else:
                del self._request_id_to_transfer[request_id]
            return transfer, sending

    # ---- saves ---------------------------------------------------------------
    def save_issued(self, transfer: RequestTransfer) -> None:
        with self._lock:
            transfer.num_pending_saves += 1

    def save_done(self, request_id: str, num_saved_tokens: int) -> None:
        """A save issued by the scheduler side has read its blocks (or was skipped)."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            if transfer is None:
                return
            transfer.figures.num_saved_tokens += num_saved_tokens
            transfer.num_pending_saves -= 1
            if transfer.finished and transfer.num_pending_saves <= 0:
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
        """A load finished with ``num_loaded`` of ``num_promised`` tokens in the paged
        cache from ``num_load_start`` on; the tokens it could not load are no external hit.
        ``tier_to_num_tokens`` says which tier each came from; None: the request's
        recorded origins (its fetch) say it."""
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            if transfer is None:
                return
            figures = transfer.figures
            figures.num_loaded_tokens += num_loaded
            figures.num_external_hit_tokens -= num_promised - num_loaded
            figures.num_loaded_bytes += num_bytes
            figures.load_seconds += seconds
            if tier_to_num_tokens is not None:
                figures.tier_to_loaded_tokens.update(tier_to_num_tokens)
                return
            end = num_load_start + num_loaded
            for origin_start, origin_end, tier_name in transfer.token_origins:
                overlap = min(end, origin_end) - max(num_load_start, origin_start)
                if overlap > 0:
                    figures.tier_to_loaded_tokens[tier_name] += overlap

    def stats(self, request_id: str) -> RequestTransferStats | None:
        with self._lock:
            transfer = self._request_id_to_transfer.get(request_id)
            figures = transfer.figures if transfer is not None else self._finished_figures.get(request_id)
            return None if figures is None else figures.to_stats()

    def num_in_phase(self) -> Counter:
        """Requests per phase (``/metrics``, tests)."""
        with self._lock:
            return Counter(t.phase.value for t in self._request_id_to_transfer.values())
