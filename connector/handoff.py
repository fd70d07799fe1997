"""Disaggregated prefill/decode through a shared tier (docs/architecture.md, "Disaggregated
prefill and decode"): what a producer hands a consumer, and the producer's wait until
a request's KV is durable in the shared tier.

A producer computes a prompt; its chunks are saved as usual (CPU tier, written through to
the lower tiers). Before its response returns, :func:`wait_durable` waits until the
request's saves are published and its chunks are in the shared (remote) tier, and says
how many leading chunks are there: a :class:`KVTransferParams`, which the response carries
as ``kv_transfer_params`` (vLLM's name). A consumer given it loads those chunks whatever
its planner's rates say, waiting for the fetch (at most :data:`HANDOFF_FETCH_DEADLINE_S`),
and recomputes what did not come (:data:`FALLBACK_REASONS` name why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from connector.base import ConnectorRequest, Grant, KVTransferParams
from connector.request_transfer import ADMITTED_PHASES, RequestTransfer
from connector.scheduler_side import OffloadScheduler

log = logging.getLogger(__name__)

#: how long a consumer's fetch of a producer's chunks may take before it recomputes the rest
HANDOFF_FETCH_DEADLINE_S = 30.0
#: how long a producer waits for a request's chunks to reach the shared tier
DURABLE_TIMEOUT_S = 30.0
#: tiers that engines on other hosts reach: the hand-over goes through one of them
SHARED_TIER_NAMES = ("redis", "grpc")
#: how often the producer asks the shared tier while its writes are in flight
DURABLE_POLL_S = 0.005


def wait_durable(
    *,
    is_sending: Callable[[], bool],
    spans: Sequence[Any],
    remote: Any,
    num_pending_writes: Callable[[], int],
    namespace: str,
    chunk_size: int,
    timeout_s: float = DURABLE_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> KVTransferParams:
    """Block until a finished request's chunks (``spans``: its prompt's keyed chunks, in
    order) are in the shared tier ``remote``, or until no write that could bring them is
    left, or ``timeout_s``; return what is durable there (a prefix of the chunks: a
    consumer loads a prefix). ``is_sending()``: its saves are still being published;
    ``num_pending_writes()``: the lower tiers' writes queued or running. Any thread; it
    reads the shared tier, so it belongs off the engine's step thread. A tier that fails
    to answer makes nothing durable (0 chunks: the consumer computes the prompt)."""
    deadline = clock() + timeout_s
    keys = [span.key for span in spans]
    while is_sending() and clock() < deadline:
        sleep(DURABLE_POLL_S)
    num_found = 0
    try:
        while keys:
            num_found = remote.contains(keys)
            if num_found >= len(keys) or clock() >= deadline:
                break
            if num_pending_writes() == 0:
                # nothing in flight could add a chunk: ask once more (a write may have just ended)
                num_found = remote.contains(keys)
                break
            sleep(DURABLE_POLL_S)
    except Exception as error:  # noqa: BLE001 - any failure of the tier: nothing is known durable
        log.warning("P/D: the shared tier %s did not answer (%s); nothing handed over", remote.name, error)
        num_found = 0
    if num_found < len(keys):
        log.warning(
            "P/D: %d of %d chunks durable in the shared tier %s after %.1f s",
            num_found,
            len(keys),
            remote.name,
            timeout_s - max(0.0, deadline - clock()),
        )
    num_found = min(num_found, len(keys))
    num_tokens = spans[num_found - 1].end if num_found else 0
    return KVTransferParams(namespace, chunk_size, num_found, num_tokens, remote.name)


class HandoffScheduler(OffloadScheduler):
    """The offload scheduler side with the hand-over of disaggregated prefill/decode.

    Consumer: a request carrying ``kv_transfer_params`` (``ConnectorRequest``) loads the
    chunks its lookup finds whatever the planner's rates say, waiting unadmitted for their
    fetch (deadline :data:`HANDOFF_FETCH_DEADLINE_S`); what does not come is recomputed
    (its ``RequestTransfer`` says why). A producer's KV of another namespace is not asked
    for at all. Producer: :meth:`durable_transfer_params`. Requests without the parameters
    are planned exactly as by :class:`OffloadScheduler`."""

    def _transfer_of(self, request: ConnectorRequest) -> RequestTransfer:
        transfer = self.registry.get(request.request_id)
        if transfer is not None:
            return transfer
        transfer = super()._transfer_of(request)
        params = getattr(request, "kv_transfer_params", None)
        if params is not None:
            transfer.handed_off(params, self._key_head(), self.chunk_size)
        return transfer

    def _key_head(self) -> str:
        token_db = self.cache_engine.token_db
        return f"{token_db.key_prefix}{token_db.namespace}"

    def grant(self, request: ConnectorRequest, num_computed_tokens: int, seconds_left: float | None) -> Grant:
        transfer = self._transfer_of(request)
        if transfer.handoff is None or self.planner is None or transfer.phase in ADMITTED_PHASES:
            return super().grant(request, num_computed_tokens, seconds_left)
        with self.planner.forced_loading(HANDOFF_FETCH_DEADLINE_S):
            return super().grant(request, num_computed_tokens, seconds_left)

    def durable_transfer_params(
        self, request_id: str, prompt: Sequence[int], cache_salt: str | None
    ) -> KVTransferParams | None:
        tiers = self.cache_engine.tiers
        remote = next((tier for tier in reversed(tiers.lower) if tier.name in SHARED_TIER_NAMES), None)
        if remote is None:
            return None
        return wait_durable(
            # its saves are published once the registry forgot it (it ended, none pending)
            is_sending=lambda: self.registry.get(request_id) is not None,
            spans=self.cache_engine.token_db.chunk_spans(prompt, cache_salt),
            remote=remote,
            num_pending_writes=tiers.num_pending_writes,
            namespace=self._key_head(),
            chunk_size=self.chunk_size,
        )
