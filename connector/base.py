"""The engine ⇄ connector contract, split by role (docs/architecture.md, Connector, after vLLM V1).

The engine owns two objects built from one :class:`~connector.config.OffloadConfig`:
the *scheduler side* (no tensors: decides what to load and save) and the
*worker side* (owns transfers between the paged KV tensor and the tiers).
Each engine step the scheduler side emits exactly one :class:`ConnectorMetadata`
and the model runner hands it to the worker side before the forward pass; the worker
side answers with one :class:`WorkerReport` that the engine core hands to the scheduler
side. Both are plain data: neither role holds an object of the other.

The engine never imports a concrete connector; ``engine`` depends on this file
and on a factory in ``connector``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from connector.direct_offer import DirectOffer


class ConnectorRequest(Protocol):
    """What the scheduler side may read of an engine request (read-only)."""

    request_id: str
    #: prompt token ids followed by the output tokens accepted so far
    all_token_ids: Sequence[int]
    num_prompt_tokens: int
    #: tokens whose KV is already in the paged cache (GPU prefix hits + computed + loaded)
    num_computed_tokens: int
    #: the request's salt (None: none); it seeds the chain of its chunk keys (docs/architecture.md, Connector)
    cache_salt: str | None
    #: a consumer's request: what the producer that computed its prompt made durable in the
    #: shared tier (None: none; read with ``getattr``, a request may lack it)
    kv_transfer_params: KVTransferParams | None


#: the version of the ``kv_transfer_params`` object this code writes and reads
PARAMS_VERSION = 1


#: why a consumer recomputed part of what the producer handed it (its log line, ``/metrics``)
FALLBACK_REASONS = (
    "namespace",  # the producer's KV is of another model, dtype, layout or chunk size
    "missing",  # the lookup found fewer chunks (deleted, evicted, the tier unreachable)
    "timeout",  # the fetch's deadline ended it before every chunk came
    "fetch",  # a read failed or a value was corrupt
    "load",  # a fetched chunk could not be loaded into the paged cache
    "short",  # fewer tokens loaded than handed over, for another reason
)


class KVTransferParams(NamedTuple):
    """What a producer's response says of a request's KV (``kv_transfer_params``): its
    leading ``num_chunks`` chunks (``num_tokens`` prompt tokens) are ready for a consumer
    under keys of ``namespace`` (the consumer's must be equal) and ``chunk_size`` tokens per
    chunk; ``tier`` names where: the shared tier (``redis`` or ``grpc``: durable there) or
    ``nixl`` (the direct path: ``direct`` says where the producer holds them)."""

    namespace: str
    chunk_size: int
    num_chunks: int
    num_tokens: int
    tier: str
    direct: DirectOffer | None = None

    def to_dict(self) -> dict[str, Any]:
        direct = {} if self.direct is None else {"direct": self.direct.to_dict()}
        return direct | {
            "kvstash_version": PARAMS_VERSION,
            "durable": True,
            "namespace": self.namespace,
            "chunk_size": self.chunk_size,
            "num_chunks": self.num_chunks,
            "num_tokens": self.num_tokens,
            "tier": self.tier,
        }

    @classmethod
    def from_dict(cls, value: object) -> KVTransferParams:
        """Parse a request's ``kv_transfer_params``; ValueError names what is wrong."""
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(value).__name__}")
        if value.get("kvstash_version") != PARAMS_VERSION:
            raise ValueError(
                f"kv_transfer_params.kvstash_version must be {PARAMS_VERSION}, "
                f"got {value.get('kvstash_version')!r}"
            )
        if value.get("durable") is not True:
            raise ValueError("kv_transfer_params.durable must be true (a producer's response says so)")
        fields = {}
        for name, kind in (("namespace", str), ("tier", str)):
            item = value.get(name)
            if not isinstance(item, kind) or not item:
                raise ValueError(f"kv_transfer_params.{name} must be a non-empty string, got {item!r}")
            fields[name] = item
        for name, low in (("chunk_size", 1), ("num_chunks", 0), ("num_tokens", 0)):
            item = value.get(name)
            if isinstance(item, bool) or not isinstance(item, int) or item < low:
                raise ValueError(f"kv_transfer_params.{name} must be an integer >= {low}, got {item!r}")
            fields[name] = item
        if fields["num_tokens"] > fields["num_chunks"] * fields["chunk_size"]:
            raise ValueError("kv_transfer_params.num_tokens exceeds num_chunks * chunk_size")
        if value.get("direct") is not None:
            fields["direct"] = DirectOffer.from_dict(value["direct"])
            if len(fields["direct"].chunks) != fields["num_chunks"]:
                raise ValueError("kv_transfer_params.direct.chunks must list num_chunks chunks")
        return cls(**fields)


