"""What each replica holds, from its KV events (docs/architecture.md, KV events), kept
on a thread per replica so that routing never waits for the network.

One :class:`ReplicaIndex` per replica owns a `KVEventFollower` (its sockets belong to the
index's thread). After each poll the thread publishes what routing reads: ``state`` (the
follower's `EngineKV` while it is in sync with the engine, else None: a replica whose
stream does not answer counts as holding nothing) and ``key_heads`` (per chunk medium, the
text in front of every chunk key's hash: the key prefix and the model's namespace, learned
from the keys themselves). Routing (the event loop) only looks keys up in ``state``'s sets
and dicts, single operations that CPython's GIL keeps whole while the thread applies
batches.
"""

from __future__ import annotations

import logging
import threading

from kv_events.follower import EngineKV, KVEventFollower
from kv_events.messages import GPU

log = logging.getLogger("kvstash.router")

#: how long one poll waits for a batch (the thread's pace while nothing arrives)
POLL_TIMEOUT_S = 0.05
#: a replay or snapshot that gets no answer within this is asked again at the next poll
REPLAY_TIMEOUT_S = 1.0


class ReplicaIndex:
    """The KV index of the replica at ``url``, fed by its events at ``endpoint`` (PUB)
    and ``replay_endpoint`` (ROUTER). :meth:`start` starts the thread, :meth:`close`
    stops it."""

    def __init__(self, url: str, endpoint: str, replay_endpoint: str) -> None:
        self.url = url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        #: what the replica holds while the follower is in sync, else None
        self.state: EngineKV | None = None
        #: chunk medium -> ``key_prefix + namespace + ":"`` of its keys
        self.key_heads: dict[str, str] = {}
        #: drops asked for by the event loop (:meth:`drop`), and those the thread acted on
        self._num_drops = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvstash-router-index-{url}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def drop(self) -> None:
        """The replica stopped answering: forget its index now (routing sees nothing) and
        ask its stream for a snapshot, which comes once it is back."""
        self._num_drops += 1
        self.state = None

    def _run(self) -> None:
        follower = KVEventFollower(self.endpoint, self.replay_endpoint, replay_timeout_s=REPLAY_TIMEOUT_S)
        num_drops = 0
        try:
            while not self._stop.is_set():
                if self._num_drops != num_drops:
                    num_drops = self._num_drops
                    follower.resync()
                try:
                    follower.poll(POLL_TIMEOUT_S)
                except ValueError as error:  # a payload that is no event batch
                    log.warning("replica %s: bad KV event (%s); asking for a snapshot", self.url, error)
                    follower.resync()
                    continue
                if follower.synced and self._num_drops == num_drops:
                    self.key_heads = _key_heads(follower.state)
                    self.state = follower.state
                else:
                    self.state = None
        finally:
            follower.close()


def _key_heads(state: EngineKV) -> dict[str, str]:
    """Per chunk medium, what stands before the hash in its keys (one key read)."""
    heads = {}
    for medium, keys in list(state.medium_to_keys.items()):
        if medium == GPU or not keys:
            continue
        key = next(iter(keys), None)
        if key is not None and ":" in key:
            heads[medium] = key[: key.rindex(":") + 1]
    return heads
