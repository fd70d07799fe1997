"""receive_chunk: a chunk read from a stream into a tensor, verified as it lands, and the
stream left in step (exactly the announced bytes consumed) whatever the value holds."""

from __future__ import annotations

import io

import pytest
import torch

from storage_backends.chunk import ChunkFormatError, KVChunk, encode_chunk
from storage_backends.chunk_receiver import fresh_tensor, out_view_for, receive_chunk


def reader(stream: io.BytesIO):
    def read_exactly(view: memoryview) -> None:
        if stream.readinto(view) != len(view):
            raise ConnectionError("stream ended")

    return read_exactly


def chunk(num_tokens: int = 300) -> KVChunk:
    generator = torch.Generator().manual_seed(num_tokens)
    return KVChunk(torch.randn(2, 2, num_tokens, 2, 64, generator=generator).to(torch.bfloat16))


@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_a_value_lands_in_the_buffer_and_the_next_one_follows(codec: str) -> None:
    first, second = chunk(300), chunk(40)
    first_value, second_value = encode_chunk(first, codec, key="k"), encode_chunk(second, codec, key="k2")
    stream = io.BytesIO(first_value + second_value)
    out = torch.empty(first.tensor.numel() + 7, dtype=torch.bfloat16)
    got = receive_chunk(reader(stream), len(first_value), lambda h: out_view_for(out, h, "k"), "k")
    assert got.equal(first) and got.tensor.data_ptr() == out.data_ptr()
    assert receive_chunk(reader(stream), len(second_value), fresh_tensor, "k2").equal(second)


def corruptions() -> list[tuple[str, bytes, int, str]]:
    value = encode_chunk(chunk(), key="k")
    flipped = bytearray(value)
    flipped[-100] ^= 0x10
    header_flip = bytearray(value)
    header_flip[8] = 2  # dtype byte, bf16 → fp16: the CRC covers the header (the buffer no longer fits)
    return [
        ("payload byte", bytes(flipped), len(value), "checksum mismatch"),
        ("header byte", bytes(header_flip), len(value), "checksum mismatch"),
        ("foreign", b"GARBAGE!" * 100, 800, "not a kvstash chunk"),
        ("too short", value[:5], 5, "truncated chunk"),
        ("announced longer", value + b"\0" * 10, len(value) + 10, "its header says"),
        ("announced shorter", value[:-10], len(value) - 10, "header says"),
        ("filed under another key", encode_chunk(chunk(), key="other"), len(value), "stored for another key"),
    ]


@pytest.mark.parametrize(("name", "data", "value_len", "message"), corruptions())
def test_a_bad_value_is_a_chunk_format_error_and_the_stream_stays_in_step(
    name: str, data: bytes, value_len: int, message: str
) -> None:
    stream = io.BytesIO(data[:value_len] + b"NEXT")
    out = torch.empty(1 << 20, dtype=torch.bfloat16)
    with pytest.raises(ChunkFormatError, match=message):
        receive_chunk(reader(stream), value_len, lambda h: out_view_for(out, h, "k"), "k")
    assert stream.read() == b"NEXT", f"{name}: the rest of the value must be consumed, nothing more"


def test_a_buffer_that_cannot_hold_the_value_is_a_value_error_and_the_stream_stays_in_step() -> None:
    value = encode_chunk(chunk(), key="k")
    for out, message in (
        (torch.empty(10, dtype=torch.bfloat16), "the buffer has 10 of torch.bfloat16"),
        (torch.empty(1 << 20, dtype=torch.float16), "the buffer has 1048576 of torch.float16"),
        (torch.empty(1 << 20, dtype=torch.bfloat16)[::2], "not contiguous"),
    ):
        stream = io.BytesIO(value + b"NEXT")
        with pytest.raises(ValueError, match=message):
            receive_chunk(reader(stream), len(value), lambda h, out=out: out_view_for(out, h, "k"), "k")
        assert stream.read() == b"NEXT"


def test_a_stream_that_ends_early_is_a_transport_error() -> None:
    value = encode_chunk(chunk(), key="k")
    with pytest.raises(ConnectionError):
        receive_chunk(reader(io.BytesIO(value[:-1])), len(value), fresh_tensor, "k")
