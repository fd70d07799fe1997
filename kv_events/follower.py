"""Follow one engine's KV event stream and keep what it holds (docs/architecture.md, KV
events): a router keeps one :class:`KVEventFollower` per replica.

The follower subscribes, asks the replay socket for a snapshot (everything held now), then
applies the live batches numbered after it. A gap in the numbers (a slow subscriber, a
dropped connection) asks for the missing batches, or a snapshot when the engine no longer
keeps them; a new epoch (the engine restarted) drops what was known and asks for a
snapshot. A follower that gets no answer keeps what it had, marks itself out of date
(``synced`` False) and asks again at the next :meth:`poll`. Not thread-safe: one thread
polls it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from kv_events.messages import EventBatch, Removed, Stored, decode_batch
from kv_events.publisher import DEFAULT_TOPIC, END_SEQ, SNAPSHOT_SEQ, seq_bytes, seq_from

log = logging.getLogger(__name__)


@dataclass
class EngineKV:
    """What one engine holds, as its events said: keys per medium."""

    engine_id: str = ""
    epoch: str = ""
    block_size: int = 0
    chunk_size: int = 0
    medium_to_keys: dict[str, set[str]] = field(default_factory=dict)

    def apply(self, batch: EventBatch) -> None:
        self.engine_id, self.epoch = batch.engine_id, batch.epoch
        self.block_size, self.chunk_size = batch.block_size, batch.chunk_size
        if batch.snapshot:
            self.medium_to_keys = {}
        for event in batch.events:
            if isinstance(event, Stored):
                self.medium_to_keys.setdefault(event.medium, set()).update(event.keys)
            elif isinstance(event, Removed):
                self.medium_to_keys.get(event.medium, set()).difference_update(event.keys)
            else:
                self.medium_to_keys.pop(event.medium, None)

    def num_leading(self, medium: str, keys: list[str]) -> int:
        """How many leading ``keys`` ``medium`` holds (stops at the first it does not)."""
        held = self.medium_to_keys.get(medium, ())
        num = 0
        for key in keys:
            if key not in held:
                break
            num += 1
        return num


class KVEventFollower:
    """Follows the engine at ``endpoint`` (PUB) and ``replay_endpoint`` (ROUTER)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        topic: bytes = DEFAULT_TOPIC,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self.state = EngineKV()
        #: the number of the last batch applied (-1: none yet)
        self.last_seq = -1
        #: whether the state is known to be the engine's (a snapshot applied, no gap since)
        self.synced = False
        #: replays asked for after a gap, snapshots applied, restarts seen (tests, /metrics)
        self.num_gaps = 0
        self.num_snapshots = 0
        self.num_restarts = 0

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply what arrived (waiting up to ``timeout_s`` for the first batch); returns the
        number of batches applied. Resynchronises first when out of date."""
        if not self.synced:
            self._replay(SNAPSHOT_SEQ)
        num_applied = 0
        timeout_ms = int(timeout_s * 1000)
        while self._sub.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            _, seq_frame, payload = self._sub.recv_multipart()
            num_applied += self._receive(seq_from(seq_frame), decode_batch(payload))
        return num_applied

    def _receive(self, seq: int, batch: EventBatch) -> int:
        if self.state.epoch and batch.epoch != self.state.epoch:
            log.info("engine %s restarted (new epoch): its KV index is dropped", batch.engine_id)
            self.num_restarts += 1
            self.state = EngineKV()
            self.last_seq = -1
            self.synced = False
            self._replay(SNAPSHOT_SEQ)
            return 0
        if not self.synced or seq <= self.last_seq:
            return 0  # before the snapshot, or applied already
        if seq > self.last_seq + 1:
            self.num_gaps += 1
            applied = self._replay(self.last_seq + 1)
            if self.synced and seq == self.last_seq + 1:
                self.state.apply(batch)
                self.last_seq = seq
                applied += 1
            elif seq > self.last_seq + 1:
                self.synced = False  # the replay did not close the gap: a snapshot next poll
            return applied
        self.state.apply(batch)
        self.last_seq = seq
        return 1

    def _replay(self, first_seq: int) -> int:
        """Ask the replay socket for the batches from ``first_seq`` on (or a snapshot) and
        apply them; on no answer the follower stays out of date. Returns batches applied."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        num_applied = 0
        try:
            dealer.send(seq_bytes(first_seq))
            while True:
                if not dealer.poll(int(self.replay_timeout_s * 1000), zmq.POLLIN):
                    log.warning("no answer from %s: the KV index stays out of date", self.replay_endpoint)
                    self.synced = False
                    return num_applied
                seq_frame, payload = dealer.recv_multipart()
                seq = seq_from(seq_frame)
                if seq == END_SEQ:
                    return num_applied
                batch = decode_batch(payload)
                if batch.snapshot:
                    if self.state.epoch and batch.epoch != self.state.epoch:
                        self.num_restarts += 1
                    self.state = EngineKV()
                    self.state.apply(batch)
                    self.last_seq = seq
                    self.synced = True
                    self.num_snapshots += 1
                    num_applied += 1
                elif seq == self.last_seq + 1:
                    self.state.apply(batch)
                    self.last_seq = seq
                    num_applied += 1
        finally:
            dealer.close()

    def close(self) -> None:
        self._sub.close()
        self._context.term()
