"""Put and Get values in protobuf's wire format, written and read directly (no message objects).

Building each piece as a protobuf message and serializing it copies the bytes
three times, and parsing does the same on the other side; on the hit path that
is most of the cost. So both the ``grpc://`` tier (client) and the cache server
write and read the pieces in protobuf's documented wire format themselves
(field tag, length, bytes) through memoryviews: one copy per piece. The bytes
on the wire are exactly the PutRequest / GetResponse messages of
``protos/kvstash.proto``, so generated and reflection-based clients
interoperate unchanged. Pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator

from protos import kvstash_pb2

#: bytes of value per Put/Get message
PIECE_BYTES = 1 << 20
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
PUT_DATA_FIELD = kvstash_pb2.PutRequest.DESCRIPTOR.fields_by_name["data"].number
GET_DATA_FIELD = kvstash_pb2.GetResponse.DESCRIPTOR.fields_by_name["data"].number
GET_TOTAL_SIZE_FIELD = kvstash_pb2.GetResponse.DESCRIPTOR.fields_by_name["total_size"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(view) or shift > 63:
            raise ValueError("malformed message: bad varint")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position


def parse_fields(message: bytes) -> dict[int, int | memoryview]:
    """Top-level fields of one serialized message: number → int (varint) or memoryview (bytes).

    Length-delimited fields come back as views into ``message`` (no copy). A
    repeated field keeps its last value, as protobuf does for scalars.
    Raises ValueError for a malformed message.
    """
    view = memoryview(message)
    fields: dict[int, int | memoryview] = {}
    position = 0
    while position < len(view):
        key, position = _read_varint(view, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == _WIRE_VARINT:
            fields[number], position = _read_varint(view, position)
        elif wire_type == _WIRE_LEN:
            length, position = _read_varint(view, position)
            if position + length > len(view):
                raise ValueError("malformed message: field runs past the end")
            fields[number] = view[position : position + length]
            position += length
        elif wire_type in (_WIRE_I64, _WIRE_I32):
            position += 8 if wire_type == _WIRE_I64 else 4
        else:
            raise ValueError(f"malformed message: wire type {wire_type}")
    if position != len(view):
        raise ValueError("malformed message: truncated field")
    return fields


def piece_messages(head: bytes, data_field: int, data: bytes) -> Iterator[bytes]:
    """Serialized messages carrying ``data`` in pieces of PIECE_BYTES: the first starts with
    ``head`` (the other fields, already serialized), each has one ``data_field``."""
    view = memoryview(data)
    tag = _varint((data_field << 3) | _WIRE_LEN)
    for start in range(0, max(len(data), 1), PIECE_BYTES):
        piece = view[start : start + PIECE_BYTES]
        yield b"".join((head if start == 0 else b"", tag, _varint(len(piece)), piece))


def put_messages(key: str, data: bytes) -> Iterator[bytes]:
    """The Put stream for one value, serialized (key and total_size ride on the first message)."""
    head = kvstash_pb2.PutRequest(key=key, total_size=len(data)).SerializeToString()
    return piece_messages(head, PUT_DATA_FIELD, data)


def value_from_get_messages(messages: Iterator[bytes]) -> bytes:
    """The value carried by a serialized Get stream; ValueError when it is inconsistent."""
    total_size = None
    pieces = []
    for message in messages:
        fields = parse_fields(message)
        if total_size is None:
            total_size = fields.get(GET_TOTAL_SIZE_FIELD, 0)
        pieces.append(fields.get(GET_DATA_FIELD, b""))
    data = b"".join(pieces)
    if total_size is None or len(data) != total_size:
        raise ValueError(f"incomplete Get stream: {len(data)} bytes, announced {total_size}")
    return data
