"""The serialized chunk format: exact round trips, and damaged bytes that never decode (property tests)."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage_backends.chunk import (
    FORMAT_VERSION,
    MAGIC,
    ChunkFormatError,
    ChunkVersionError,
    KVChunk,
    decode_chunk,
    encode_chunk,
    parse_header,
    verify_chunk,
)
from tests.storage_backends.helpers import make_chunk

KEY = "ns:chunk"
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8]
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def chunks(draw: st.DrawFn) -> KVChunk:
    """Small chunks of any supported dtype whose bytes are arbitrary (every NaN payload included)."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = (
        draw(st.integers(1, 3)),
        2,
        draw(st.integers(0, 6)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 8)),
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = shape[0] * 2 * shape[2] * shape[3] * shape[4]
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return KVChunk(flat.view(dtype).reshape(shape))


@PROPERTY_SETTINGS
@given(chunk=chunks(), codec=st.sampled_from(["none", "lz4"]))
def test_encode_decode_round_trip_is_byte_exact(chunk: KVChunk, codec: str) -> None:
    data = encode_chunk(chunk, codec, key=KEY)
    decoded = decode_chunk(data, key=KEY)
    assert decoded.equal(chunk)
    assert decoded.dtype == chunk.dtype and decoded.num_tokens == chunk.num_tokens
    header = parse_header(data)
    assert (
        header.shape == tuple(chunk.tensor.shape) and header.codec == codec and header.total_len == len(data)
    )


@PROPERTY_SETTINGS
@given(chunk=chunks(), codec=st.sampled_from(["none", "lz4"]), data=st.data())
def test_any_changed_byte_never_decodes(chunk: KVChunk, codec: str, data: st.DataObject) -> None:
    encoded = bytearray(encode_chunk(chunk, codec, key=KEY))
    position = data.draw(st.integers(0, len(encoded) - 1), label="position")
    encoded[position] ^= data.draw(st.integers(1, 255), label="xor mask")
    with pytest.raises(ChunkFormatError):
        decode_chunk(bytes(encoded), key=KEY)


@PROPERTY_SETTINGS
@given(chunk=chunks(), codec=st.sampled_from(["none", "lz4"]), data=st.data())
def test_truncated_or_extended_bytes_never_decode(chunk: KVChunk, codec: str, data: st.DataObject) -> None:
    encoded = encode_chunk(chunk, codec, key=KEY)
    length = data.draw(st.integers(0, len(encoded) - 1), label="kept length")
    with pytest.raises(ChunkFormatError):
        decode_chunk(encoded[:length], key=KEY)
    with pytest.raises(ChunkFormatError, match="oversized"):
        decode_chunk(encoded + data.draw(st.binary(min_size=1, max_size=8), label="tail"), key=KEY)


@PROPERTY_SETTINGS
@given(garbage=st.binary(max_size=300))
def test_arbitrary_bytes_never_decode(garbage: bytes) -> None:
    with pytest.raises(ChunkFormatError):
        decode_chunk(garbage, key=KEY)


def test_bf16_special_values_survive_exactly() -> None:
    patterns = [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x3F80]  # NaNs, +-inf, -0.0, subnormal, 1.0
    bits = torch.tensor(patterns, dtype=torch.int32).to(torch.int16)  # wraps to the same 16 bits
    chunk = KVChunk(bits.view(torch.bfloat16).reshape(1, 1, 7, 1, 1), layout="LKTHD")
    for codec in ("none", "lz4"):
        decoded = decode_chunk(encode_chunk(chunk, codec, key=KEY), key=KEY)
        assert torch.equal(decoded.tensor.view(torch.int16).reshape(-1), bits)


def test_decoded_tensor_is_writable_and_owned() -> None:
    data = bytearray(encode_chunk(make_chunk(1), key=KEY))
    decoded = decode_chunk(data, key=KEY)
    decoded.tensor.view(torch.int16).fill_(7)  # no warning, no error: the tensor owns its memory
    data[-1] ^= 0xFF  # and it does not alias the input buffer
    assert torch.all(decoded.tensor.view(torch.int16) == 7)


def test_foreign_magic_and_other_versions_have_clear_errors() -> None:
    encoded = bytearray(encode_chunk(make_chunk(1), key=KEY))
    other_version = bytearray(encoded)
    struct.pack_into("<H", other_version, len(MAGIC), FORMAT_VERSION + 1)
    with pytest.raises(ChunkVersionError, match=f"version {FORMAT_VERSION + 1} is not supported"):
        decode_chunk(bytes(other_version), key=KEY)
    foreign = b"PK\x03\x04" + bytes(encoded[4:])
    with pytest.raises(ChunkFormatError, match="not a kvstash chunk"):
        decode_chunk(foreign, key=KEY)
    damaged = bytearray(encoded)
    damaged[-1] ^= 1
    with pytest.raises(ChunkFormatError, match="checksum mismatch"):
        verify_chunk(bytes(damaged), key=KEY)
    with pytest.raises(ChunkFormatError, match="truncated"):
        decode_chunk(bytes(encoded[:-1]), key=KEY)


def test_bad_chunks_and_codecs_are_rejected_at_the_source() -> None:
    with pytest.raises(ValueError, match="layout"):
        KVChunk(torch.zeros(2, 2, 3, 4), layout="LKTHD")
    with pytest.raises(ValueError, match="unsupported chunk dtype"):
        KVChunk(torch.zeros(1, 2, 1, 1, 1, dtype=torch.complex64))
    with pytest.raises(ValueError, match="unknown codec"):
        encode_chunk(make_chunk(1), "zstd", key=KEY)


def test_non_contiguous_tensors_are_encoded_by_value() -> None:
    base = make_chunk(1, num_tokens=8).tensor
    strided = base[:, :, ::2]  # every other token: not contiguous
    decoded = decode_chunk(encode_chunk(KVChunk(strided), key=KEY), key=KEY)
    assert decoded.equal(KVChunk(strided.contiguous()))


def test_layout_names_the_token_dimension() -> None:
    chunk = KVChunk(torch.zeros(3, 2, 4, 5, 6, dtype=torch.float16), layout="TKLHD")
    assert chunk.num_tokens == 3
    decoded = decode_chunk(encode_chunk(chunk, key=KEY), key=KEY)
    assert decoded.layout == "TKLHD" and decoded.num_tokens == 3
