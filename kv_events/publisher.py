"""An engine's KV event stream: ZeroMQ PUB for the events, ROUTER for replays.

Who calls what: the engine makes one :class:`KVEventPublisher` when
``--kv-events-endpoint`` is set and hands :meth:`KVEventPublisher.record` to what holds
KV (the block manager, the CPU tier's index, the disk tier, the write-through to a shared
tier). ``record`` only appends to a list under a lock, from any thread, so no step waits
on the network. One thread of the publisher's own owns both sockets (ZeroMQ sockets are
not thread-safe): every ``interval_s`` it sends the events recorded since as one
:class:`~kv_events.messages.EventBatch` with the next sequence number, keeps the last
``buffer_batches`` batches, and keeps what each medium holds now. An idle engine sends
an empty batch every ``heartbeat_s``.

Replay (a follower that missed batches, or one that starts or restarts): a DEALER sends
one frame, the first sequence number it wants as 8 bytes big-endian (``SNAPSHOT_SEQ``: the
whole state). The publisher answers with ``[seq, payload]`` for every kept batch from
there on, or, when those batches are no longer kept (or a snapshot was asked), with one
snapshot batch (``snapshot=True``: everything held now) numbered as the last batch sent;
then ``[END_SEQ, b""]``. Following a snapshot with the batches after its number gives the
state exactly: applying a batch twice changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque

import zmq

from kv_events.messages import Cleared, EventBatch, Removed, Stored, encode_batch

log = logging.getLogger(__name__)

#: a replay request for the whole state, and the frame that ends a replay's answer
SNAPSHOT_SEQ = -1
END_SEQ = -2
DEFAULT_TOPIC = b"kvstash"


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


class KVEventPublisher:
    """One per engine; binds its endpoints at construction (a taken port raises
    ``ValueError`` naming it) and publishes until :meth:`close`."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        engine_id: str,
        block_size: int,
        chunk_size: int,
        interval_s: float = 0.05,
        heartbeat_s: float = 1.0,
        buffer_batches: int = 10_000,
        topic: bytes = DEFAULT_TOPIC,
    ) -> None:
        if interval_s <= 0 or buffer_batches <= 0:
            raise ValueError(
                f"interval_s and buffer_batches must be positive, got {interval_s} and {buffer_batches}"
            )
        self.engine_id = engine_id
        self.epoch = uuid.uuid4().hex
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.interval_s = interval_s
        #: an idle engine still sends an empty batch this often: followers see it is alive,
        #: and one that reconnected (or whose engine restarted) learns the epoch and number
        self.heartbeat_s = heartbeat_s
        self._last_send = 0.0
        self.topic = topic
        self._context = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._bound(zmq.PUB, endpoint, "--kv-events-endpoint")
            self._replay = self._bound(zmq.ROUTER, replay_endpoint, "--kv-events-replay-endpoint")
        except ValueError:
            if self._pub is not None:
                self._pub.close()
            self._context.term()
            raise
        #: the endpoints as bound (a port 0 or a ``*`` host resolved): what followers connect to
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._pending: list[Stored | Removed | Cleared] = []
        # the publishing thread's own state
        self._seq = -1
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._medium_to_keys: dict[str, set[str]] = {}
        #: batches sent and replay requests answered (tests, /metrics)
        self.num_batches = 0
        self.num_replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstash-kv-events", daemon=True)
        self._thread.start()

    def _bound(self, kind: int, endpoint: str, flag: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ValueError(f"{flag} {endpoint}: cannot bind ({exc})") from None
        return sock

    # ---- any thread --------------------------------------------------------------
    def record(self, kind: str, medium: str, keys: list[str] | tuple[str, ...] = ()) -> None:
        """Note a change (``kind``: ``stored``, ``removed`` or ``cleared``); published
        with the next batch. Cheap and non-blocking; any thread."""
        if kind == "stored":
            event = Stored(medium, list(keys))
        elif kind == "removed":
            event = Removed(medium, list(keys))
        elif kind == "cleared":
            event = Cleared(medium)
        else:
            raise ValueError(f"unknown KV event kind {kind!r} (stored, removed or cleared)")
        if not keys and kind != "cleared":
            return
        with self._lock:
            self._pending.append(event)

    def close(self) -> None:
        """Publish what is pending, stop the thread, close the sockets (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._pub.close()
        self._replay.close()
        self._context.term()

    # ---- the publishing thread ---------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        next_send = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            timeout_ms = max(0.0, next_send - time.monotonic()) * 1000
            if dict(poller.poll(timeout_ms)).get(self._replay):
                self._answer_replay()
            if time.monotonic() >= next_send:
                self._send_pending()
                next_send = time.monotonic() + self.interval_s
        self._send_pending()

    def _batch(self, events: list, *, snapshot: bool = False) -> EventBatch:
        return EventBatch(
            time.time(), self.engine_id, self.epoch, self.block_size, self.chunk_size, events, snapshot
        )

    def _send_pending(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        if not events and time.monotonic() - self._last_send < self.heartbeat_s:
            return
        for event in events:
            if isinstance(event, Stored):
                self._medium_to_keys.setdefault(event.medium, set()).update(event.keys)
            elif isinstance(event, Removed):
                self._medium_to_keys.get(event.medium, set()).difference_update(event.keys)
            else:
                self._medium_to_keys.pop(event.medium, None)
        self._seq += 1
        payload = encode_batch(self._batch(events))
        self._sent.append((self._seq, payload))
        self._pub.send_multipart([self.topic, seq_bytes(self._seq), payload])
        self._last_send = time.monotonic()
        self.num_batches += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity = frames[0]
        try:
            first_seq = seq_from(frames[-1])
        except ValueError as exc:
            log.warning("KV event replay request refused: %s", exc)
            self._replay.send_multipart([identity, seq_bytes(END_SEQ), b""])
            return
        self.num_replays += 1
        kept = [(seq, payload) for seq, payload in self._sent if seq >= first_seq]
        oldest_kept = self._sent[0][0] if self._sent else self._seq + 1
        if first_seq == SNAPSHOT_SEQ or first_seq < oldest_kept:
            events = [Stored(medium, sorted(keys)) for medium, keys in self._medium_to_keys.items() if keys]
            kept = [(self._seq, encode_batch(self._batch(events, snapshot=True)))]
        for seq, payload in kept:
            self._replay.send_multipart([identity, seq_bytes(seq), payload])
        self._replay.send_multipart([identity, seq_bytes(END_SEQ), b""])
