"""What an engine says about its KV on the event stream (docs/architecture.md, KV events).

An engine publishes, per medium (``gpu``: its prefix cache; ``cpu``, ``disk``: its own
offload tiers; ``redis``, ``grpc``: a tier it shares with other engines), which KV it now
holds (:class:`Stored`) and which it dropped (:class:`Removed`, :class:`Cleared`). GPU
blocks are named by the hex of their chained block hash (``engine/block_manager.py``:
seeded by the request's cache salt); offload chunks by their chunk key (``connector/
token_db.py``: key prefix, namespace, chained hash seeded by the cache salt). So a
tenant's KV is only ever matched for a request with that tenant's salt and key prefix.

Events travel in :class:`EventBatch` es, encoded as msgpack (msgspec structs, tagged by
type): plain data any language can read. Frames on the PUB socket: ``[topic, seq as 8
bytes big-endian, payload]``; see ``kv_events.publisher`` for the replay socket.
"""

from __future__ import annotations

import msgspec

#: media a router ranks by what a hit there costs (a shared tier serves every replica)
GPU = "gpu"
CPU = "cpu"
DISK = "disk"


class Stored(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """``keys`` are now held in ``medium`` (GPU block hashes as hex, or chunk keys)."""

    medium: str
    keys: list[str]


class Removed(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """``keys`` are no longer held in ``medium`` (evicted or deleted)."""

    medium: str
    keys: list[str]


class Cleared(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Nothing is held in ``medium`` any more (a reset of the prefix cache)."""

    medium: str


Event = Stored | Removed | Cleared


class EventBatch(msgspec.Struct, array_like=True, frozen=True):
    """The events of one publishing interval, in order.

    ``engine_id`` names the engine (stable across restarts when the operator sets it);
    ``epoch`` changes at every start, so a follower drops what it knew of an engine whose
    epoch changed. ``block_size`` and ``chunk_size`` say how keys were cut (a router
    hashes a prompt the same way). ``snapshot``: the batch lists everything the engine
    holds now (the answer to a replay request for the whole state), not a change."""

    ts: float
    engine_id: str
    epoch: str
    block_size: int
    chunk_size: int
    events: list[Event]
    snapshot: bool = False


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """``ValueError`` for a payload that is no event batch (with what was wrong)."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None
