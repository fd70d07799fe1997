"""The consumer's side of the direct path (docs/architecture.md, "Disaggregated prefill and
decode"): a read-only lower tier, ``nixl``, holding the chunks producers offered for this
engine's requests (:class:`~connector.direct_offer.DirectOffer`). Its ``contains`` answers
from those offers, its ``get_into`` READs a chunk with this engine's NIXL agent from the
producer's registered memory straight into a CPU-tier slot (the slab is registered with
the agent): the lookups, the planner and the fetcher treat it as any lower tier, so a
request takes what its own tiers hold from them and only the rest from the producer.

A read that fails (the producer gone, a NIXL error) or does not end in time is a miss: the
request recomputes the rest. Reads stop at ``min(fetch deadline, hold_s / 2)`` after the
offer came, well before the producer unpins the chunks (``hold_s`` after it offered them),
so a slot the producer reused is never read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from connector.direct_offer import DIRECT_TIER, DirectOffer, OfferedChunk
from connector.nixl_agents import NixlAgent
from storage_backends.base import StorageBackend
from storage_backends.chunk import KVChunk

if TYPE_CHECKING:
    from connector.cpu_tier import PinnedChunkPool

log = logging.getLogger(__name__)

#: how long a read waits between two looks at its state
READ_POLL_S = 0.0002


class _Source(NamedTuple):
    """Where one key's chunk lies: its offer, its place in the producer's memory, and when
    this engine stops reading it."""

    offer: DirectOffer
    chunk: OfferedChunk
    deadline: float


class DirectPeerTier(StorageBackend):
    """The ``nixl`` tier of a consumer. The scheduler side calls :meth:`expect` when a
    request with an offer arrives and :meth:`finish` at its end; the fetcher's threads call
    :meth:`get_into`; the lookups call :meth:`contains`. Thread-safe."""

    name = DIRECT_TIER
    #: the write-through skips it: it holds only what producers offer
    read_only = True

    def __init__(
        self,
        cpu: PinnedChunkPool,
        *,
        fetch_deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cpu.staging and cpu.num_slots == 0:
            raise ValueError("the direct path needs CPU-tier slots to read into")
        self.cpu = cpu
        self.fetch_deadline_s = fetch_deadline_s
        self._clock = clock
        self.agent = NixlAgent("consumer", cpu.pieces)
        self._lock = threading.Lock()
        self._key_to_source: dict[str, _Source] = {}
        self._request_to_offer: dict[str, DirectOffer] = {}
        #: producer agents whose metadata this agent loaded
        self._agent_names: set[str] = set()
        #: transfers that failed, told once each in the log
        self._failed_transfer_ids: set[str] = set()
        #: transfer id -> reads of it running now (its producer is told it is done only
        #: once none runs: a read must never land after the producer reused the memory)
        self._transfer_to_num_reads: Counter[str] = Counter()
        #: offers whose request is done, waiting for their last read to end
        self._transfer_to_finished_offer: dict[str, DirectOffer] = {}
        self.counts: Counter[str] = Counter()

    # ---- the scheduler side ----------------------------------------------------------
    def expect(self, request_id: str, offer: DirectOffer, keys: Sequence[str]) -> int:
        """A request's producer offers ``offer``; ``keys`` are the request's own chunk keys,
        in order. Returns how many leading chunks this engine can read from it (0 when the
        producer's agent cannot be reached or its keys are not the request's)."""
        num_matching = 0
        for key, chunk in zip(keys, offer.chunks, strict=False):
            if key != chunk.key:
                break
            num_matching += 1
        if num_matching < len(offer.chunks):
            log.warning(
                "P/D direct: request %s: the producer's chunk %d is not this prompt's; reading %d of %d",
                request_id,
                num_matching,
                num_matching,
                len(offer.chunks),
            )
        if num_matching == 0 or not self._reach(offer):
            return 0
        deadline = self._clock() + min(self.fetch_deadline_s, offer.hold_s / 2)
        with self._lock:
            self._request_to_offer[request_id] = offer
            for chunk in offer.chunks[:num_matching]:
                self._key_to_source[chunk.key] = _Source(offer, chunk, deadline)
        return num_matching

    def _reach(self, offer: DirectOffer) -> bool:
        with self._lock:
            known = offer.agent in self._agent_names
        if known:
            return True
        try:
            self.agent.agent.add_remote_agent(offer.metadata)
        except Exception as error:  # noqa: BLE001 - unreachable: the request falls back
            self.counts["unreachable"] += 1
            log.warning("P/D direct: the producer's NIXL agent %s cannot be reached (%s)", offer.agent, error)
            return False
        with self._lock:
            self._agent_names.add(offer.agent)
        return True

    def finish(self, request_id: str) -> None:
        """The request's fetch ended (or the request did): forget its offer's chunks and,
        once no read of them runs, tell the producer it may unpin them. Idempotent."""
        with self._lock:
            offer = self._request_to_offer.pop(request_id, None)
            if offer is None:
                return
            for chunk in offer.chunks:
                source = self._key_to_source.get(chunk.key)
                if source is not None and source.offer is offer:
                    del self._key_to_source[chunk.key]
            if self._transfer_to_num_reads[offer.transfer_id]:
                self._transfer_to_finished_offer[offer.transfer_id] = offer  # the last read tells
                return
        self._tell_done(offer)

    def _tell_done(self, offer: DirectOffer) -> None:
        with self._lock:
            still_used = any(other.agent == offer.agent for other in self._request_to_offer.values())
        try:
            self.agent.agent.send_notif(offer.agent, offer.transfer_id.encode("ascii"))
        except Exception as error:  # noqa: BLE001 - the producer's hold then times out
            log.info(
                "P/D direct: could not tell %s that transfer %s is done (%s)",
                offer.agent,
                offer.transfer_id,
                error,
            )
        if not still_used and offer.transfer_id in self._failed_transfer_ids:
            # a producer that failed a read is likely gone: load its metadata afresh next time
            self._forget_agent(offer.agent)

    def _forget_agent(self, agent_name: str) -> None:
        with self._lock:
            self._agent_names.discard(agent_name)
        try:
            self.agent.agent.remove_remote_agent(agent_name)
        except Exception as error:  # noqa: BLE001 - nothing left to release
            log.debug("P/D direct: removing agent %s: %s", agent_name, error)

    # ---- reads ---------------------------------------------------------------------
    def _source(self, key: str) -> _Source | None:
        with self._lock:
            source = self._key_to_source.get(key)
        if source is None or self._clock() >= source.deadline:
            return None
        return source

    def contains(self, keys: Sequence[str]) -> int:
        count = 0
        for key in keys:
            if self._source(key) is None:
                break
            count += 1
        return count

    def get_into(self, key: str, out: torch.Tensor) -> KVChunk | None:
        """READ ``key``'s chunk from its producer into ``out`` (a registered CPU-tier slot);
        None on a miss, a failure or the offer's deadline."""
        source = self._source(key)
        if source is None:
            self.counts["misses"] += 1
            return None
        chunk = source.chunk
        num_layers, _, _, num_kv_heads, head_dim = self.cpu.chunk_shape
        shape = (num_layers, 2, chunk.num_tokens, num_kv_heads, head_dim)
        num_elements = chunk.num_bytes // out.element_size()
        if (
            out.dtype != self.cpu.dtype
            or not out.is_contiguous()
            or out.numel() < num_elements
            or num_elements != num_layers * 2 * chunk.num_tokens * num_kv_heads * head_dim
        ):
            self.counts["corrupt"] += 1
            log.warning(
                "P/D direct: chunk %s of %d bytes does not fit shape %s here: a miss",
                key,
                chunk.num_bytes,
                shape,
            )
            return None
        transfer_id = source.offer.transfer_id
        with self._lock:
            self._transfer_to_num_reads[transfer_id] += 1
        try:
            state = self._read(source, out.data_ptr())
        finally:
            with self._lock:
                self._transfer_to_num_reads[transfer_id] -= 1
                last = self._transfer_to_num_reads[transfer_id] == 0
                if last:
                    del self._transfer_to_num_reads[transfer_id]
                finished = self._transfer_to_finished_offer.pop(transfer_id, None) if last else None
            if finished is not None:
                self._tell_done(finished)
        if state != "DONE":
            self.counts["errors"] += 1
            if source.offer.transfer_id not in self._failed_transfer_ids:
                self._failed_transfer_ids.add(source.offer.transfer_id)
                log.warning(
                    "P/D direct: reading transfer %s from %s ended %s; the rest is recomputed",
                    source.offer.transfer_id,
                    source.offer.agent,
                    state,
                )
            return None
        self.counts["hits"] += 1
        self.counts["bytes_read"] += chunk.num_bytes
        return KVChunk(out.reshape(-1)[:num_elements].view(shape), self.cpu.layout)

    def _read(self, source: _Source, address: int) -> str:
        """One NIXL READ of ``source`` to ``address``: "DONE", "ERR", "TIMEOUT" or the error.
        A read still running at the source's deadline is waited for until it ends (until the
        producer's hold would end at the latest): its bytes must not land in a slot after
        the fetcher gave it back. It is then a miss all the same."""
        agent, offer = self.agent, source.offer
        try:
            agent.ensure_registered()  # the slot may lie in a piece the slab grew since
            local = agent.descs([(address, source.chunk.num_bytes)])
            remote = agent.descs(
                [(source.chunk.address, source.chunk.num_bytes)], offer.mem_type, offer.device_id
            )
            handle = agent.agent.initialize_xfer("READ", local, remote, offer.agent)
        except Exception as error:  # noqa: BLE001 - stale descriptors, a forgotten agent
            return f"{type(error).__name__}: {error}"
        try:
            state = agent.agent.transfer(handle)
            while state == "PROC" and self._clock() < source.deadline:
                time.sleep(READ_POLL_S)
                state = agent.agent.check_xfer_state(handle)
            if state != "PROC":
                return state
            # the producer holds its memory for hold_s from the offer; reads start before half
            last_chance = source.deadline + offer.hold_s / 2
            while state == "PROC" and self._clock() < last_chance:
                time.sleep(READ_POLL_S)
                state = agent.agent.check_xfer_state(handle)
            if state == "PROC":
                log.error(
                    "P/D direct: a read of transfer %s did not end by the producer's hold", offer.transfer_id
                )
            return "TIMEOUT"
        except Exception as error:  # noqa: BLE001 - the producer went away mid-read
            return f"{type(error).__name__}: {error}"
        finally:
            try:
                agent.agent.release_xfer_handle(handle)
            except Exception as error:  # noqa: BLE001 - a read still in flight: NIXL keeps it
                log.debug("P/D direct: releasing a read handle: %s", error)

    def get(self, key: str) -> KVChunk | None:
        """Reads land in registered CPU-tier slots only (:meth:`get_into`, the fetcher's
        path): a read outside them answers a miss."""
        return None

    def get_encoded(self, key: str) -> bytes | None:
        return None

    # ---- writes: none (the producers' memory is theirs) ------------------------------
    def put(self, key: str, chunk: KVChunk) -> None:
        raise ValueError("the nixl tier is read-only: it holds what producers offer")

    def put_many(self, items: Sequence[tuple[str, KVChunk]]) -> None:
        if items:
            raise ValueError("the nixl tier is read-only: it holds what producers offer")

    def put_encoded(self, key: str, data: bytes) -> None:
        raise ValueError("the nixl tier is read-only: it holds what producers offer")

    def delete(self, key: str) -> bool:
        return False

    # ---- listing, stats, lifecycle ---------------------------------------------------
    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return [key for key in self._key_to_source if key.startswith(prefix)]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            num_keys = len(self._key_to_source)
            num_agents = len(self._agent_names)
        counts = self.counts
        return {
            "num_keys": num_keys,
            "bytes_used": 0,
            "capacity_bytes": None,
            "hits": counts["hits"],
            "misses": counts["misses"],
            "puts": 0,
            "evictions": 0,
            "corrupt": counts["corrupt"],
            "errors": counts["errors"],
            "bytes_read": counts["bytes_read"],
            "unreachable": counts["unreachable"],
            "num_producer_agents": num_agents,
        }

    def close(self) -> None:
        with self._lock:
            request_ids = list(self._request_to_offer)
        for request_id in request_ids:
            self.finish(request_id)
        self.agent.close()
        super().close()
