"""The hand-written wire path of Put/Get produces and accepts exactly the messages of kvstash.proto."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.support.cache_server_values import make_value
from protos import kvstash_pb2
from storage_backends.grpc_channel import make_channel
from storage_backends.grpc_codec import PIECE_BYTES, parse_fields, put_messages, value_from_get_messages


@settings(max_examples=40, deadline=None)
@given(key=st.text(min_size=1, max_size=40), size=st.integers(0, 3 * PIECE_BYTES + 7))
def test_put_messages_parse_as_put_requests(key: str, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    messages = [kvstash_pb2.PutRequest.FromString(message) for message in put_messages(key, data)]
    assert messages[0].key == key and messages[0].total_size == size
    assert all(not message.key and not message.total_size for message in messages[1:])
    assert all(len(message.data) <= PIECE_BYTES for message in messages)
    assert b"".join(message.data for message in messages) == data


@settings(max_examples=40, deadline=None)
@given(total_size=st.integers(0, 2**64 - 1), data=st.binary(max_size=300), key=st.text(max_size=20))
def test_parse_fields_reads_what_protobuf_writes(total_size: int, data: bytes, key: str) -> None:
    serialized = kvstash_pb2.PutRequest(key=key, total_size=total_size, data=data).SerializeToString()
    fields = parse_fields(serialized)
    assert fields.get(2, 0) == total_size
    assert bytes(fields.get(3, b"")) == data and bytes(fields.get(1, b"")).decode() == key
    # Field order and unknown fields (here a fixed64 and a fixed32) do not matter.
    unknown = b"\x49" + bytes(8) + b"\x55" + bytes(4)
    reordered = kvstash_pb2.PutRequest(data=data).SerializeToString() + unknown
    reordered += kvstash_pb2.PutRequest(key=key, total_size=total_size).SerializeToString()
    assert parse_fields(reordered) == parse_fields(serialized)


def test_value_from_get_messages_checks_the_announced_size() -> None:
    messages = [
        kvstash_pb2.GetResponse(total_size=5, data=b"abc").SerializeToString(),
        kvstash_pb2.GetResponse(data=b"de").SerializeToString(),
    ]
    assert value_from_get_messages(iter(messages)) == b"abcde"
    with pytest.raises(ValueError, match="incomplete Get stream"):
        value_from_get_messages(iter(messages[:1]))


@pytest.mark.parametrize("message", [b"\x1a\x05ab", b"\x80", b"\x0b", b"\x1a"])
def test_malformed_messages_are_value_errors(message: bytes) -> None:
    with pytest.raises(ValueError, match="malformed message"):
        parse_fields(message)


def test_the_server_refuses_malformed_or_mistyped_put_messages(cache_server, cache_server_url) -> None:
    with make_channel(cache_server.address, secure=False) as channel:
        raw_put = channel.stream_unary("/kvstash.v1.KVCache/Put", request_serializer=None)
        for messages, expected in (
            ([b"\x1a\x05ab"], "malformed message"),
            ([b"\x0a\x02\xff\xfe"], "not valid UTF-8"),
            (
                [
                    kvstash_pb2.PutRequest(key="k").SerializeToString()
                    + b"\x10\x05"
                    + b"\x1a\x01x"
                    + b"\x18\x07"
                ],
                "field 3",
            ),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                raw_put(iter(messages), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert expected in caught.value.details()
        # A well-formed value through the same raw path is stored.
        value = make_value(1, key="ns/raw")
        assert (
            raw_put(put_messages("ns/raw", value), timeout=10)
            == kvstash_pb2.PutResponse(num_bytes=len(value)).SerializeToString()
        )
