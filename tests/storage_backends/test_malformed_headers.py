"""Issue #17 item 4: hostile chunk headers, checksummed correctly so that only the header
checks stand between them and the decoder. Each is a ChunkFormatError at the first parse,
never a wrapped element count, an OverflowError, a huge allocation or a later INTERNAL."""

from __future__ import annotations

import contextlib
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zlib_ng.zlib_ng import crc32

from storage_backends.chunk import (
    ChunkFormatError,
    KVChunk,
    decode_chunk,
    encode_chunk,
    parse_header,
    verify_chunk,
)
from tests.storage_backends.helpers import forge_chunk as forge

KEY = "ns:hostile"
_CHECKSUM_AT = 44  # the CRC-32 field
_PREFIX = 48  # fixed header bytes


def refix_checksum(data: bytearray) -> bytes:
    """Recompute the CRC-32 of ``data`` after its header was changed (best effort on a broken header)."""
    (header_len,) = struct.unpack_from("<H", data, 6)
    header_len = max(_PREFIX, min(header_len, len(data)))
    checksum = crc32(
        bytes(data[header_len:]), crc32(bytes(data[_PREFIX:header_len]), crc32(bytes(data[:_CHECKSUM_AT])))
    )
    struct.pack_into("<I", data, _CHECKSUM_AT, checksum)
    return bytes(data)


def test_element_count_that_wraps_is_refused() -> None:
    # 2^32 * 2^32 * 1 wraps to 0 in 64-bit arithmetic: an empty payload "matched" it before.
    data = forge((1 << 32, 1 << 32, 1), b"LTH", b"", raw_len=0, key=KEY)
    with pytest.raises(ChunkFormatError, match="does not match shape"):
        parse_header(data)
    with pytest.raises(ChunkFormatError):
        decode_chunk(data, key=KEY)


def test_huge_lz4_raw_length_is_refused_before_decompressing() -> None:
    for raw_len in (1 << 40, (1 << 31) + 2, 300 * 16):
        data = forge((raw_len,), b"T", b"\x00" * 16, raw_len=raw_len, codec_code=1, key=KEY)
        with pytest.raises(ChunkFormatError, match="cannot decompress"):
            verify_chunk(data, key=KEY)
        with pytest.raises(ChunkFormatError):  # an OverflowError before
            decode_chunk(data, key=KEY)


@pytest.mark.parametrize(
    "layout",
    [b"LK", b"LKTH", b"LKH", b"TTT", b"LT1", b"L\xffT", b""],
    ids=["short", "long", "no T", "repeated", "digit", "not ascii", "empty"],
)
def test_layout_that_disagrees_with_the_shape_is_refused(layout: bytes) -> None:
    data = forge((2, 3, 4), layout, bytes(24), raw_len=24, key=KEY)
    with pytest.raises(ChunkFormatError, match="layout"):
        parse_header(data)
    with pytest.raises(ChunkFormatError):
        decode_chunk(data, key=KEY)


def test_a_forged_but_sound_header_still_decodes() -> None:
    # The forging helper itself is right: the same fields with a sound layout decode.
    data = forge((2, 3, 4), b"LTH", bytes(range(24)), raw_len=24, key=KEY)
    chunk = decode_chunk(data, key=KEY)
    assert chunk.tensor.shape == (2, 3, 4) and chunk.layout == "LTH"
    assert data == encode_chunk(KVChunk(torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4), "LTH"), key=KEY)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    codec=st.sampled_from(["none", "lz4"]),
    edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=6),
    fix_checksum=st.booleans(),
)
def test_random_header_mutations_raise_only_chunk_format_errors(codec, edits, fix_checksum) -> None:
    """Any byte of the header set to any value, the CRC fixed up or not: the read either
    returns a chunk of the bytes' own description or raises ChunkFormatError, nothing else."""
    chunk = KVChunk(torch.arange(2 * 2 * 3 * 1 * 2, dtype=torch.float16).reshape(2, 2, 3, 1, 2))
    data = bytearray(encode_chunk(chunk, codec, key=KEY))
    (header_len,) = struct.unpack_from("<H", data, 6)
    for position, value in edits:
        data[position % header_len] = value
    mutated = refix_checksum(data) if fix_checksum else bytes(data)
    for read in (parse_header, lambda d: verify_chunk(d, key=KEY), lambda d: decode_chunk(d, key=KEY)):
        with contextlib.suppress(ChunkFormatError):  # anything else fails the test
            read(mutated)