class ScheduledRequest(NamedTuple):
    """One request as scheduled in one step (input to ``build_connector_meta``)."""

    request_id: str
    token_ids: Sequence[int]  # all token ids known for the request at this step
    block_ids: Sequence[int]  # the request's whole block table after this step's allocation
    num_computed_tokens: int  # KV present before this step's forward (after any external load)
    num_scheduled_tokens: int  # tokens the model computes in this step
    num_prompt_tokens: int


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


#: a ``LoadSpec.slot_ids`` entry: the CPU tier did not hold the chunk when the load was granted
LOAD_NOT_IN_CPU = -1


class LoadSpec(NamedTuple):
    """Load ``token_ids[:num_load_end]`` from the tiers into slots, keeping the
    first ``num_load_start`` tokens untouched (they are already on the GPU).
    ``slot_ids`` (one per keyed chunk overlapping ``[num_load_start, num_load_end)``): the
    CPU-tier slot holding it, READ-pinned for this load by the scheduler side until a report
    lists the load in ``ended_loads``, or ``LOAD_NOT_IN_CPU`` (read from a lower tier in the
    step, or a miss where a fetcher brings lower-tier chunks); None: the worker's own cache
    engine finds and pins them (a worker side alone, whose index is its own)."""

    request_id: str
    token_ids: tuple[int, ...]
    slot_mapping: torch.Tensor  # int64 [num_load_end]; slot = block_id * block_size + offset
    num_load_start: int
    num_load_end: int
    cache_salt: str | None = None  # the request's, selects its chain of chunk keys
    slot_ids: tuple[int, ...] | None = None
    #: per chunk like ``slot_ids``: a slot reserved to promote a lower-tier hit read in the
    #: step into (synchronous loads; the worker reports the fill), or ``LOAD_NOT_IN_CPU``
    promotion_slot_ids: tuple[int, ...] | None = None


#: ``SaveSpec.slot_ids`` entries that name no CPU-tier slot to copy a chunk into
SAVE_SKIP = -1  # the CPU tier holds the chunk or is filling it already: nothing to store
SAVE_NO_ROOM = -2  # every slot pinned or being filled: written to the lower tiers only
SAVE_NO_CPU = -3  # no CPU tier for stores (none, or a staging area): lower tiers only


class SaveSpec(NamedTuple):
    """Store ``token_ids[:num_save_end]``; tokens before ``num_save_start`` are already stored.
    ``slot_ids`` (one per keyed chunk ending after ``num_save_start``) are the CPU-tier
    slots the scheduler side reserved (``SlotGrants.grant_save``): the worker copies each
    chunk into its slot and reports the fill; None: the worker's own cache engine grants
    them (a worker side alone, whose index is its own)."""

    request_id: str
    token_ids: tuple[int, ...]
    slot_mapping: torch.Tensor  # int64 [num_save_end]
    num_save_start: int
    num_save_end: int
    cache_salt: str | None = None  # the request's, selects its chain of chunk keys
    slot_ids: tuple[int, ...] | None = None
    #: per chunk like ``slot_ids``: a slot reserved to promote a lower-tier hit read in the
    #: step into (synchronous loads; the worker reports the fill), or ``LOAD_NOT_IN_CPU``
    promotion_slot_ids: tuple[int, ...] | None = None


