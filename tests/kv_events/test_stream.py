"""kv_events: a real publisher and real followers over ZeroMQ on loopback. A follower
that starts late gets the state as a snapshot, one that misses batches gets them replayed
(or a snapshot when the publisher no longer keeps them), and one whose engine restarted
drops what it knew."""

from __future__ import annotations

import time

import pytest
import zmq

from kv_events.follower import KVEventFollower
from kv_events.messages import CPU, GPU, EventBatch, Stored, decode_batch, encode_batch
from kv_events.publisher import END_SEQ, KVEventPublisher, seq_bytes, seq_from

ANY_PORT = "tcp://127.0.0.1:*"


def publisher(**options) -> KVEventPublisher:
    options = {"engine_id": "e1", "block_size": 16, "chunk_size": 256, "interval_s": 0.01, **options}
    return KVEventPublisher(options.pop("endpoint", ANY_PORT), options.pop("replay", ANY_PORT), **options)


def follow(pub: KVEventPublisher) -> KVEventFollower:
    return KVEventFollower(pub.endpoint, pub.replay_endpoint, replay_timeout_s=5.0)


def until(condition, follower: KVEventFollower, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s (state {follower.state})")
        follower.poll(0.05)


def test_a_follower_sees_stores_removals_and_clears_in_order():
    pub = publisher()
    follower = follow(pub)
    try:
        follower.poll(0.1)
        assert follower.synced
        pub.record("stored", GPU, ["a", "b", "c"])
        pub.record("stored", CPU, ["k1", "k2"])
        pub.record("removed", GPU, ["b"])
        until(lambda: follower.state.medium_to_keys.get(CPU) == {"k1", "k2"}, follower, "the stores")
        assert follower.state.medium_to_keys[GPU] == {"a", "c"}
        assert follower.state.num_leading(GPU, ["a", "b", "c"]) == 1
        assert (follower.state.engine_id, follower.state.block_size, follower.state.chunk_size) == (
            "e1",
            16,
            256,
        )
        pub.record("cleared", GPU)
        until(lambda: GPU not in follower.state.medium_to_keys, follower, "the clear")
        assert follower.state.medium_to_keys[CPU] == {"k1", "k2"}
        assert follower.num_gaps == 0
    finally:
        follower.close()
        pub.close()


def test_a_late_follower_starts_from_a_snapshot():
    pub = publisher()
    try:
        for index in range(20):
            pub.record("stored", CPU, [f"k{index}"])
            pub.record("removed", CPU, [f"k{index - 1}"])
        time.sleep(0.1)
        assert pub.num_batches >= 1
        follower = follow(pub)
        follower.poll(0.0)
        assert follower.synced and follower.num_snapshots == 1
        assert follower.state.medium_to_keys[CPU] == {"k19"}
        assert follower.last_seq == pub.num_batches - 1
        follower.close()
    finally:
        pub.close()


def _gap(pub: KVEventPublisher, follower: KVEventFollower, num_missed: int) -> None:
    """Unsubscribe, publish ``num_missed`` batches the follower never receives, subscribe again."""
    follower._sub.setsockopt(zmq.UNSUBSCRIBE, pub.topic)
    time.sleep(0.3)  # the PUB side learns the unsubscription
    for index in range(num_missed):
        pub.record("stored", CPU, [f"missed{index}"])
        time.sleep(0.03)  # one batch each
    follower._sub.setsockopt(zmq.SUBSCRIBE, pub.topic)
    time.sleep(0.3)


@pytest.mark.parametrize("buffer_batches,num_snapshots", [(100, 1), (2, 2)], ids=["replayed", "snapshot"])
def test_missed_batches_are_replayed_or_replaced_by_a_snapshot(buffer_batches, num_snapshots):
    pub = publisher(buffer_batches=buffer_batches)
    follower = follow(pub)
    try:
        follower.poll(0.1)
        pub.record("stored", CPU, ["first"])
        until(lambda: "first" in follower.state.medium_to_keys.get(CPU, ()), follower, "the first store")
        _gap(pub, follower, 5)
        pub.record("stored", CPU, ["after"])
        until(
            lambda: "after" in follower.state.medium_to_keys.get(CPU, ()), follower, "the store after the gap"
        )
        assert follower.state.medium_to_keys[CPU] == {"first", "after", *(f"missed{i}" for i in range(5))}
        assert follower.num_gaps == 1 and follower.num_snapshots == num_snapshots
        assert follower.synced and follower.last_seq == pub.num_batches - 1
    finally:
        follower.close()
        pub.close()


def test_a_restarted_engine_replaces_what_the_follower_knew():
    first = publisher()
    endpoint, replay = first.endpoint, first.replay_endpoint
    follower = follow(first)
    try:
        first.record("stored", GPU, ["old"])
        until(lambda: "old" in follower.state.medium_to_keys.get(GPU, ()), follower, "the old store")
        first.close()
        second = publisher(endpoint=endpoint, replay=replay)
        try:
            second.record("stored", GPU, ["new"])
            until(
                lambda: follower.state.medium_to_keys.get(GPU) == {"new"}, follower, "the new engine's state"
            )
            assert follower.num_restarts == 1 and follower.state.epoch == second.epoch
        finally:
            second.close()
    finally:
        follower.close()


def test_a_taken_port_is_named_and_a_bad_replay_request_is_answered():
    pub = publisher()
    try:
        with pytest.raises(ValueError, match="--kv-events-endpoint .*cannot bind"):
            publisher(endpoint=pub.endpoint)
        with pytest.raises(ValueError, match="--kv-events-replay-endpoint .*cannot bind"):
            publisher(replay=pub.replay_endpoint)
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send(b"short")
        assert dealer.poll(5000)
        seq_frame, payload = dealer.recv_multipart()
        assert (seq_from(seq_frame), payload) == (END_SEQ, b"")
        dealer.close()
        context.term()
    finally:
        pub.close()
    with pytest.raises(ValueError, match="interval_s and buffer_batches must be positive"):
        publisher(interval_s=0)
    with pytest.raises(ValueError, match="unknown KV event kind"):
        KVEventPublisher.record(pub, "added", GPU, ["a"])


def test_the_wire_format_round_trips_and_refuses_garbage():
    batch = EventBatch(1.5, "e", "ep", 16, 256, [Stored(GPU, ["a"])], snapshot=True)
    assert decode_batch(encode_batch(batch)) == batch
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(b"\x93garbage")
    assert seq_from(seq_bytes(-1)) == -1
    with pytest.raises(ValueError, match="8 bytes"):
        seq_from(b"123")
