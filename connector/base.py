"""The engine ⇄ connector contract, split by role (docs/architecture.md, Connector, after vLLM V1).

The engine owns two objects built from one :class:`~connector.config.OffloadConfig`:
the *scheduler side* (no tensors: decides what to load and save) and the
*worker side* (owns transfers between the paged KV tensor and the tiers).
Each engine step the scheduler side emits exactly one :class:`ConnectorMetadata`
and the model runner hands it to the worker side before the forward pass.

The engine never imports a concrete connector; ``engine`` depends on this file
and on a factory in ``connector``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch


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


class ScheduledRequest(NamedTuple):
    """One request as scheduled in one step (input to ``build_connector_meta``)."""

    request_id: str
    token_ids: Sequence[int]  # all token ids known for the request at this step
    block_ids: Sequence[int]  # the request's whole block table after this step's allocation
    num_computed_tokens: int  # KV present before this step's forward (after any external load)
    num_scheduled_tokens: int  # tokens the model computes in this step
    num_prompt_tokens: int


class LoadSpec(NamedTuple):
    """Load ``token_ids[:num_load_end]`` from the tiers into slots, keeping the
    first ``num_load_start`` tokens untouched (they are already on the GPU)."""

    request_id: str
    token_ids: tuple[int, ...]
    slot_mapping: torch.Tensor  # int64 [num_load_end]; slot = block_id * block_size + offset
    num_load_start: int
    num_load_end: int
    cache_salt: str | None = None  # the request's, selects its chain of chunk keys


class SaveSpec(NamedTuple):
    """Store ``token_ids[:num_save_end]``; tokens before ``num_save_start`` are already stored."""

    request_id: str
    token_ids: tuple[int, ...]
    slot_mapping: torch.Tensor  # int64 [num_save_end]
    num_save_start: int
    num_save_end: int
    cache_salt: str | None = None  # the request's, selects its chain of chunk keys


@dataclass
class ConnectorMetadata:
    """Everything the worker side needs for one step. Built once per step by the
    scheduler side; read-only for the worker side."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: background fetches to start (``connector.fetcher.FetchJob``: keys, shapes, tiers; no tensors)
    fetches: list = field(default_factory=list)


class TailLoad(NamedTuple):
    """What a request at its compute limit loads now (``get_num_tail_tokens``)."""

    #: tokens loadable from the request's compute limit on (its fetch's ready chunks)
    num_tokens: int
    #: True: its fetch ended, it computes on after this load; False: more chunks are still
    #: coming (pipelined loads), or the step's time holds only these, it loads them and
    #: computes nothing this step
    final: bool


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