#: ``FetchSpec.slot_ids`` entries that name no slot to fill (a slot id is >= 0)
FETCH_IN_CPU = -1  # in the CPU tier already, pinned for the fetch by the scheduler side
FETCH_MISS = -2  # no slot for it (none free, or it left the CPU tier): a miss
FETCH_SHARED = -3  # another fetch's read of the same key fills it: the fetch waits for that read


class FetchSpec(NamedTuple):
    """A background fetch the worker side starts: bring one request's chunks from the lower
    tiers into the CPU tier (its fetcher builds a ``connector.fetcher.FetchJob`` from it).
    Plain data, chosen by the scheduler side; ``fetch_id`` names it in both roles. The
    scheduler side's ``SlotGrants.grant_fetch`` fills in ``slot_ids`` when it builds the
    step's metadata: the worker reads each chunk into the slot named there, never
    choosing or publishing a slot itself."""

    fetch_id: int
    request_id: str
    keys: tuple[str, ...]
    #: [num_layers, 2, num_tokens, num_kv_heads, head_dim] of each chunk
    shapes: tuple[tuple[int, ...], ...]
    #: the tier to read each chunk from ("cpu": already there, only pinned)
    tier_names: tuple[str, ...]
    #: seconds after its start when the fetch stops waiting for its missing chunks
    deadline_s: float
    #: chunk index in the prompt of ``keys[0]``
    first_chunk: int = 0
    #: per chunk: the CPU-tier slot this fetch reads it into (>= 0), or ``FETCH_IN_CPU``,
    #: ``FETCH_MISS``, ``FETCH_SHARED``; empty until granted
    slot_ids: tuple[int, ...] = ()


