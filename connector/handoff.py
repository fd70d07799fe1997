"""Disaggregated prefill/decode (docs/architecture.md, "Disaggregated prefill and decode"):
what a producer hands a consumer, by one of two paths.

A producer computes a prompt; its chunks are saved as usual (CPU tier, written through to
the lower tiers). Before its response returns it waits until the request's saves are
published, then either offers the chunks from its CPU tier to the consumer's NIXL agent
(the direct path: :class:`~connector.direct_export.DirectExporter`) or waits until they are
in the shared (remote) tier (:func:`wait_durable`, at most ``handoff_durable_timeout_s``),
and says how many leading chunks are ready: a :class:`KVTransferParams`, which the response
carries as ``kv_transfer_params`` (vLLM's name). A consumer given it loads those chunks
whatever its planner's rates say (an offer's through its ``nixl`` tier,
:class:`~connector.direct_peer.DirectPeerTier`), waiting for the fetch (at most
``handoff_fetch_deadline_s``), and recomputes what did not come (:data:`FALLBACK_REASONS`
name why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from connector.base import ConnectorRequest, Grant, KVTransferParams, WorkerReport
from connector.config import OffloadConfig
from connector.direct_export import DirectExporter
from connector.direct_offer import DIRECT_TIER
from connector.direct_peer import DirectPeerTier
from connector.request_transfer import ADMITTED_PHASES, RequestTransfer
from connector.scheduler_side import OffloadScheduler
from storage_backends.base import StorageBackend

log = logging.getLogger(__name__)

#: the default of ``OffloadConfig.handoff_durable_timeout_s`` (:func:`wait_durable`'s)
DURABLE_TIMEOUT_S = OffloadConfig.handoff_durable_timeout_s
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
    fetch (deadline ``handoff_fetch_deadline_s``); what does not come is recomputed (its
    ``RequestTransfer`` says why). A producer's KV of another namespace is not asked for at
    all. An offer of the direct path is given to the ``nixl`` tier when the request is
    first seen (``peer``), and withdrawn at its end. Producer:
    :meth:`durable_transfer_params`. Requests without the parameters are planned exactly as
    by :class:`OffloadScheduler`."""

    def __init__(
        self,
        *args: Any,
        handoff: OffloadConfig | None = None,
        exporter: DirectExporter | None = None,
        peer: DirectPeerTier | None = None,
        shared_tier: StorageBackend | None = None,
        num_pending_writes: Callable[[], int] = lambda: 0,
        **kwargs: Any,
    ) -> None:
        """``peer``: a consumer's ``nixl`` tier; ``shared_tier``: the remote tier a producer's
        durable hand-over waits for, ``num_pending_writes`` its writes still queued (both
        of the engine's tiers)."""
        super().__init__(*args, **kwargs)
        config = handoff if handoff is not None else OffloadConfig()
        self.fetch_deadline_s = config.handoff_fetch_deadline_s
        self.durable_timeout_s = config.handoff_durable_timeout_s
        self.kv_transfer = config.kv_transfer
        #: producer, direct path: offers the CPU tier's chunks to consumers' agents
        self.exporter = exporter
        #: consumer, direct path: the ``nixl`` tier reading what producers offer
        self.peer = peer
        #: producer, shared path: the remote tier its saves reach, and its queued writes
        self.shared_tier = shared_tier
        self._num_pending_writes = num_pending_writes

    def _transfer_of(self, request: ConnectorRequest) -> RequestTransfer:
        transfer = self.registry.get(request.request_id)
        if transfer is not None:
            return transfer
        transfer = super()._transfer_of(request)
        params = getattr(request, "kv_transfer_params", None)
        if params is not None:
            transfer.handed_off(params, self._key_head(), self.chunk_size)
            if transfer.handoff is not None:
                self._took_over(transfer, params)
        return transfer

    def _took_over(self, transfer: RequestTransfer, params: KVTransferParams) -> None:
        """Say which path a consumer's hand-over takes (its log line and figures)."""
        path, num_direct = "shared", 0
        if params.direct is not None and self.peer is not None:
            num_direct = self.peer.expect(
                transfer.request_id, params.direct, [span.key for span in transfer.spans]
            )
            path = "direct" if num_direct else "shared"
        transfer.took_over_by(path)
        if params.direct is not None and self.peer is None:
            why = "this engine has no NIXL agent (kv_transfer shared)"
        elif params.direct is not None and not num_direct:
            why = "the producer's agent cannot be reached"
        else:
            why = ""
        log.info(
            "P/D: request %s: %d handed-over chunks by the %s path%s",
            transfer.request_id,
            num_direct if path == "direct" else params.num_chunks,
            path,
            f" ({why}: its own tiers, the shared one included, have what they have)" if why else "",
        )

    def _key_head(self) -> str:
        token_db = self.index.token_db
        return f"{token_db.key_prefix}{token_db.namespace}"

    def grant(self, request: ConnectorRequest, num_computed_tokens: int, seconds_left: float | None) -> Grant:
        transfer = self._transfer_of(request)
        if transfer.handoff is None or self.planner is None or transfer.phase in ADMITTED_PHASES:
            return super().grant(request, num_computed_tokens, seconds_left)
        with self.planner.forced_loading(self.fetch_deadline_s):
            return super().grant(request, num_computed_tokens, seconds_left)

    def update_connector_output(self, report: WorkerReport | None) -> tuple[set[str], set[str]]:
        finished = super().update_connector_output(report)
        if self.peer is not None and report is not None:
            for progress in report.fetches:
                if progress.done:
                    # its chunks are in this engine's CPU tier: the producer may unpin them
                    self.peer.finish(progress.request_id)
        return finished

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        sending = super().request_finished(request, block_ids)
        if self.peer is not None:
            self.peer.finish(request.request_id)  # the producer may unpin its chunks now
        return sending

    def durable_transfer_params(
        self, request_id: str, prompt: Sequence[int], cache_salt: str | None
    ) -> KVTransferParams | None:
        """Producer, after the request ended: its hand-over. The direct path offers the
        chunks the CPU tier holds once its saves are published (``kv_transfer`` "direct", or
        "auto" with an agent); otherwise the shared tier's durable chunks. None without
        either. Any thread but the engine's (it waits)."""
        spans = self.index.token_db.chunk_spans(prompt, cache_salt)
        # its saves are published once the registry forgot it (it ended, none pending)
        is_sending = lambda: self.registry.get(request_id) is not None  # noqa: E731
        if self.exporter is not None:
            deadline = time.monotonic() + self.durable_timeout_s
            while is_sending() and time.monotonic() < deadline:
                time.sleep(DURABLE_POLL_S)
            offer = self.exporter.offer(spans)
            num_chunks = 0 if offer is None else len(offer.chunks)
            log.info(
                "P/D: request %s: %d of %d chunks offered by the direct path",
                request_id,
                num_chunks,
                len(spans),
            )
            if offer is not None or self.kv_transfer == "direct":
                num_tokens = spans[num_chunks - 1].end if num_chunks else 0
                return KVTransferParams(
                    self._key_head(), self.chunk_size, num_chunks, num_tokens, DIRECT_TIER, offer
                )
        remote = self.shared_tier
        if remote is None:
            return None
        params = wait_durable(
            is_sending=is_sending,
            spans=spans,
            remote=remote,
            num_pending_writes=self._num_pending_writes,
            namespace=self._key_head(),
            chunk_size=self.chunk_size,
            timeout_s=self.durable_timeout_s,
        )
        log.info(
            "P/D: request %s: %d of %d chunks handed over by the shared path (%s)",
            request_id,
            params.num_chunks,
            len(spans),
            remote.name,
        )
        return params
