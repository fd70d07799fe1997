"""One generation request as the engine tracks it, and what it returns."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.config import SamplingParams
from engine.spec_decode.backoff import DraftBackoff

if TYPE_CHECKING:
    import torch

    from connector.base import KVTransferParams


def index_of_token_outside_vocab(token_ids: Sequence[object], vocab_size: int) -> int | None:
    """The index of the first element of ``token_ids`` that is not an int in
    [0, vocab_size), or None when every one is.

    Called for every prompt before it is queued (by `LLM.generate` and
    `EngineCore.add_request`). The common case, plain ints all in range, is answered at
    C speed (types, min and max): a per-element Python check cost ~1 ms per 8k-token
    prompt, on the path of every request's first token."""
    if not token_ids:
        return None
    if set(map(type, token_ids)) <= {int, bool} and min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return None
    return next(
        (i for i, t in enumerate(token_ids) if not isinstance(t, int) or not 0 <= t < vocab_size), None
    )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    #: not admitted, no blocks: the connector fetches its KV into the CPU tier meanwhile
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Per-request figures reported in `RequestOutput.metrics`."""

    num_prompt_tokens: int
    #: prompt tokens found in the GPU prefix cache at the request's first admission
    num_local_cached_tokens: int = 0
    #: prompt tokens loaded from the offload tiers (after any load failure)
    num_external_cached_tokens: int = 0
    #: those tokens per tier they were read from ("cpu", "disk", "redis", "grpc"), set when
    #: the first output token is sampled; empty without offload or without a load
    tier_to_loaded_tokens: dict[str, int] = field(default_factory=dict)
    #: seconds from `add_request` to the first output token (None before it)
    ttft_s: float | None = None
    #: prompt tokens the offload planner chose to recompute instead of loading
    num_planned_recompute_tokens: int = 0


@dataclass
class RequestOutput:
    """The state of one request after an engine step (cumulative, not a delta)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    #: "stop" (EOS or stop string), "length", "abort", "error" (its step failed) or None while running
    finish_reason: str | None
    metrics: RequestMetrics


@dataclass(eq=False)
class Request:
    """Mutable engine-side state. The scheduler owns `status`, `num_computed_tokens`
    and `block_ids`; the block manager owns `block_hashes` and `num_cached_blocks`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    #: chain hashes of the full blocks of `all_token_ids` (extended lazily)
    block_hashes: list[bytes] = field(default_factory=list)
    #: how many leading blocks of `block_ids` are registered in the prefix cache
    num_cached_blocks: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_admissions: int = 0
    metrics: RequestMetrics = field(init=False)
    generator: torch.Generator | None = None
    #: output text up to now (maintained by the engine core when a tokenizer exists)
    text: str = ""
    #: speculative decoding: pauses drafting while this request's drafts are mostly rejected
    draft_backoff: DraftBackoff = field(default_factory=DraftBackoff)
    #: the request's cache salt (None: none). Requests share GPU prefix-cache blocks and
    #: offloaded chunks only with requests of the same salt (docs/architecture.md, Connector)
    cache_salt: str | None = None
    #: async scheduling: tokens that steps in flight will sample and that the host does not
    #: have yet (the engine's batch queue sets it while it plans ahead; 0 otherwise)
    num_output_placeholders: int = 0
    #: a consumer's request: what the producer that computed its prompt made durable in
    #: the shared tier (the connector loads it instead of computing it; None: nothing)
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(num_prompt_tokens=len(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.metrics.ttft_s is None:
            self.metrics.ttft_s = time.monotonic() - self.arrival_time

    def check_token_stop(self) -> str | None:
        """Finish reason implied by the last output token (EOS, max_tokens, context) or None."""
        params = self.sampling_params
        if (
            not params.ignore_eos
            and self.output_token_ids
            and self.output_token_ids[-1] in self.eos_token_ids
        ):
            return "stop"
        if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            text=self.text,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            metrics=replace(self.metrics, tier_to_loaded_tokens=dict(self.metrics.tier_to_loaded_tokens)),
        )