@dataclass
class ConnectorMetadata:
    """Everything the worker side needs for one step. Built once per step by the
    scheduler side; read-only for the worker side. Plain data: it pickles."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: background fetches to start
    fetches: list[FetchSpec] = field(default_factory=list)
    #: fetches nobody loads from any more (loaded, or their request ended; the scheduler
    #: side dropped their pins): the worker stops those still running (``start_load_kv``)
    released_fetch_ids: list[int] = field(default_factory=list)
    #: the highest ``WorkerReport.report_number`` the scheduler side had applied when it
    #: built this metadata: the worker forgets the fills reported up to it
    num_reports_applied: int = 0
    #: the scheduler side numbers its metadata from 1 in the order built (0: unnumbered);
    #: the worker side tells by it whether it ever bound one (``abort_step``)
    step_number: int = 0


class LoadReport(NamedTuple):
    """One load the worker side finished: ``num_loaded`` of ``num_promised`` tokens from
    ``num_load_start`` on are in the paged cache (see ``RequestTransfer.loaded``)."""

    request_id: str
    num_load_start: int
    num_loaded: int
    num_promised: int
    num_bytes: int
    seconds: float
    #: tier name -> tokens it gave; None: the request's recorded origins (its fetch) say it
    tier_to_num_tokens: dict[str, int] | None = None


class FetchProgress(NamedTuple):
    """Where a running or ended fetch stands (reported when its ready prefix grew or it ended)."""

    fetch_id: int
    request_id: str
    #: leading chunks in the CPU tier, pinned for the fetch
    num_ready_chunks: int
    #: it ended: ``num_ready_chunks`` grows no more (its pins past them are dropped)
    done: bool
    #: its deadline ended it with reads still running (its rates replace the estimate)
    cut: bool = False
    #: when done: tier name -> (bytes read, seconds from its start to that tier's last
    #: read, reads in flight it ran at)
    tier_to_transfer: dict[str, tuple[int, float, int]] = {}


@dataclass
class WorkerReport:
    """What the worker side did since its last report (``KVConnectorWorker.take_report``), for
    the scheduler side's ``update_connector_output``. Plain data: it pickles, so the worker
    side may live in another process (docs/architecture.md, The connector contract)."""

    #: (request id, tokens stored) of each save that read its blocks (0: skipped)
    saves: list[tuple[str, int]] = field(default_factory=list)
    loads: list[LoadReport] = field(default_factory=list)
    #: request id -> leading tokens truly in the paged cache (the step's loads that stopped early)
    load_failures: dict[str, int] = field(default_factory=dict)
    fetches: list[FetchProgress] = field(default_factory=list)
    #: (bytes, seconds) of each step's loads from the CPU tier: the host's read plus the moves
    cpu_reads: list[tuple[int, float]] = field(default_factory=list)
    #: (key, slot id, ok) of each granted slot a save's copy or a fetch's read filled (ok)
    #: or gave up: the scheduler side publishes or frees the slot (``SlotGrants.apply_fills``)
    fills: list[tuple[str, int, bool]] = field(default_factory=list)
    #: keys whose write to the lower tiers read their CPU-tier slot and ended (written,
    #: failed or dropped): the scheduler side drops their write-through pins
    written_through: list[str] = field(default_factory=list)
    #: (request id, num_load_start) of each load of a bound metadata that ended (moved,
    #: stopped early or dropped with its step): the scheduler side drops the pins it holds
    ended_loads: list[tuple[str, int]] = field(default_factory=list)
    #: this report's number (1, 2, ...: one per ``take_report``)
    report_number: int = 0

    def __bool__(self) -> bool:
        return bool(
            self.saves
            or self.loads
            or self.load_failures
            or self.fetches
            or self.cpu_reads
            or self.fills
            or self.written_through
            or self.ended_loads
        )


class GrantWait(enum.Enum):
    """Why a :class:`Grant` runs nothing for its request this step."""

    NONE = "none"  # it runs: loads, computes, or both
    #: a lower tier has not answered the request's lookup: it stays first in the waiting
    #: queue, skipped this step (the requests behind it go on), and is asked again next step
    LOOKUP = "lookup"
    #: its KV is fetched into the CPU tier first: it waits aside without blocks
    #: (WAITING_FOR_REMOTE_KVS) until ``update_connector_output`` reports it as received
    FETCH = "fetch"
    #: a running request at its compute limit whose fetch brought nothing new: skipped this step
    TAIL = "tail"


class Grant(NamedTuple):
    """The connector's answer for one request in one step (``KVConnectorScheduler.grant``):
    load ``num_load_tokens`` tokens from position ``num_computed_tokens`` on, then compute at
    most ``max_compute_tokens`` (None: as many as the scheduler's budget allows; 0: it only
    loads this step). ``load_seconds`` is the load's expected time within the step (the
    scheduler's prefill cap counts it). Plain data: it pickles."""

    #: where the load starts: the GPU prefix hit of a waiting request, or a running one's
    #: ``num_computed_tokens``
    num_computed_tokens: int
    num_load_tokens: int = 0
    max_compute_tokens: int | None = None
    load_seconds: float = 0.0
    wait: GrantWait = GrantWait.NONE

    @property
    def num_load_end(self) -> int:
        return self.num_computed_tokens + self.num_load_tokens


class RequestTransferStats(NamedTuple):
    """Per-request figures the engine reports in ``RequestOutput.metrics`` and logs."""

    num_prompt_tokens: int
    num_gpu_hit_tokens: int
    num_external_hit_tokens: int
    num_loaded_tokens: int
    num_loaded_bytes: int
    load_seconds: float
    num_saved_tokens: int
    #: tokens loaded per origin tier ("cpu", "disk", "redis", "grpc")
    tier_to_loaded_tokens: dict[str, int] = {}
    #: prompt tokens the planner chose to recompute (0 before it planned)
    num_planned_recompute_tokens: int = 0
    #: the planner's decision in words (for the request's log line)
    plan: str = ""
    #: a consumer's request recomputed part of what its producer handed over: why
    #: (:data:`FALLBACK_REASONS`); "" otherwise
    pd_fallback: str = ""
    #: a consumer's request: the path its hand-over took ("direct" or "shared"); "" for none
    pd_path: str = ""


