"""The producer's side of the direct path (docs/architecture.md, "Disaggregated prefill and
decode"): a finished prompt's chunks stay pinned in the CPU tier, whose memory is registered
with this engine's NIXL agent, and its answer says where they lie (a
:class:`~connector.direct_offer.DirectOffer`); a consumer's agent reads them from there. The
pins go when the consumer says it is done (a NIXL notification carrying the offer's
``transfer_id``) or after ``hold_s`` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from connector.direct_offer import DirectOffer, OfferedChunk
from connector.nixl_agents import NixlAgent
from connector.slot_index import PinKind
from connector.token_db import ChunkSpan

if TYPE_CHECKING:
    from connector.cpu_tier import PinnedChunkPool

log = logging.getLogger(__name__)

#: how often the producer reads its agent's notifications and expires old holds
POLL_S = 0.02


class DirectExporter:
    """One per producer engine, over its CPU tier. :meth:`offer` is called from the server's
    hand-over threads (any thread); one background thread releases the holds."""

    def __init__(
        self, cpu: PinnedChunkPool, *, hold_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if cpu.staging:
            raise ValueError("the direct path needs a CPU tier (cpu_bytes > 0), not a staging area")
        self.cpu = cpu
        self.hold_s = hold_s
        self._clock = clock
        self.agent = NixlAgent("producer", cpu.pieces)
        self._lock = threading.Lock()
        #: transfer id -> (when its pins go at the latest, the keys it pinned)
        self._holds: dict[str, tuple[float, list[str]]] = {}
        self.num_released_done = 0
        self.num_released_expired = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._release_loop, name="kvstash-direct-export", daemon=True)
        self._thread.start()

    def offer(self, spans: Sequence[ChunkSpan]) -> DirectOffer | None:
        """Pin the leading ``spans`` (a finished prompt's keyed chunks, in order) that the CPU
        tier holds and say where they lie; None when it holds not even the first."""
        keys = [span.key for span in spans]
        pinned = self.cpu.pin_each(keys, PinKind.EXPORT)
        chunks: list[OfferedChunk] = []
        for span, was_pinned in zip(spans, pinned, strict=True):
            if not was_pinned:
                break
            chunk = self.cpu.get(span.key)
            if chunk is None:
                break
            tensor = chunk.tensor
            chunks.append(
                OfferedChunk(
                    span.key, tensor.data_ptr(), tensor.numel() * tensor.element_size(), span.end - span.start
                )
            )
        held = keys[: len(chunks)]
        unheld = [
            key
            for key, was_pinned in zip(keys[len(chunks) :], pinned[len(chunks) :], strict=True)
            if was_pinned
        ]
        self.cpu.unpin(unheld, PinKind.EXPORT)
        if not chunks:
            return None
        transfer_id = uuid.uuid4().hex
        with self._lock:
            self._holds[transfer_id] = (self._clock() + self.hold_s, held)
        agent = self.agent
        return DirectOffer(
            agent.name,
            agent.ensure_registered(),  # names every piece the offered chunks lie in
            transfer_id,
            self.hold_s,
            agent.mem_type,
            agent.device_id,
            tuple(chunks),
        )

    def num_holds(self) -> int:
        """Offers whose chunks are still pinned. Any thread."""
        with self._lock:
            return len(self._holds)

    def release(self, transfer_id: str, *, expired: bool = False) -> bool:
        """Unpin an offer's chunks (its consumer is done, or its time is up); False when it
        is not held (released already, or not this engine's)."""
        with self._lock:
            hold = self._holds.pop(transfer_id, None)
        if hold is None:
            return False
        self.cpu.unpin(hold[1], PinKind.EXPORT)
        if expired:
            self.num_released_expired += 1
            log.info(
                "P/D direct: transfer %s not confirmed after %.0f s; its chunks were unpinned",
                transfer_id,
                self.hold_s,
            )
        else:
            self.num_released_done += 1
        return True

    def _release_loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                notifications = self.agent.agent.get_new_notifs()
            except Exception as error:  # noqa: BLE001 - the holds still expire
                log.warning("P/D direct: reading NIXL notifications failed: %s", error)
                notifications = {}
            for messages in notifications.values():
                for message in messages:
                    self.release(bytes(message).decode("ascii", "replace"))
            now = self._clock()
            with self._lock:
                expired = [
                    transfer_id for transfer_id, (deadline, _) in self._holds.items() if deadline <= now
                ]
            for transfer_id in expired:
                self.release(transfer_id, expired=True)

    def close(self) -> None:
        """Stop the release thread, unpin every hold, deregister the memory. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            transfer_ids = list(self._holds)
        for transfer_id in transfer_ids:
            self.release(transfer_id)
        self.agent.close()