class KVConnectorScheduler(abc.ABC):
    """Scheduler-side role. Never touches tensors other than building slot maps."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(num_tokens, load_async)``: how many tokens beyond ``num_computed_tokens``
        (the GPU prefix hit) can be loaded from the tiers, and whether they must first
        be fetched in the background. ``num_tokens`` None means "not known yet" (a
        lower tier has not answered): the scheduler skips the request this step and
        asks again later. With ``load_async`` the request waits in its own state
        (WAITING_FOR_REMOTE_KVS, no blocks) until ``get_finished`` reports it as
        received, then is asked again. Pins nothing; never blocks on I/O beyond a
        bounded wait; called possibly several times per request while it waits.
        When the whole prompt would hit, the last prompt token is left to compute
        (``num_tokens`` is at most ``num_prompt_tokens - 1 - num_computed_tokens``)."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Called once per admission: when blocks for the request's scheduling were
        allocated (records the load to put in the next metadata; ``num_external_tokens``
        may be 0), or with no blocks when ``get_num_new_matched_tokens`` said
        ``load_async`` (records the fetch to start). ``num_external_tokens`` fewer than
        offered (but not 0) means the step's time had room for only that part
        (``fit_load_tokens``): the request computes nothing in this step, the connector
        keeps the rest for it (pinned) and it is loaded in the next steps at the request's
        compute limit (``get_num_tail_tokens``)."""

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
        them until ``get_finished`` reports the request id as done sending."""

    def request_rolled_back(self, request: ConnectorRequest) -> None:  # noqa: B027 - optional hook
        """Called when a step that raised sends the request back to waiting instead of
        ending it (the engine retries the step's requests in smaller groups to find the
        one that fails it). Forget its load not yet handed to the worker: its blocks are
        freed, and it is looked up and admitted again later. Saves need nothing: the next
        ``build_connector_meta`` sees its ``num_computed_tokens`` went back."""

    def get_compute_limit(self, request: ConnectorRequest) -> int | None:
        """The prompt position a request must not compute past yet: its head is recomputed
        while the chunks from there on are fetched, or the end of the part of a load it has
        loaded (pipelined loads: of its fetch; a step's time cap: of any load; None: no limit). Called per step for running requests
        still in their prompt, and at admission right after ``get_num_new_matched_tokens``:
        a limit there equal to the GPU hit plus the external tokens means the request is
        admitted to load those and compute nothing while the rest of its fetch comes in.
        Side-effect free."""
        return None

    def estimate_load_seconds(self, num_tokens: int) -> float:
        """How long loading ``num_tokens`` tokens from the CPU tier into the paged cache is
        expected to take within a step (the scheduler's prefill cap counts it in the step's
        time). Side-effect free; 0.0 when unknown."""
        return 0.0

    def fit_load_tokens(self, num_start: int, num_tokens: int, seconds_left: float | None) -> int:
        """How many of ``num_tokens`` tokens loadable from the CPU tier from prompt position
        ``num_start`` on one step loads, when the step may still grow by ``seconds_left``
        (the prefill cap's time left; None: no time cap, all of them): the whole chunks whose
        load ``estimate_load_seconds`` expects to fit, and at least the first chunk (or all
        of them when fewer), so that a load always progresses. The scheduler asks it for an
        admission's load and for a tail; the rest is loaded in the following steps.
        Side-effect free."""
        return num_tokens

    def get_num_tail_tokens(self, request: ConnectorRequest) -> TailLoad | None:
        """For a request at its compute limit: the tokens from there that can be loaded now
        and whether its fetch ended (``final``; 0 tokens then: it got nothing more and
        recomputes on). Not final (pipelined loads): the chunks that arrived so far, loaded
        this step while the rest keeps coming; the request computes nothing. None while
        nothing new arrived (the request skips the step; the others go on). The rest of an
        admission's load that a step's time cut short comes here too. The scheduler may load
        fewer tokens than offered (``fit_load_tokens``): it then passes the answer to
        ``update_state_after_tail_alloc`` with ``final`` False. Side-effect free."""
        return TailLoad(0, True)

    def update_state_after_tail_alloc(  # noqa: B027
        self, request: ConnectorRequest, block_ids: Sequence[int], tail: TailLoad
    ) -> None:
        """Blocks for the tail were allocated: records the load of ``tail.num_tokens``
        from the request's compute limit on (called once per non-None
        ``get_num_tail_tokens`` answer that the scheduler acted on, with that answer)."""

    def wait_for_transfers(self, timeout_s: float) -> None:  # noqa: B027
        """Called by an engine with nothing to schedule while requests wait for
        background fetches: sleep until one makes progress or ``timeout_s`` passed."""

    def flush(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Block until every store queued for lower tiers was attempted (tests,
        benchmarks, shutdown); the step loop never calls it."""

    def request_stats(self, request_id: str) -> RequestTransferStats | None:  # noqa: B027
        """Transfer figures for a finished request (None when unknown)."""
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
        read its blocks afterwards (its request is then reported as sending, see
        ``get_finished``, and ``finish_saves`` waits for it)."""

    def finish_saves(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Block until every save issued so far has read its blocks. The model runner
        calls it before a step whose plan freed blocks by preemption, since that step
        may rewrite them; connectors whose saves end within ``wait_for_save`` need nothing."""

    def abort_step(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Called instead of the rest of the step when the step raised (the engine then
        ends the step's requests). Ends the bound metadata's loads and drops its saves that
        ``wait_for_save`` did not queue: KV of a failed forward must never be stored, and no
        save may stay pending (the engine would hold its request's blocks for it)."""

    @abc.abstractmethod
    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        """Return (request ids whose async saves completed, request ids whose
        async loads completed) since the last call."""

    def load_failures(self) -> dict[str, int]:
        """Request id → number of leading tokens truly in the paged cache, for each
        request whose load this step stopped early (a missing, corrupt or failed
        chunk). The engine discards that request's output for the step and
        recomputes from that length; empty when every load succeeded."""
        return {}