class KVConnectorScheduler(abc.ABC):
    """Scheduler-side role: the policy (what is where, what to load, fetch and save). Never
    touches tensors other than building slot maps. Called from the scheduler's thread only.

    Per step the scheduler asks :meth:`grant` once per request it considers (waiting ones
    it may admit, running ones still in their prompt), tells :meth:`update_state_after_alloc`
    once per grant it acted on, then calls :meth:`build_connector_meta` once. A request's
    end (:meth:`request_finished`) and a preemption (:meth:`request_preempted`) are told
    once each."""

    @abc.abstractmethod
    def grant(self, request: ConnectorRequest, num_computed_tokens: int, seconds_left: float | None) -> Grant:
        """What ``request`` loads, computes or waits for in this step. For a waiting request
        ``num_computed_tokens`` is its GPU prefix hit (asked even on a full hit: the answer
        also tells the connector which chunks the tiers hold already, so they are not stored
        again); for a running one still in its prompt, its ``num_computed_tokens``.
        ``seconds_left``: the step's prefill time left (the scheduler's prefill cap; None: no
        time cap): a load takes the whole chunks that fit it, at least the first, and the
        request then computes nothing this step (the rest loads in the next steps).
        Never offers the prompt's last token (it is always computed), never blocks on I/O
        beyond a bounded wait. May start the request's lookup and remember its plan; changes
        nothing else, so a grant the scheduler does not act on (no room) costs nothing."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], grant: Grant
    ) -> None:
        """Called once for each grant the scheduler acted on, with that grant: after it
        allocated the request's blocks (``block_ids``: its whole block table) for the grant's
        load and compute, or with no blocks for a ``GrantWait.FETCH`` grant (the request
        waits aside: its fetch starts). Records the load for the next metadata."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        """Called exactly once per step after scheduling; resets per-step state.
        ``scheduled`` holds the step's requests that still compute prompt tokens (only
        prompt KV is saved; a request sent back by preemption or a failed load is in
        its prompt again), so pure decode steps cost no per-request work here."""

    @abc.abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        """Called once when a request finishes or is aborted. Returns True when an
        asynchronous save still reads the request's blocks: the engine must keep
        them until ``update_connector_output`` reports the request id as done sending."""

    def request_preempted(self, request: ConnectorRequest) -> None:  # noqa: B027 - optional hook
        """Called when the scheduler frees a request's blocks and sends it back to the
        waiting queue: a preemption, or a step that raised (the engine retries the step's
        requests in smaller groups to find the one that fails it). Forget what it holds for
        loads to come and its load not yet handed to the worker; it is looked up and planned
        again when it is next asked. Saves need nothing: the next ``build_connector_meta``
        sees its ``num_computed_tokens`` went back."""

    def update_connector_output(self, report: WorkerReport | None) -> tuple[set[str], set[str]]:
        """Called once per worker report (each step's, in step order, before the scheduler
        updates its requests from the step): apply what the worker side did (saves, loads,
        fetch progress, rates). Returns (request ids whose saves all read their blocks since:
        the engine frees their blocks, request ids whose fetch ended or, with pipelined loads,
        brought more: they go back to the front of the waiting queue). A connector whose
        worker side reports nothing has nothing to apply."""
        return set(), set()

    def take_released_fetch_ids(self) -> list[int]:
        """Fetches released since the last metadata was built (an abort between steps, a
        request a step ended): the engine hands them to the worker side's
        ``release_fetches`` when no step carries them (the engine goes idle)."""
        return []

    def request_stats(self, request_id: str) -> RequestTransferStats | None:  # noqa: B027
        """Transfer figures for a finished request (None when unknown)."""
        return None

    def durable_transfer_params(  # noqa: B027 - optional hook
        self, request_id: str, prompt: Sequence[int], cache_salt: str | None
    ) -> KVTransferParams | None:
        """A producer's hand-over of a finished request: block until its prompt's chunks are
        in the shared tier (or no write can bring more, or a timeout), and say how many
        leading ones are. Any thread (it waits on I/O: never the step thread). None: this
        connector has no shared tier."""
        return None


class KVConnectorWorker(abc.ABC):
    """Worker-side role: moves KV between the paged cache and the tiers."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """Called once at start-up with the engine's KV tensor
        ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    @abc.abstractmethod
    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Called once per step before the forward pass."""

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Begin the loads of the bound metadata (may return before they finish)."""

    @property
    def needs_layer_hooks(self) -> bool:
        """Whether loads need ``wait_for_layer_load``/``save_kv_layer`` between layers.
        When False, a step with loads may run as one captured CUDA graph: the engine
        calls the hooks of every layer before it (waits) and after it (saves)."""
        return True

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s KV of every load is in the paged cache.
        Called per layer only in steps whose metadata has loads (the others may run as
        a captured CUDA graph, with no host code between layers)."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_idx: int) -> None:
        """Called after layer ``layer_idx`` wrote its new KV, in steps with loads only
        (as ``wait_for_layer_load``); saves must not depend on it."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Called once at the end of the forward pass: every save of this step is
        queued, ordered after the step's writes to the paged cache. A save may still
        read its blocks afterwards (its request is then reported as sending until a report
        says the save read them, see ``take_report``; ``finish_saves`` waits for it)."""

    def finish_saves(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Block until every save issued so far has read its blocks. The model runner
        calls it before a step whose plan freed blocks by preemption, since that step
        may rewrite them; connectors whose saves end within ``wait_for_save`` need nothing."""

    def attach_kv_events(self, record) -> None:  # noqa: B027 - optional hook, default no-op
        """Tell ``record(kind, medium, keys)`` what the tiers hold and every change after
        (the engine's KV events); called once at start-up by the engine core."""

    def start_background_allocation(self) -> None:  # noqa: B027 - optional hook, default no-op
        """The engine is ready (weights loaded, graphs captured): memory that the tiers
        allocate after start-up (the CPU tier's slab pieces) may be allocated from now on,
        beside the serving. Called once by the engine core."""

    def flush(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Block until every save issued so far is stored and every write queued for lower
        tiers was attempted (tests, benchmarks, shutdown); the step loop never calls it."""

    def abort_step(self, metadata: ConnectorMetadata | None = None) -> None:  # noqa: B027 - optional hook
        """Called instead of the rest of the step when the step raised (the engine then
        ends the step's requests). Ends the bound metadata's loads and drops its saves that
        ``wait_for_save`` did not queue: KV of a failed forward must never be stored, and no
        save may stay pending (the engine would hold its request's blocks for it).
        ``metadata``: the failed step's; one the runner never bound (the step raised
        before it could) is bound here and ended the same way (its fetches started)."""

    @abc.abstractmethod
    def take_report(self) -> WorkerReport:
        """What this side did since the last call (saves that read their blocks, finished
        loads, the step's load failures, fetch progress, rates): called once at the end of
        each step (the engine hands it to the scheduler side's ``update_connector_output``)
        and when the engine frees the blocks of sent requests out of a step."""

    def release_fetches(self, fetch_ids: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Stop these fetches if they still run (ids not known here are ignored; their pins
        are the scheduler side's, dropped when it released them). Steps carry releases in
        ``ConnectorMetadata.released_fetch_ids``; the engine calls this for those made when
        no step follows (an abort, an idle engine)."""

    def wait_for_transfers(self, timeout_s: float) -> None:  # noqa: B027
        """Called by an engine with nothing to schedule while requests wait for
        background fetches: sleep until one makes progress or ``timeout_s`` passed."""

    def load_failures(self) -> dict[str, int]:
        """Request id → number of leading tokens truly in the paged cache, for each
        request whose load this step stopped early (a missing, corrupt or failed
        chunk). The engine discards that request's output for the step and
        recomputes from that length; empty when every load succeeded."""
        return {}
